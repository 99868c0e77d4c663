"""The package's rooms and which way they may lean: no import cycle (lazy imports inside functions
count: they close a cycle at run time as surely as a module-level one), and the device runtime
imports nothing of the workstation side (export, calibration, quality, measurement, the TensorRT
build, the CLI), nor the shared core modules anything above them. Read from the source (ast), so a lazy
import that no test happens to run is seen too. Imports under ``if TYPE_CHECKING:`` never run and
are left out."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "edgeroute"
WORKSTATION = ("edgeroute.export", "edgeroute.calibration", "edgeroute.quality", "edgeroute.tensorrt", "edgeroute.measure",
               "edgeroute.cli")


def _modules(root: Path = PACKAGE) -> dict[str, Path]:
    modules = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    hidden: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            hidden.update(id(inner) for inner in ast.walk(node))
    return hidden


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the package's modules it imports (``from a import b`` counts a.b where b is a
    module, else a)."""
    modules = _modules(root)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        hidden = _type_checking_nodes(tree)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(tree):
            if id(node) in hidden:
                continue
            if isinstance(node, ast.Import):
                graph[name].update(alias.name for alias in node.names if alias.name in modules)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                for alias in node.names:
                    target = f"{base}.{alias.name}"
                    if target in modules:
                        graph[name].add(target)
                    elif base in modules:
                        graph[name].add(base)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_package_has_no_import_cycle():
    assert cycles(import_graph()) == []


def test_the_cycle_finder_sees_a_cycle_closed_by_a_lazy_import(tmp_path):
    package = tmp_path / "edgeroute"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from edgeroute.b import thing\n")
    (package / "b.py").write_text("def thing():\n    from edgeroute import a\n    return a\n")
    (package / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from edgeroute import a\n")
    (package / "d.py").write_text("from . import c\n")
    graph = import_graph(package)
    assert cycles(graph) == [["edgeroute.a", "edgeroute.b"]]
    assert graph["edgeroute.c"] == set() and graph["edgeroute.d"] == {"edgeroute.c"}


def test_the_device_runtime_imports_nothing_of_the_workstation_side():
    graph = import_graph()
    leaks = {name: sorted(d for d in deps if d.startswith(WORKSTATION))
             for name, deps in graph.items() if name.startswith("edgeroute.runtime")}
    assert {name: deps for name, deps in leaks.items() if deps} == {}


def test_the_core_modules_import_no_room_above_them():
    """edgeroute.bundle, .arch, .errors, ...: what export, runtime and calibration share."""
    graph = import_graph()
    core = [name for name, path in _modules().items() if path.parent == PACKAGE and path.name != "__init__.py"
            and name != "edgeroute.cli"]
    above = {name: sorted(d for d in graph[name] if d.count(".") > 1) for name in core}
    assert {name: deps for name, deps in above.items() if deps} == {}
