"""The package build's native step: libedgeroute compiled into the package (edgeroute/libedgeroute.so).

Everything else about the package is in pyproject.toml. The library's sources and per-source
compiler flags have one description, libedgeroute/build.py; this file only hands it the
output path, so `pip install .`, the wheel and editable installs (`make setup`) all build it.
Set CC to choose the compiler.

The library is loaded through ctypes, not imported as an extension module, so a wheel serves
every Python 3 (``py3-none-<platform>``). ``EDGEROUTE_WHEEL_TARGET=aarch64-linux-gnu.2.28`` with
``EDGEROUTE_OPENMP_LIB`` (a libgomp to carry) and ``CC`` builds a manylinux wheel of that
architecture and glibc instead (``make wheels``: tools/wheels.py).
"""

import importlib.util
import os
import re
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_ext import build_ext

NATIVE = Path(__file__).resolve().parent / "libedgeroute"


def _native_build():
    spec = importlib.util.spec_from_file_location("edgeroute_native_build", NATIVE / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def wheel_target() -> tuple[str, str] | None:
    """(arch, glibc) of EDGEROUTE_WHEEL_TARGET ("x86_64-linux-gnu.2.28"), None where unset."""
    target = os.environ.get("EDGEROUTE_WHEEL_TARGET")
    if not target:
        return None
    match = re.fullmatch(r"(x86_64|aarch64)-linux-gnu\.(2\.\d+)", target)
    if match is None:
        raise SystemExit(f"EDGEROUTE_WHEEL_TARGET={target!r}: expected ARCH-linux-gnu.GLIBC, e.g. aarch64-linux-gnu.2.28")
    return match.group(1), match.group(2)


class BuildLibedgeroute(build_ext):
    """Builds the one shared library (not a Python extension module) with build.py."""

    def get_ext_filename(self, fullname: str) -> str:
        return str(Path(*fullname.split(".")[:-1], _native_build().LIBRARY_NAME))

    def build_extension(self, ext: Extension) -> None:
        out = Path(self.get_ext_fullpath(ext.name))
        for stale in out.parent.glob("libgomp*"):  # an earlier manylinux build's OpenMP runtime
            stale.unlink()
        target = wheel_target()
        if target is None:
            _native_build().build(out, quiet=True)
            return
        openmp = os.environ.get("EDGEROUTE_OPENMP_LIB")
        if not openmp:
            raise SystemExit("EDGEROUTE_WHEEL_TARGET needs EDGEROUTE_OPENMP_LIB: the libgomp the wheel carries")
        _native_build().build(out, arch=target[0], glibc=target[1], openmp=Path(openmp), quiet=True)


class PlatformWheel(bdist_wheel):
    """py3-none-<platform>: any Python 3 loads the library; the platform is this machine's, or
    manylinux_<glibc>_<arch> for EDGEROUTE_WHEEL_TARGET."""

    def get_tag(self) -> tuple[str, str, str]:
        platform = super().get_tag()[2]
        target = wheel_target()
        if target is not None:
            platform = f"manylinux_{target[1].replace('.', '_')}_{target[0]}"
        return "py3", "none", platform


native = _native_build()
setup(ext_modules=[Extension("edgeroute.libedgeroute", [str(s.relative_to(NATIVE.parent))
                                                        for s, _ in native.compile_units(native.host_arch())])],
      cmdclass={"build_ext": BuildLibedgeroute, "bdist_wheel": PlatformWheel})
