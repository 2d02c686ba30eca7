"""The floors hold: the sans-IO core loads no I/O, the package faces are lazy, no import cycles.

Three checks (docs/DESIGN-NOTES.md, "Layers, checked"):

* Each pure module, imported alone in a fresh interpreter, loads none of trio, socket,
  zeroconf, torch, nor an I/O module of ftmesh; ``threading`` only through the standard
  ``logging`` module (which imports it when loaded and starts no thread). This is what
  import-linter cannot see: a package ``__init__`` that eagerly imports its I/O parts.
* No import cycles between files: the graph of every import that runs (module level and
  function-local; not those under ``TYPE_CHECKING``) has no strongly connected component.
* The import-linter contracts (``[tool.importlinter]``, run by ``scripts/test.sh``) are kept
  by a copy of this tree, and broken by planted imports in copies of it:
  ``tests/test_import_contract.py``, which also checks grimp's file-level graph for cycles.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "ftmesh"

PURE_MODULES = (
    "ftmesh.errors",
    "ftmesh.stats",
    "ftmesh.membership.swim",
    "ftmesh.membership.wire",
    "ftmesh.sim.network",
    "ftmesh.training.step",
    "ftmesh.training.protocol",
    "ftmesh.training.shards",
    "ftmesh.collective.view",
    "ftmesh.collective.schedule",
    "ftmesh.collective.topology",
    "ftmesh.collective.reach",
    "ftmesh.collective.ops",
    "ftmesh.collective.aborts",
    "ftmesh.state.sharding",
    "ftmesh.compression",
)
"""The sans-IO core (and the pure parts it uses), each of which must import alone."""

FORBIDDEN = ("trio", "socket", "zeroconf", "torch")
IO_MODULES = ("ftmesh.net", "ftmesh.discovery", "ftmesh.mesh.core", "ftmesh.mesh.blocking")
THREADING_IMPORTERS = ("logging",)
"""Who may import ``threading`` on the way to a pure module: ``logging`` does at load."""

KNOWN_CYCLES: tuple[frozenset[str], ...] = ()
"""Cycles that remain, each with its reason. This list only shrinks."""

# Runs in a fresh interpreter: records which module asked for ``threading`` first.
PROBE = r"""
import importlib, json, sys

class Who:
    importer = None
    def find_spec(self, name, path=None, target=None):
        if name == "threading" and Who.importer is None:
            f = sys._getframe(1)
            while f is not None and (f.f_code.co_filename.startswith("<frozen")
                                     or "importlib" in f.f_code.co_filename):
                f = f.f_back
            Who.importer = f.f_globals.get("__name__") if f is not None else "?"
        return None

sys.meta_path.insert(0, Who())
importlib.import_module(sys.argv[1])
print(json.dumps({"modules": sorted(sys.modules), "threading_by": Who.importer}))
"""


def _probe(module: str) -> dict[str, object]:
    res = subprocess.run(
        [sys.executable, "-c", PROBE, module],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    out: dict[str, object] = json.loads(res.stdout)
    return out


@pytest.mark.parametrize("module", PURE_MODULES)
def test_a_pure_module_imports_alone_without_io(module: str) -> None:
    probe = _probe(module)
    modules = probe["modules"]
    assert isinstance(modules, list)
    loaded = [m for m in FORBIDDEN if m in modules]
    assert loaded == [], f"importing {module} loads {loaded}"
    io = [m for m in modules if any(m == p or m.startswith(p + ".") for p in IO_MODULES)]
    assert io == [], f"importing {module} loads ftmesh's I/O modules {io}"
    if "threading" in modules:
        assert probe["threading_by"] in THREADING_IMPORTERS, (
            f"importing {module}: threading imported by {probe['threading_by']}"
        )


def test_import_ftmesh_loads_only_the_errors_and_the_face_still_works() -> None:
    probe = _probe("ftmesh")
    modules = probe["modules"]
    assert isinstance(modules, list)
    assert [m for m in modules if m.startswith("ftmesh")] == ["ftmesh", "ftmesh.errors"]
    code = (
        "import ftmesh, ftmesh.collective as c, ftmesh.state as s, ftmesh.net as n\n"
        "for face in (ftmesh, c, s, n):\n"
        "    for name in face.__all__:\n"
        "        assert getattr(face, name) is not None, (face.__name__, name)\n"
        "    assert set(face.__all__) <= set(dir(face))\n"
        "from ftmesh import connect, Mesh, State\n"
        "from ftmesh.mesh.blocking import connect as c2\n"
        "assert connect is c2 and ftmesh.state.State is State\n"
        "try:\n"
        "    ftmesh.no_such_name\n"
        "except AttributeError:\n"
        "    pass\n"
        "else:\n"
        "    raise SystemExit('no AttributeError')\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert res.returncode == 0, res.stderr[-2000:]


def _modules(package: Path) -> dict[str, tuple[Path, bool]]:
    """Every module of ``package``: dotted name -> (file, is a package ``__init__``)."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        is_init = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_init else parts)] = (path, is_init)
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> Iterable[ast.Import | ast.ImportFrom]:
    """Every import statement that can run: anywhere but under ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def import_graph(package: Path) -> dict[str, set[str]]:
    """module -> the modules of the same package it imports (file-level edges)."""
    modules = _modules(package)
    root = package.name

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, (path, is_init) in modules.items():
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                if node.level:
                    base = mod.split(".") if is_init else mod.split(".")[:-1]
                    base = base[: len(base) - node.level + 1]
                    target = ".".join([*base, *([node.module] if node.module else [])])
                else:
                    target = node.module or ""
                # ``from pkg import sub`` imports the module pkg.sub when there is one.
                targets = [
                    f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target
                    for a in node.names
                ]
            for t in targets:
                if t.split(".")[0] == root and (found := known(t)) and found != mod:
                    graph[mod].add(found)
    return graph


def cycles(graph: Mapping[str, Iterable[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[frozenset[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(graph[w])))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    scc = set()
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        scc.add(w)
                        if w == v:
                            break
                    if len(scc) > 1:
                        out.append(frozenset(scc))
    return out


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"d"}}
    assert cycles(graph) == [frozenset({"a", "b", "c"})]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_between_files() -> None:
    graph = import_graph(PACKAGE)
    assert len(graph) > 100  # the whole package was read
    assert "ftmesh.cli.args" in graph["ftmesh.cli.worker_cmd"]  # edges are resolved
    found = cycles(graph)
    unexpected = [sorted(c) for c in found if c not in KNOWN_CYCLES]
    assert unexpected == [], f"import cycles: {unexpected}"
    assert len(found) <= len(KNOWN_CYCLES)
