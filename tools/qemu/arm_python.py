"""An aarch64 Python on an x86-64 host: a Debian arm64 root filesystem (debootstrap, no chroot)
with aarch64 wheels of the device runtime's dependencies, run by ``qemu-aarch64`` as a user
program. What the tests and tools/arm_instruction_counts.py use to run edgeroute's runtime
(ONNX Runtime and the aarch64 libedgeroute) as it runs on a Jetson, slowly.

- The root filesystem: ``debootstrap --foreign --variant=minbase`` downloads and unpacks
  Debian's arm64 packages; its second stage would need to execute arm64 programs as root in a
  chroot, so instead every downloaded package is unpacked with ``dpkg-deb -x``, which is all a
  user-mode qemu needs to find the interpreter and its libraries (``QEMU_LD_PREFIX``).
- The wheels: ``pip download --platform manylinux..._aarch64 --only-binary=:all:`` of the
  runtime's dependencies, unzipped into ``site/`` (no pip runs under emulation).
- ``/proc/cpuinfo``: qemu 7.2 passes the host's through, and ONNX Runtime's cpuinfo library
  crashes on an x86 file in an aarch64 process (SIGSEGV at import). Each run therefore happens in
  a private mount namespace (``unshare -m``, root) with an Arm ``/proc/cpuinfo`` bound over the
  host's: the features of the CPU model qemu emulates, so what reads the file sees the CPU that
  HWCAP reports.

    python tools/qemu/arm_python.py build build-native/arm64-python
    python tools/qemu/arm_python.py run build-native/arm64-python --cpu neoverse-n1 \
        -E EDGEROUTE_NATIVE_LIB=build-native/aarch64/libedgeroute.so -- -c "import onnxruntime"
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SUITE = "bookworm"  # Debian 12: Python 3.11, as the project's CI
MIRROR = "http://deb.debian.org/debian"
PACKAGES = ("python3", "libgomp1", "libstdc++6")  # libgomp1: libedgeroute's OpenMP runtime
WHEELS = ("numpy", "onnxruntime", "tokenizers", "typer", "rich", "jinja2", "llguidance")
PLATFORMS = ("manylinux2014_aarch64", "manylinux_2_17_aarch64", "manylinux_2_28_aarch64")
# /proc/cpuinfo "Features" per qemu CPU model (the Linux names of the HWCAP bits each sets)
FEATURES = {
    "cortex-a57": "fp asimd evtstrm aes pmull sha1 sha2 crc32 cpuid",
    "neoverse-n1": "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop "
                   "asimddp ssbs",
    "max": "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm jscvt fcma lrcpc dcpop "
           "sha3 sm3 sm4 asimddp sha512 sve asimdfhm dit uscat ilrcpc flagm ssbs sb paca pacg dcpodp sve2 sveaes "
           "svepmull svebitperm svesha3 svesm4 flagm2 frint svei8mm svebf16 i8mm bf16",
}
CPU_PARTS = {"cortex-a57": "0xd07", "neoverse-n1": "0xd0c", "max": "0xd0c"}


def python_version(root: Path) -> str:
    """The rootfs interpreter's "3.11"-style version, from its file name."""
    found = sorted(root.glob("usr/bin/python3.[0-9]*"))
    if not found:
        raise SystemExit(f"{root} holds no python3: build it first (python {Path(__file__).name} build {root})")
    return found[-1].name.removeprefix("python")


def build(root: Path) -> Path:
    """The root filesystem and its site directory at ``root`` (rebuilt from scratch)."""
    for tool in ("debootstrap", "dpkg-deb"):
        if not shutil.which(tool):
            raise SystemExit(f"{tool} not found (Debian: apt-get install debootstrap)")
    shutil.rmtree(root, ignore_errors=True)
    subprocess.run(["debootstrap", "--arch=arm64", "--foreign", "--variant=minbase", f"--include={','.join(PACKAGES)}",
                    SUITE, str(root), MIRROR], check=True, stdout=subprocess.DEVNULL)
    archives = root / "var" / "cache" / "apt" / "archives"
    for deb in sorted(archives.glob("*.deb")):
        subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
        deb.unlink()
    version = python_version(root)
    wheels = root / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "--implementation", "cp",
                    "--python-version", version, *(f"--platform={p}" for p in PLATFORMS), "-d", str(wheels), *WHEELS],
                   check=True)
    site = root / "site"
    for wheel in sorted(wheels.glob("*.whl")):
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(site)
    shutil.rmtree(wheels)
    return root


def cpuinfo(cpu: str, cores: int = 1) -> str:
    if cpu not in FEATURES:
        raise SystemExit(f"no /proc/cpuinfo for -cpu {cpu}: one of {', '.join(FEATURES)}")
    block = (f"BogoMIPS\t: 50.00\nFeatures\t: {FEATURES[cpu]}\nCPU implementer\t: 0x41\nCPU architecture: 8\n"
             f"CPU variant\t: 0x0\nCPU part\t: {CPU_PARTS[cpu]}\nCPU revision\t: 0\n\n")
    return "".join(f"processor\t: {i}\n{block}" for i in range(cores))


def command(root: Path, cpu: str, args: list[str], env: dict[str, str] | None = None,
            plugin: Path | None = None) -> list[str]:
    """The host command line that runs ``python3 ARGS`` of the rootfs under ``qemu-aarch64 -cpu
    CPU`` (with ``plugin`` loaded), the repository and the rootfs's wheels on its path, ``env``
    in its environment. Needs root (a mount namespace)."""
    qemu = shutil.which("qemu-aarch64")
    if not qemu:
        raise SystemExit("qemu-aarch64 not found (Debian: apt-get install qemu-user)")
    fake = root / f"cpuinfo-{cpu}"
    fake.write_text(cpuinfo(cpu))
    guest_env = {"PYTHONPATH": f"{root / 'site'}:{REPO}", "PYTHONDONTWRITEBYTECODE": "1", **(env or {})}
    qemu_args = [qemu, "-cpu", cpu, "-L", str(root), *(["-plugin", str(plugin)] if plugin else []),
                 *(a for k, v in guest_env.items() for a in ("-E", f"{k}={v}")),
                 str(root / "usr" / "bin" / f"python{python_version(root)}"), *args]
    script = f"mount --bind {shlex.quote(str(fake))} /proc/cpuinfo && exec {shlex.join(qemu_args)}"
    return ["unshare", "-m", "sh", "-c", script]


def usable() -> str | None:
    """Why this host cannot run the emulated Python (None when it can)."""
    if os.geteuid() != 0:
        return "needs root (a private mount namespace for /proc/cpuinfo)"
    missing = [t for t in ("qemu-aarch64", "unshare", "debootstrap") if not shutil.which(t)]
    if missing:
        return f"{', '.join(missing)} not found (Debian: apt-get install qemu-user debootstrap)"
    done = subprocess.run(["unshare", "-m", "true"], capture_output=True, text=True)
    return f"unshare -m is refused here: {done.stderr.strip()}" if done.returncode else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="action", required=True)
    sub.add_parser("build").add_argument("root", type=Path)
    run = sub.add_parser("run")
    run.add_argument("root", type=Path)
    run.add_argument("--cpu", default="neoverse-n1", choices=sorted(FEATURES))
    run.add_argument("-E", "--env", action="append", default=[], metavar="KEY=VALUE", help="in the guest's environment")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)  # python3's arguments follow "--"
    options, args = parser.parse_args(argv[:cut]), argv[cut + 1:]
    if options.action == "build":
        print(build(options.root))
        return
    env = dict(item.split("=", 1) for item in options.env)
    raise SystemExit(subprocess.run(command(options.root, options.cpu, args, env)).returncode)


if __name__ == "__main__":
    main()
