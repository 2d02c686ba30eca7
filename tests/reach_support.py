"""Helpers of the reachability and insider tests: ``ftmesh.lab.train_worker`` processes and
what they committed, when."""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from ftmesh.lab.procs import NodeProcess, Record


def worker_argv(name: str, *extra: str, registry: Path | None = None) -> list[str]:
    """A training worker on loopback (local discovery in ``registry``), or, without one, the
    tail of a lab host's command line (mDNS; the caller adds ``--interface``)."""
    argv = [sys.executable, "-m", "ftmesh.lab.train_worker", "--name", name, "--seed", "3"]
    argv += ["--step-delay", "0.05", "--mesh", "reach"]
    if registry is not None:
        argv += ["--discovery", "local", "--registry-dir", str(registry)]
    return [*argv, *extra]


def commits(p: NodeProcess, since: float = 0.0, until: float = float("inf")) -> list[Record]:
    """``p``'s commit records read in ``[since, until)`` (monotonic time of this process)."""
    with p._cond:
        seen = list(p.records)
    return [s.record for s in seen if s.record.get("event") == "commit" and since <= s.mono < until]


def rate(p: NodeProcess, since: float, until: float) -> float:
    """Steps ``p`` committed per second in ``[since, until)``."""
    return len(commits(p, since, until)) / (until - since)


def wait_commit(
    procs: Sequence[NodeProcess], pred: Callable[[Record], bool], timeout: float
) -> float:
    """Wait until every one of ``procs`` printed a commit matching ``pred``; the monotonic
    time of the last of those."""
    deadline = time.monotonic() + timeout
    last = 0.0
    for p in procs:
        seen = p.wait_seen(
            lambda r: r.get("event") == "commit" and pred(r),
            max(0.1, deadline - time.monotonic()),
        )
        last = max(last, seen.mono)
    return last


def on_view(members: set[str], after: int = 0) -> Callable[[Record], bool]:
    """Predicate: a commit of a step above ``after`` on a view of exactly ``members``."""
    return lambda r: set(r["members"]) == members and int(r["step"]) > after


def log_lines(path: Path, pattern: str) -> list[str]:
    return [
        line for line in path.read_text(errors="replace").splitlines() if re.search(pattern, line)
    ]


def stop_all(procs: Sequence[NodeProcess]) -> None:
    for p in procs:
        if p.proc.poll() is None:
            p.kill()
        p.stop(1.0)
