"""The package build's native step: libedgeroute compiled into the package (edgeroute/libedgeroute.so).

Everything else about the package is in pyproject.toml. The library's sources and per-source
compiler flags have one description, runtime/native/build.py; this file only hands it the
output path, so `pip install .`, the wheel and editable installs (`make setup`) all build it.
Set CC to choose the compiler.
"""

import importlib.util
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

NATIVE = Path(__file__).resolve().parent / "runtime" / "native"


def _native_build():
    spec = importlib.util.spec_from_file_location("edgeroute_native_build", NATIVE / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildLibedgeroute(build_ext):
    """Builds the one shared library (not a Python extension module) with build.py."""

    def get_ext_filename(self, fullname: str) -> str:
        return str(Path(*fullname.split(".")[:-1], _native_build().LIBRARY_NAME))

    def build_extension(self, ext: Extension) -> None:
        _native_build().build(Path(self.get_ext_fullpath(ext.name)), quiet=True)


native = _native_build()
setup(ext_modules=[Extension("edgeroute.libedgeroute", [str(s.relative_to(NATIVE.parents[1]))
                                                        for s, _ in native.compile_units(native.host_arch())])],
      cmdclass={"build_ext": BuildLibedgeroute})
