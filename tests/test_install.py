"""A user's install, not the developer's: a wheel built from this tree, installed with the
README's documented extras into a fresh virtual environment (no dev extra, no editable
install), runs the README's commands as written from a clone's root.

The one liberty taken: the fresh environment gets this machine's torch (the CPU build in
``scripts/constraints.txt``) before the README's ``pip install``, as a user who already has
torch would -- the README says a torch in the tested range is kept -- because an unpinned
torch here would be a multi-GB CUDA build.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from install_support import build_wheel, fresh_env, run
from tests_support import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _readme_block(start: str) -> list[str]:
    """The commands of the README's fenced block whose first command starts with ``start``."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    for block in blocks:
        lines = [ln.split("#")[0].strip() for ln in block.splitlines()]
        lines = [ln for ln in lines if ln]
        if lines and lines[0].startswith(start):
            return lines
    raise AssertionError(f"no README block starting with {start!r}")


def test_the_readme_install_runs_the_demo(tmp_path: Path) -> None:
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
    run([a.strip("'") for a in argv], clone, env, 600)
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

    out = run(demo.split(), clone, env, 800)
    acc = re.findall(r"test accuracy: (0\.\d+)", out)
    assert acc and float(acc[-1]) >= 0.9, out[-3000:]
