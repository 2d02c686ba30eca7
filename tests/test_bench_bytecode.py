"""``ftmesh bench recovery --worker-bytecode compiled`` (the default): its ftmesh workers
import a compiled copy of the package (``compiled_tree``), as from an installed wheel, and
compile no ftmesh source at start even where Python writes no bytecode; the checkout's own
source, imported the same way, is compiled at every start (the control). Counted with the
``compile`` audit event (``builtins.compile``, which importlib calls for a module without
bytecode), not with a clock.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from ftmesh.bench.recovery import REPO_ROOT, _env, compiled_tree

# Runs in a fresh interpreter: imports what a bench worker imports first and counts the
# ftmesh modules compiled from source on the way.
PROBE = r"""
import json, sys
compiled = []
def hook(event, args):
    if event == "compile" and isinstance(args[1], str) and "/ftmesh/" in args[1]:
        compiled.append(args[1])
sys.addaudithook(hook)
import ftmesh.mesh.blocking, ftmesh.training.step
print(json.dumps({"file": ftmesh.__file__, "compiled": compiled}))
"""


def _probe(root: Path) -> dict[str, object]:
    env = {**_env(2, root), "PYTHONDONTWRITEBYTECODE": "1"}
    res = subprocess.run(
        [sys.executable, "-c", PROBE],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=root,  # as the bench's workers run (Procs: cwd first on the path)
    )
    assert res.returncode == 0, res.stderr[-2000:]
    out: dict[str, object] = json.loads(res.stdout)
    return out


def _bytecode(tree: Path) -> set[Path]:
    return set((tree / "ftmesh").rglob("*.pyc"))


def test_workers_of_the_compiled_copy_compile_no_ftmesh_source(tmp_path: Path) -> None:
    checkout_before = _bytecode(REPO_ROOT)
    root = compiled_tree(tmp_path / "tree")
    assert _bytecode(REPO_ROOT) == checkout_before  # the checkout is never written to
    sources = sorted(p.relative_to(root) for p in (root / "ftmesh").rglob("*.py"))
    assert sources == sorted(p.relative_to(REPO_ROOT) for p in (REPO_ROOT / "ftmesh").rglob("*.py"))
    copy = _probe(root)
    assert str(copy["file"]).startswith(str(root))
    assert copy["compiled"] == []
    if not any((REPO_ROOT / "ftmesh").glob("__pycache__/__init__.*.pyc")):
        # the control: the checkout without bytecode compiles what it imports, every time
        checkout = _probe(REPO_ROOT)
        assert str(checkout["file"]).startswith(str(REPO_ROOT / "ftmesh"))
        assert len(checkout["compiled"]) > 20  # type: ignore[arg-type]
