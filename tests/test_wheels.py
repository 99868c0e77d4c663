"""The wheels for the boards (``make wheels``, tools/wheels.py): manylinux_2_28 wheels for x86_64
and aarch64 built on this machine, whose libraries ask for no glibc symbol above 2.28 and carry
their own OpenMP runtime, installed from the file and run: the x86_64 one in a fresh venv, the
aarch64 one in the emulated arm64 Python (tools/qemu/arm_python.py), with no compiler on PATH,
``--backend auto`` taking the native kernels."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

from edgeroute.bundle import Bundle

REPO = Path(__file__).resolve().parents[1]
# what a manylinux wheel may leave to the system (PEP 600: the glibc libraries)
SYSTEM_LIBRARIES = {"libc.so.6", "libm.so.6", "libpthread.so.0", "libdl.so.2", "librt.so.1", "ld-linux-x86-64.so.2",
                    "ld-linux-aarch64.so.1"}
PROMPT = "Three tips for staying awake on a long drive:"


def _load_script(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


wheels_tool = _load_script(REPO / "tools" / "wheels.py")


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> dict[str, Path]:
    """Both wheels, built once as ``make wheels`` builds them (~1 min each on 2 cores)."""
    if importlib.util.find_spec("ziglang") is None:
        pytest.skip("no ziglang (the dev extra: pip install -e '.[dev]'): the wheels link with zig")
    missing = [cc for cc in wheels_tool.COMPILERS.values() if shutil.which(cc) is None]
    if missing:
        pytest.skip(f"no {', '.join(missing)} (Debian: gcc-aarch64-linux-gnu; .ci/run installs it)")
    out = tmp_path_factory.mktemp("dist")
    cache = REPO / "build-native" / "openmp"
    return {arch: wheels_tool.build_wheel(arch, out, wheels_tool.openmp_runtime(arch, cache))
            for arch in wheels_tool.ARCHES}


def _libraries(wheel: Path, into: Path) -> dict[str, Path]:
    with zipfile.ZipFile(wheel) as archive:
        names = [n for n in archive.namelist() if re.search(r"\.so(\.\d+)*$", n)]
        archive.extractall(into, names)
    return {Path(n).name: into / n for n in names}


def _dynamic(library: Path) -> tuple[list[str], list[str], set[str]]:
    """NEEDED entries, RUNPATH entries and the GLIBC_x.y versions of the symbols it imports."""
    section = subprocess.run(["readelf", "-dW", str(library)], capture_output=True, text=True, check=True).stdout
    needed = re.findall(r"\(NEEDED\).*\[(.+)\]", section)
    runpath = re.findall(r"\((?:RUNPATH|RPATH)\).*\[(.+)\]", section)
    symbols = subprocess.run(["readelf", "--dyn-syms", "-W", str(library)], capture_output=True, text=True,
                             check=True).stdout
    versions = set(re.findall(r"\bUND\b\s+\S+@(GLIBC_[\d.]+)", symbols))
    return needed, runpath, versions


@pytest.mark.parametrize("arch", ["x86_64", "aarch64"])
def test_the_wheel_needs_no_glibc_symbol_above_2_28_and_carries_its_openmp_runtime(wheels, arch, tmp_path):
    wheel = wheels[arch]
    assert wheel.name.endswith(f"-py3-none-manylinux_2_28_{arch}.whl"), wheel.name
    libraries = _libraries(wheel, tmp_path)
    assert "libedgeroute.so" in libraries and any(n.startswith("libgomp-") for n in libraries), sorted(libraries)
    for name, library in libraries.items():
        needed, runpath, versions = _dynamic(library)
        newest = max((tuple(int(v) for v in version.removeprefix("GLIBC_").split(".")) for version in versions),
                     default=(0,))
        assert versions and newest <= (2, 28), f"{name} imports {sorted(versions)}"
        outside = [n for n in needed if n not in SYSTEM_LIBRARIES and n not in libraries]
        assert not outside, f"{name} needs {outside}, neither in the wheel nor part of glibc"
    needed, runpath, _ = _dynamic(libraries["libedgeroute.so"])
    assert "libgomp.so.1" not in needed and runpath == ["$ORIGIN"], (needed, runpath)
    assert wheels_tool.check(wheel).startswith("manylinux_2_")  # auditwheel: 2_28 or older


@pytest.fixture(scope="module")
def demo(smollm2_bundles) -> Bundle:
    return Bundle.open(smollm2_bundles["int4"][0])


_LIBGOMP_MAPPED = ("import re, edgeroute.runtime.backends.native as n; n.native_library(); "
                   "print('libgomp from', *sorted({m for m in re.findall(r'\\S*libgomp\\S*', open('/proc/self/maps').read())}))")


@pytest.mark.slow
def test_the_x86_64_wheel_installs_into_a_fresh_venv_and_runs_the_demo_on_native_kernels(wheels, demo, tmp_path):
    """pip installs the file into a venv of its own (its dependencies: this venv's, through a
    .pth file, so nothing is downloaded); no compiler on PATH, no EDGEROUTE_NATIVE_LIB."""
    fresh = tmp_path / "venv"
    venv.create(fresh, with_pip=False)
    python = fresh / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index",
                    str(wheels["x86_64"])], check=True, capture_output=True)
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "EDGEROUTE_NATIVE_LIB", "CC")}
    env["PATH"] = str(fresh / "bin")
    assert shutil.which("cc", path=env["PATH"]) is None and shutil.which("gcc", path=env["PATH"]) is None

    mapped = subprocess.run([str(python), "-c", _LIBGOMP_MAPPED], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert mapped.returncode == 0, mapped.stderr[-3000:]
    assert mapped.stdout.split()[2:] == [str(site / "edgeroute" / n) for n in os.listdir(site / "edgeroute")
                                         if n.startswith("libgomp-")], mapped.stdout
    done = subprocess.run([str(fresh / "bin" / "edgeroute"), "run", str(demo.path), "--backend", "auto", "--mode", "full",
                           "--max-new-tokens", "8", "--prompt", PROMPT], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"\(native (avx2|avx512-vnni) kernels", done.stderr), done.stderr[-2000:]


@pytest.fixture(scope="module")
def arm_python():
    """tools/qemu/arm_python.py and its root filesystem (build-native/arm64-python, built once:
    debootstrap and pip download, ~90 s), or a skip saying what this host lacks."""
    module = _load_script(REPO / "tools" / "qemu" / "arm_python.py")
    if (why := module.usable()) is not None:
        pytest.skip(f"no emulated aarch64 Python: {why}")
    root = REPO / "build-native" / "arm64-python"
    if not (root / "site" / "onnxruntime").is_dir():
        module.build(root)
    return module, root


@pytest.mark.slow
def test_the_aarch64_wheel_installs_into_the_emulated_arm64_python_and_runs_the_demo_on_dotprod(wheels, demo,
                                                                                             arm_python, tmp_path):
    """pip installs the file for the rootfs's Python (aarch64, manylinux_2_28); the emulated
    Python on a Neoverse N1 (Orin-like) imports edgeroute from there alone (the checkout is not on
    its path) with no compiler on PATH, and ``auto`` takes the native dotprod kernels, their
    OpenMP runtime the wheel's."""
    from tokenizers import Tokenizer

    module, root = arm_python
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--only-binary=:all:",
                    "--implementation", "cp", "--python-version", module.python_version(root),
                    "--platform", "manylinux_2_28_aarch64", "--target", str(site), str(wheels["aarch64"])],
                   check=True, capture_output=True)
    ids = Tokenizer.from_file(str(demo.file("tokenizer.json"))).encode(PROMPT).ids
    script = (f"import sys, runpy, edgeroute; print('package', edgeroute.__file__); {_LIBGOMP_MAPPED}; "
              f"sys.argv = ['greedy_steps', {str(demo.path)!r}, '--backend', 'auto', '--tokens', '4', "
              f"*{[str(i) for i in ids]!r}]; runpy.run_path({str(REPO / 'tools' / 'qemu' / 'greedy_steps.py')!r}, "
              "run_name='__main__')")
    command = module.command(root, "neoverse-n1", ["-c", script],
                             env={"PYTHONPATH": f"{site}:{root / 'site'}", "PATH": str(tmp_path / "no-tools")})
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=900)  # not the checkout
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    package, libgomp, ran, decoded = done.stdout.splitlines()[-4:]
    assert package == f"package {site / 'edgeroute' / '__init__.py'}"
    assert libgomp.startswith(f"libgomp from {site / 'edgeroute' / 'libgomp-'}") and len(libgomp.split()) == 3, libgomp
    assert ran == "native dotprod"
    assert len(decoded.split()) == 4
