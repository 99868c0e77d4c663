"""The device side runs with onnxruntime, numpy and tokenizers (and llguidance for response_format)
only, on Python 3.10+: no torch, transformers, onnx or export code gets imported, and no newer
syntax or stdlib."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "edgeroute"
DEVICE_FILES = sorted([
    *(PACKAGE / "runtime").rglob("*.py"),  # the backends' folder too
    *(PACKAGE / "quality").glob("*.py"),  # edgeroute eval and its checks run on the device
    *(PACKAGE / "measure").glob("*.py"),  # edgeroute bench runs on the device
    *(PACKAGE / name for name in ("__init__.py", "bundle.py", "arch.py", "rope.py", "errors.py", "chat_format.py",
                                  "texts.py", "kv_formats.py", "skip_options.py", "files.py", "llamacpp.py")),
])
# the `onnx` package only: `onnxruntime` is the device's engine
FORBIDDEN = ("torch", "transformers", "onnx", "edgeroute.export")
DEVICE_MIN_PYTHON = "3.10"

# Make the export-side packages unimportable, as on a device where they are not installed,
# then do what the device does: verify a bundle, load the runtime, run a forward pass.
DEVICE_SCRIPT = """
import importlib.abc, json, sys

FORBIDDEN = {forbidden!r}

class NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == f or name.startswith(f + ".") for f in FORBIDDEN):
            raise ModuleNotFoundError(f"No module named {{name!r}} (not installed on the device)", name=name)
        return None

sys.meta_path.insert(0, NotInstalled())

import numpy as np
from edgeroute.bundle import Bundle
from edgeroute.runtime import Engine, OrtModel

bundle = Bundle.open({bundle!r})
model = OrtModel(bundle)
logits = model.forward(model.new_cache(), [1, 504, 3458, 282])
assert logits.shape == (bundle.llm.arch.vocab_size,) and np.isfinite(logits).all(), logits.shape
engine = Engine(bundle)
text = engine.generate("The capital of France is", max_new_tokens=2).text
structured = engine.generate("The capital of France is", max_new_tokens=8,
                             response_format={{"type": "regex", "regex": "[a-z ]{{1,6}}"}})  # llguidance
assert structured.finish_reason == "eos", structured
loaded = sorted(m for m in sys.modules if any(m == f or m.startswith(f + ".") for f in FORBIDDEN))
print(json.dumps({{"loaded": loaded, "text": text}}))
"""


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)


def test_device_path_runs_without_torch_transformers_onnx_or_export_code(tiny_bundles):
    proc = run_python(DEVICE_SCRIPT.format(forbidden=FORBIDDEN, bundle=str(tiny_bundles["llama"])))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["loaded"] == []
    assert isinstance(result["text"], str)


def test_importing_the_cli_does_not_import_the_export_side():
    code = f"import sys, edgeroute.cli; print([m for m in {FORBIDDEN!r} if m in sys.modules])"
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[]"


# -- static checks ------------------------------------------------------------------------------

def imported_modules(source: str, module: str, top_level_only: bool = False) -> set[str]:
    """Absolute names of every module the source imports (anywhere, or at module level only)."""
    tree = ast.parse(source)
    package = module.rsplit(".", 1)[0]  # edgeroute.runtime.engine and edgeroute.runtime.__init__: edgeroute.runtime
    nodes = tree.body if top_level_only else ast.walk(tree)
    names: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            names.add(prefix)
            names |= {f"{prefix}.{alias.name}" for alias in node.names}  # `from edgeroute import export`
    return names


def forbidden_imports(names: set[str]) -> set[str]:
    return {n for n in names if any(n == f or n.startswith(f + ".") for f in FORBIDDEN)}


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts)


@pytest.mark.parametrize("path", DEVICE_FILES, ids=lambda p: str(p.relative_to(REPO)))
def test_device_module_imports_no_export_side_package(path):
    assert forbidden_imports(imported_modules(path.read_text(), module_name(path))) == set()


def test_cli_module_level_imports_are_device_safe():
    path = PACKAGE / "cli.py"  # `edgeroute run` on the device; `export` imports its side lazily
    assert forbidden_imports(imported_modules(path.read_text(), "edgeroute.cli", top_level_only=True)) == set()


@pytest.mark.parametrize(("source", "found"), [
    ("import torch", {"torch"}),
    ("import torch.nn as nn", {"torch.nn"}),
    ("def f():\n    from transformers import AutoTokenizer", {"transformers", "transformers.AutoTokenizer"}),
    ("import onnx", {"onnx"}),
    ("import onnxruntime as ort\nimport onnx_graphsurgeon", set()),
    ("from edgeroute.export.graphs import OPSET", {"edgeroute.export.graphs", "edgeroute.export.graphs.OPSET"}),
    ("from edgeroute import export", {"edgeroute.export"}),
    ("from ..export import pipeline", {"edgeroute.export", "edgeroute.export.pipeline"}),
    ("from . import model", set()),
])
def test_static_import_check_catches_forbidden_imports(source, found):
    assert forbidden_imports(imported_modules(source, "edgeroute.runtime.engine")) == found


# -- minimum Python version -----------------------------------------------------------------------

def vermin(paths: list[Path]) -> tuple[bool, str]:
    """Run vermin for the device's minimum Python; True when every file works on it."""
    cmd = [sys.executable, "-c", "import sys; from vermin.main import main; sys.exit(main())",
           "--no-config-file", "--no-tips", "--violations", f"-t={DEVICE_MIN_PYTHON}-", *map(str, paths)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr
    minimum = re.search(r"Minimum required versions: (?:~2, )?(?:!2, )?(\d+)\.(\d+)", proc.stdout)
    within = minimum is None or tuple(map(int, minimum.groups())) <= tuple(map(int, DEVICE_MIN_PYTHON.split(".")))
    return proc.returncode == 0 and within, proc.stdout + proc.stderr


def test_device_modules_run_on_python_3_10():
    ok, report = vermin(DEVICE_FILES)
    assert ok, report


@pytest.mark.parametrize(("snippet", "ok"), [
    ("import tomllib\n", False),
    ("try:\n    pass\nexcept* ValueError:\n    pass\n", False),
    ("from typing import Self\n", False),
    ("import datetime\nUTC = datetime.UTC\n", False),
    ("def f(x):\n    match x:\n        case 1:\n            return 1\n    return 0\n", True),
    ("from __future__ import annotations\n\ndef f(x: int | None) -> list[str]:\n    return []\n", True),
])
def test_version_check_rejects_what_3_10_lacks(tmp_path, snippet, ok):
    path = tmp_path / "snippet.py"
    path.write_text(textwrap.dedent(snippet))
    assert vermin([path])[0] is ok


def _imports(path: Path) -> set[str]:
    """The edgeroute modules ``path`` imports, at module level or inside functions (imports
    under ``if TYPE_CHECKING:`` run only for type checkers and are left out)."""
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and getattr(node.test, "id", "") == "TYPE_CHECKING" for n in ast.walk(node)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("edgeroute"):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("edgeroute")}
    return found


def _module_graph() -> dict[str, set[str]]:
    files = {".".join(f.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__"): f
             for f in PACKAGE.rglob("*.py")}
    return {name: {m for m in _imports(f) if m in files and m != name} for name, f in files.items()}


def test_bundle_and_arch_import_nothing_from_runtime_export_or_calibration():
    graph = _module_graph()
    reached, todo = set(), ["edgeroute.bundle", "edgeroute.arch"]
    while todo:
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo.extend(graph[module])
    wrong = sorted(m for m in reached if m.split(".")[1] in ("runtime", "export", "calibration"))
    assert not wrong, f"the bundle contract (bundle.py, arch.py) reaches {wrong}"
    assert len(reached) > 2  # it does import something (errors, kv_formats, ...): the walk followed it


def test_the_package_has_no_import_cycle():
    graph = _module_graph()
    state: dict[str, str] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for dependency in sorted(graph[module]):
            if state.get(dependency) == "open":
                cycle = path[path.index(dependency):] + [dependency]
                raise AssertionError(f"import cycle: {' -> '.join(cycle)}")
            if dependency not in state:
                visit(dependency, [*path, dependency])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert "edgeroute.runtime.engine" in graph and graph["edgeroute.runtime.engine"]  # the graph is real
