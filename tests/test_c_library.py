"""libedgeroute as a C library: its own C tests under AddressSanitizer and UBSan (kernel sets
against the generic one, the session API, bad input, a fuzzed file reader), and the C example
decoding the demo bundle exactly as the Python backend does."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from edgeroute.bundle import Bundle

REPO = Path(__file__).resolve().parents[1]
NATIVE = REPO / "runtime" / "native"
native = pytest.importorskip("edgeroute.runtime.native")
COMPILER = shutil.which("cc") or shutil.which("gcc")
needs_compiler = pytest.mark.skipif(COMPILER is None, reason="no C compiler to build the C tests")


def _build_script():
    spec = importlib.util.spec_from_file_location("native_build", NATIVE / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _program(source: Path, out: Path, library: Path, flags: list[str]) -> Path:
    subprocess.run([COMPILER, "-std=gnu11", "-O1", "-g", *flags, f"-I{NATIVE / 'include'}", str(source), "-o", str(out),
                    f"-L{library.parent}", "-ledgeroute", f"-Wl,-rpath,{library.parent}", "-lm"],
                   check=True, capture_output=True, text=True)
    return out


@needs_compiler
def test_the_c_tests_pass_under_address_and_undefined_behaviour_sanitizers(tmp_path):
    sanitizers = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined"]
    library = _build_script().build(tmp_path / "asan" / "libedgeroute.so", sanitize=True, quiet=True)
    program = _program(REPO / "tests" / "native" / "test_c_api.c", tmp_path / "test_c_api", library, sanitizers)
    done = subprocess.run([str(program), str(tmp_path), "3000"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert done.stdout.strip().splitlines()[-1].endswith(" passed, 0 failed")
    assert "ERROR: AddressSanitizer" not in done.stderr and "runtime error" not in done.stderr


CROSS = shutil.which("aarch64-linux-gnu-gcc")
QEMU = shutil.which("qemu-aarch64")
AARCH64_SYSROOT = Path("/usr/aarch64-linux-gnu")


@pytest.mark.skipif(CROSS is None or QEMU is None or not AARCH64_SYSROOT.is_dir(),
                    reason="no aarch64 cross compiler or qemu-aarch64 (Debian: gcc-aarch64-linux-gnu qemu-user; "
                           ".ci/run installs them)")
@pytest.mark.parametrize("cpu", ["cortex-a57", "neoverse-n1", "max"])
def test_the_aarch64_library_cross_builds_and_passes_its_c_tests_under_qemu(tmp_path, cpu):
    """One aarch64 binary for every aarch64 CPU: NEON-only (Cortex-A57: Jetson Nano, TX2),
    dotprod + fp16 without i8mm (Neoverse N1, like Orin's A78AE), and everything (max)."""
    library = _build_script().build(tmp_path / "aarch64" / "libedgeroute.so", cc=CROSS, arch="aarch64", quiet=True)
    program = tmp_path / "test_c_api"
    subprocess.run([CROSS, "-std=gnu11", "-O1", f"-I{NATIVE / 'include'}", str(REPO / "tests" / "native" / "test_c_api.c"),
                    "-o", str(program), f"-L{library.parent}", "-ledgeroute", "-lm", "-fopenmp"],
                   check=True, capture_output=True, text=True)
    done = subprocess.run([QEMU, "-cpu", cpu, "-L", str(AARCH64_SYSROOT), "-E", f"LD_LIBRARY_PATH={library.parent}",
                           str(program), str(tmp_path), "500"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1].endswith(" passed, 0 failed")
    assert "kernels here: generic" in done.stdout


@pytest.fixture(scope="module")
def demo(smollm2_bundles) -> Bundle:
    return Bundle.open(smollm2_bundles["int4"][0])


@needs_compiler
@pytest.mark.slow
def test_the_c_example_decodes_the_demo_bundle_as_the_python_backend(demo, tmp_path):
    library = native.library_path()
    program = _program(REPO / "examples" / "c" / "generate.c", tmp_path / "generate", library, [])
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(demo.file("tokenizer.json"))).encode("Three tips for staying awake on a long drive:").ids
    model = native.NativeModel(demo, kv_dtype="float16")
    cache, want = model.new_cache(), []
    logits = model.forward(cache, ids)
    for _ in range(32):
        want.append(int(np.argmax(logits)))
        logits = model.forward(cache, [want[-1]])
    done = subprocess.run([str(program), str(demo.path), "-n", "32", "-k", model.kernels, "-c", "f16"],
                          input=" ".join(map(str, ids)), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert [int(t) for t in done.stdout.split()] == want
    assert f"{model.kernels} kernels" in done.stderr and "tok/s" in done.stderr
    bad = subprocess.run([str(program), str(tmp_path / "missing"), "1"], capture_output=True, text=True)
    assert bad.returncode == 1 and "cannot open" in bad.stderr


def test_the_binding_reads_the_abi_and_enums_from_the_header():
    constants = native.header_constants()
    assert constants["ER_KV_INT8"] == 2 and constants["ER_LAYER_DROP"] == 3 and constants["ER_Q6_K"] == 14
    try:
        lib = native.native_library()
    except native.NativeBackendUnavailable as err:
        pytest.skip(str(err))
    assert lib.er_abi_version() == constants["ER_ABI_VERSION"]
    assert lib.er_kernels_name(constants["ER_KERNELS_AVX512_VNNI"]).decode() == "avx512-vnni"
