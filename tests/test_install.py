"""A user's install, not the developer's: a wheel built from this tree, installed with the
README's documented extras into a fresh virtual environment (no dev extra, no editable
install), runs the README's commands as written from a clone's root.

The one liberty taken: the fresh environment already has this machine's torch (the CPU build
in ``scripts/constraints.txt``, its installed files hard-linked from the suite's environment:
``install_support.fresh_env``) before the README's ``pip install``, as a user who already
has torch would -- the README says a torch in the tested range is kept -- because an
unpinned torch here would be a multi-GB CUDA build.

The demo's run is also the suite's one proof of ``ftmesh launch`` through a kill and a join:
four workers take their first step together, the killed one is the only one that does not
finish, the joiner enters mid-run with the others' state, every step is committed once with
its whole batch, the members' digests (every 10th step, the example's default, and the final
one) agree, and the accuracy is the single process's within 0.01. (Digests at *every* step
through kills and joins: ``test_training_chaos.py``.)
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from install_support import build_wheel, fresh_env, run
from tests_support import ROOT, SingleRun, check_consistency, progress

pytestmark = [pytest.mark.slow, pytest.mark.timeout(450)]  # 122 s at most, loaded (2026-12-07)


def _readme_block(start: str) -> list[str]:
    """The commands of the README's fenced block whose first command starts with ``start``."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    for block in blocks:
        lines = [ln.split("#")[0].strip() for ln in block.splitlines()]
        lines = [ln for ln in lines if ln]
        if lines and lines[0].startswith(start):
            return lines
    raise AssertionError(f"no README block starting with {start!r}")


def test_the_readme_install_runs_the_demo(tmp_path: Path, single_run: SingleRun) -> None:
    install, version, demo = _readme_block("pip install '.[")
    assert install == "pip install '.[torch,examples]'" and version == "ftmesh --version"
    assert demo.startswith("ftmesh launch ")

    wheel = build_wheel(tmp_path / "wheels")
    clone = tmp_path / "clone"  # what the README's commands see: a checkout's root
    shutil.copytree(ROOT / "examples", clone / "examples")
    env_dir = tmp_path / "venv"
    env = fresh_env(env_dir)

    argv = install.split()
    argv[-1] = f"{wheel}[torch,examples]"  # `.` is the tree the wheel was built from
    run([a.strip("'") for a in argv], clone, env, 300)
    site = run(["python", "-c", "import ftmesh, sys; print(ftmesh.__file__)"], clone, env, 60)
    assert str(env_dir) in site and str(ROOT) not in site, site  # the wheel, not this tree
    cu = run(
        [
            "python",
            "-c",
            "from ftmesh.native import source_dir as d; print(len(list(d().glob('*.cu'))))",
        ],
        clone,
        env,
        60,
    )
    assert int(cu.split()[-1]) >= 2  # the CUDA kernel sources came with the wheel
    assert run(version.split(), clone, env, 60).strip().startswith("ftmesh 0.")

    out = run(demo.split(), clone, env, 300)
    found = re.findall(r"test accuracy: (0\.\d+)", out)
    assert found and float(found[-1]) >= 0.95, out[-3000:]
    acc = float(found[-1])
    assert abs(single_run.accuracy() - acc) <= 0.01

    (logs,) = (clone / "runs").glob("launch-*")  # where the README says worker logs go
    records = progress(logs)
    assert len(records) == 5, sorted(records)  # four at start, one joiner
    done = {name: r[-1] for name, r in records.items() if r and r[-1].get("done")}
    assert len(done) == 4, "the killed worker should be the only one not finishing"
    assert len({str(r["digest"]) for r in done.values()}) == 1, "final weights differ"
    for name in ("w0", "w1", "w2", "w3"):  # the first four took their first step together
        first = records[name][0]
        assert (first["step"], first["members"]) == (1, 4), (name, first)
    total = int(records["w0"][0]["total"])  # type: ignore[call-overload]
    check_consistency(records, total)
    joiner = records["w4"]  # entered mid-run, with the others' state
    assert 40 < int(joiner[0]["step"]) < total and joiner[0]["synced"]  # type: ignore[call-overload]
