"""The import contracts bite: ``lint-imports`` (import-linter, the ``[tool.importlinter]``
contracts of pyproject.toml that ``scripts/test.sh`` runs) passes on an unmodified copy of
the package and fails, naming the broken contract and the planted import, on a copy with one
upward import planted; and the file-level import graph that import-linter builds (grimp's)
has no cycle, while the same check finds a planted one.

Every run is on a copy of ``ftmesh/`` and pyproject.toml in a tmp dir, found first on the
``PYTHONPATH`` of a fresh process, so the real tree is never touched; without a cache, each
run takes well under a second.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from test_layers import cycles

ROOT = Path(__file__).resolve().parent.parent
LINT = Path(sys.executable).parent / "lint-imports"
CONTRACTS = {
    c["id"]: c["name"]
    for c in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"][
        "contracts"
    ]
}
FUTURE = "from __future__ import annotations\n"

# Runs in a fresh interpreter on the copy: every module's direct imports (grimp, as
# import-linter builds them; TYPE_CHECKING imports left out, as in the contracts).
GRAPH = r"""
import json, grimp
graph = grimp.build_graph("ftmesh", exclude_type_checking_imports=True)
assert graph.find_children("ftmesh"), "no package"
print(json.dumps({m: sorted(graph.find_modules_directly_imported_by(m)) for m in graph.modules}))
"""


def _copy(tmp: Path) -> Path:
    shutil.copytree(ROOT / "ftmesh", tmp / "ftmesh", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp / "pyproject.toml")
    return tmp


def _plant(root: Path, module: str, line: str) -> None:
    """Add ``line`` (an import) to ``module`` of the copy, right after its future import."""
    path = root / module
    text = path.read_text()
    assert text.count(FUTURE) == 1, module
    path.write_text(text.replace(FUTURE, f"{FUTURE}\n{line}  # planted\n"))


def _env(root: Path) -> dict[str, str]:
    # COLUMNS: rich (import-linter's output) wraps long contract names at 80 columns.
    return {"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin", "COLUMNS": "300"}


def _lint(root: Path) -> subprocess.CompletedProcess[str]:
    if not LINT.exists():
        pytest.fail("import-linter is not installed (pip install 'ftmesh[dev]')")
    return subprocess.run(
        [str(LINT), "--no-cache", "--no-logo"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=root,
        env=_env(root),
    )


def _graph(root: Path) -> dict[str, list[str]]:
    res = subprocess.run(
        [sys.executable, "-c", GRAPH],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=root,
        env=_env(root),
    )
    assert res.returncode == 0, res.stderr[-3000:]
    edges: dict[str, list[str]] = json.loads(res.stdout)
    return edges


def test_an_unmodified_copy_keeps_every_contract(tmp_path: Path) -> None:
    res = _lint(_copy(tmp_path))
    assert res.returncode == 0, res.stdout[-3000:]
    assert f"Contracts: {len(CONTRACTS)} kept, 0 broken." in res.stdout
    for name in CONTRACTS.values():
        assert f"{name} KEPT" in res.stdout


@pytest.mark.parametrize(
    ("module", "line", "broken", "chain", "rule"),
    [
        # an upward import: membership (the sans-IO core) importing the torch face
        (
            "ftmesh/membership/swim.py",
            "import ftmesh.torch",
            "layers",
            "ftmesh.membership.swim -> ftmesh.torch",
            "ftmesh.membership is not allowed to import ftmesh.torch",
        ),
        # I/O in a pure module: the step machine importing trio (no layer is crossed)
        (
            "ftmesh/training/step.py",
            "import trio",
            "pure",
            "ftmesh.training.step -> trio",
            "ftmesh.training is not allowed to import trio",
        ),
        # a pure module importing the blocking mesh, through a relative import
        (
            "ftmesh/membership/suspicion.py",
            "from ..mesh.blocking import connect",
            "layers",
            "ftmesh.membership.suspicion -> ftmesh.mesh.blocking",
            "ftmesh.membership is not allowed to import ftmesh.mesh",
        ),
    ],
)
def test_a_planted_import_breaks_its_contract(
    tmp_path: Path, module: str, line: str, broken: str, chain: str, rule: str
) -> None:
    root = _copy(tmp_path)
    _plant(root, module, line)
    res = _lint(root)
    assert res.returncode != 0, res.stdout[-3000:]
    assert f"{CONTRACTS[broken]} BROKEN" in res.stdout, res.stdout[-3000:]
    assert rule in res.stdout and chain in res.stdout, res.stdout[-3000:]
    if broken == "pure":  # (trio is no layer of ftmesh: the layers still hold)
        assert f"{CONTRACTS['layers']} KEPT" in res.stdout
    assert (ROOT / module).read_text().count("# planted") == 0  # the real tree is untouched


def test_no_file_level_import_cycle_and_the_check_finds_a_planted_one(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    graph = _graph(root)
    assert len(graph) > 100 and "ftmesh.training.held" in graph["ftmesh.training.step"]
    assert cycles(graph) == []
    # held.py is imported by step.py: importing step back from it closes a cycle
    _plant(root, "ftmesh/training/held.py", "import ftmesh.training.step")
    found = cycles(_graph(root))
    assert len(found) == 1 and {"ftmesh.training.held", "ftmesh.training.step"} <= found[0]
