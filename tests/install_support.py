"""Fresh installs for the tests of what users and images install: a wheel built from this tree,
a new virtual environment, and what a Dockerfile's ``pip install`` lines ask for (parsed from
the Dockerfile, never copied into a test)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import venv
from pathlib import Path

from tests_support import ROOT

TORCH_PIN = [
    ln for ln in (ROOT / "scripts/constraints.txt").read_text().split() if ln.startswith("torch==")
]
"""This machine's torch (the CPU build on disk): a fresh environment gets it first, as a user
who has torch would, since an unpinned torch here is a multi-GB CUDA build."""


def run(argv: list[str], cwd: Path, env: dict[str, str], timeout: float) -> str:
    proc = subprocess.run(
        argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert proc.returncode == 0, (argv, proc.stdout[-3000:], proc.stderr[-3000:])
    return proc.stdout + proc.stderr


def build_wheel(out: Path) -> Path:
    run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(ROOT)],
        ROOT,
        dict(os.environ),
        300,
    )
    (wheel,) = out.glob("ftmesh-*.whl")
    return wheel


def fresh_env(path: Path) -> dict[str, str]:
    """A new virtual environment at ``path`` with this machine's torch; the environment
    variables that put it first on ``PATH`` (and nothing of this tree's on ``PYTHONPATH``)."""
    venv.create(path, with_pip=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{path / 'bin'}{os.pathsep}{env['PATH']}"
    env["VIRTUAL_ENV"] = str(path)
    run(["pip", "install", "-q", *TORCH_PIN], path, env, 600)
    return env


def dockerfile_requirements(dockerfile: Path, wheel: Path) -> list[str]:
    """What the Dockerfile's ``RUN pip install`` lines install, with ``.`` (the copied tree)
    as ``wheel`` and torch left to ``fresh_env`` (the images take it from PyTorch's index)."""
    text = dockerfile.read_text().replace("\\\n", " ")
    reqs: list[str] = []
    for line in text.splitlines():
        m = re.match(r"\s*RUN\s+(.*)", line)
        if not m:
            continue
        for cmd in m.group(1).split("&&"):
            words = shlex.split(cmd)
            if words[:2] != ["pip", "install"]:
                continue
            skip = False
            for w in words[2:]:
                if skip:
                    skip = False
                elif w in ("--index-url", "-i", "--extra-index-url"):
                    skip = True
                elif w.startswith("-") or w.startswith("torch=="):
                    continue
                elif w.startswith("."):
                    reqs.append(f"{wheel}{w[1:]}")
                else:
                    reqs.append(w)
    assert any(r.startswith(str(wheel)) for r in reqs), f"{dockerfile} installs no ftmesh"
    return reqs
