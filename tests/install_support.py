"""Fresh installs for the tests of what users and images install: a wheel built from this tree,
a new virtual environment, and what a Dockerfile's ``pip install`` lines ask for (parsed from
the Dockerfile, never copied into a test)."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import venv
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from tests_support import ROOT


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
    """A new virtual environment at ``path`` that already has this machine's torch; the
    environment variables that put it first on ``PATH`` (and nothing of this tree's on
    ``PYTHONPATH``)."""
    venv.create(path, with_pip=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{path / 'bin'}{os.pathsep}{env['PATH']}"
    env["VIRTUAL_ENV"] = str(path)
    site = run(
        ["python", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], path, env, 60
    )
    _link_installed("torch", Path(site.strip()), path / "bin" / "python")
    return env


def _link_installed(name: str, site: Path, python: Path) -> None:
    """Put distribution ``name`` and what it requires (recursively, no extras) into ``site``
    as pip installed them into the suite's own environment: every file of each one's
    ``RECORD`` (byte code included), hard-linked, scripts' ``#!`` lines pointed at ``python``.

    This is the torch a user who already has torch has (the same pinned wheel, installed by
    pip) without installing and byte-compiling its 14,000 files again for every fresh
    environment (~27 s of CPU each on this machine)."""
    todo, seen = [name], set()
    while todo:
        dist = metadata.distribution(todo.pop())
        key = canonicalize_name(dist.metadata["Name"])
        if key in seen:
            continue
        seen.add(key)
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
        for rel in dist.files or []:
            src = Path(str(dist.locate_file(rel)))
            dst = Path(os.path.normpath(site / rel))
            if not src.is_file() or dst.exists():
                continue
            dst.parent.mkdir(parents=True, exist_ok=True)
            head = src.read_bytes()[:2] if dst.parent.name == "bin" else b""
            if head == b"#!":
                lines = src.read_text().splitlines(keepends=True)
                dst.write_text(f"#!{python}\n" + "".join(lines[1:]))
                dst.chmod(src.stat().st_mode)
            else:
                try:
                    os.link(src, dst)  # (pip finds torch there and writes none of its files)
                except OSError:  # another filesystem
                    shutil.copy2(src, dst)


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
