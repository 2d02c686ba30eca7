"""Where ``ftmesh lab up`` leaves a lab for later ``ftmesh lab ...`` invocations to find.

Theory of operation: a persistent lab is a :class:`~ftmesh.lab.netns.VirtualLan` built with a
fixed ``name`` and detached from its creator. Its :meth:`~ftmesh.lab.netns.VirtualLan.to_state`
plus the processes started by ``lab run --detach`` are kept as JSON in ``<dir>/<name>.json``,
where ``<dir>`` is ``$FTMESH_LAB_DIR``, else ``/run/ftmesh-lab`` (tmpfs: gone after a reboot,
like the namespaces themselves), else ``/tmp/ftmesh-lab``. Every read-modify-write holds an
exclusive ``flock`` on ``<dir>/<name>.lock`` so two commands cannot lose each other's changes.
The file is written atomically (temporary file, then rename).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .errors import LabError

DIR_ENV = "FTMESH_LAB_DIR"

MAX_STATE_BYTES = 1 << 20
"""A state file larger than this is damaged, not read."""


def state_dir() -> Path:
    """Directory holding lab state files (created on demand, mode 0700)."""
    env = os.environ.get(DIR_ENV)
    if env:
        d = Path(env)
    elif os.access("/run", os.W_OK):
        d = Path("/run/ftmesh-lab")
    else:
        d = Path(tempfile.gettempdir()) / "ftmesh-lab"
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    return d


def state_path(name: str) -> Path:
    return state_dir() / f"{name}.json"


@contextlib.contextmanager
def locked(name: str) -> Iterator[None]:
    """Hold the lab's lock (blocks until other ``ftmesh lab`` commands on it are done)."""
    with open(state_dir() / f"{name}.lock", "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def load(name: str) -> dict[str, Any] | None:
    """The saved state of lab ``name``, or None when there is none."""
    path = state_path(name)
    try:
        raw = path.read_bytes()[: MAX_STATE_BYTES + 1]
    except FileNotFoundError:
        return None
    except OSError as e:
        raise LabError(f"cannot read {path}: {e}") from e
    if len(raw) > MAX_STATE_BYTES:
        raise LabError(f"{path} is larger than {MAX_STATE_BYTES} bytes: damaged")
    try:
        state = json.loads(raw)
    except ValueError as e:
        raise LabError(f"{path} is damaged ({e}); run 'ftmesh lab down' to clean up") from e
    if not isinstance(state, dict):
        raise LabError(f"{path} is damaged; run 'ftmesh lab down' to clean up")
    return state


def save(name: str, state: dict[str, Any]) -> Path:
    """Write the state of lab ``name`` atomically; returns the file's path."""
    path = state_path(name)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(state, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def remove(name: str) -> bool:
    """Delete the state file of lab ``name``; whether there was one."""
    try:
        state_path(name).unlink()
    except FileNotFoundError:
        return False
    return True
