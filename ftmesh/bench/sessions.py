"""Timing a mesh member's collectives from outside: every session the member hands out runs
its collectives through a wrapper (the benchmarks' split of a step into communication and the
rest). Only the instances are wrapped; nothing else changes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..collective.session import ViewSession
from ..mesh.blocking import SyncMesh

Wrap = Callable[[str, Callable[..., Any]], Callable[..., Any]]
"""``wrap(kind, fn)``: ``fn`` (``session.run`` or ``session.submit``, called as
``fn(op, x)``) wrapped; ``kind`` is the method's name."""


def time_sessions(mesh: SyncMesh, wrap: Wrap) -> None:
    """From now on, ``mesh.session(view)`` returns sessions whose ``run`` and ``submit`` go
    through ``wrap``."""
    orig = mesh.session

    def session(view: Any = None) -> ViewSession:
        s = orig(view)
        for name in ("run", "submit"):
            setattr(s, name, wrap(name, getattr(s, name)))
        return s

    setattr(mesh, "session", session)  # noqa: B010
