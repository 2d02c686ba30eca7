"""Run ``ftmesh node`` processes and watch their JSON event streams (tests, benchmarks, lab).

Each :class:`NodeProcess` is a real OS process; a reader thread parses its stdout (one JSON
object per line, see ``ftmesh node --events json``) into a list guarded by a condition, so a
caller can wait for an event with a deadline. :class:`NodeGroup` starts several on one registry
directory (same-host discovery, no multicast) and kills every one of them on exit, even when
the test failed.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from ..errors import DeadlineExceeded

Record = dict[str, Any]


def terminate(pid: int, ours: Callable[[], bool], timeout: float = 5.0) -> None:
    """Stop a helper process the lab started (the WAN forwarder, a fail-slow pulser): SIGTERM,
    wait up to ``timeout`` for it to exit (reaped if it is our child), then SIGKILL. ``ours``
    says whether ``pid`` is still that process (a pid can be reused): nothing is signalled
    once it is not."""
    if not ours():
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return
        if not ours():
            return
        time.sleep(0.01)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


@dataclass(frozen=True, slots=True)
class SeenRecord:
    mono: float
    """``time.monotonic()`` in this process when the line was read."""
    record: Record


class NodeProcess:
    """One process whose stdout is a JSON event stream. The constructor starts it and waits
    (up to ``start_timeout`` seconds) for its ``self`` record, which gives :attr:`node_id`,
    :attr:`name` and :attr:`addr`; with ``wait_started=False`` it returns at once and
    :meth:`wait_started` does that wait later (several processes started together, then
    awaited, import in parallel instead of one after the other)."""

    node_id: str
    name: str
    addr: str

    def __init__(
        self,
        argv: Sequence[str],
        env: dict[str, str] | None = None,
        stderr_path: Path | None = None,
        start_timeout: float = 20.0,
        *,
        wait_started: bool = True,
    ) -> None:
        self.stderr_path = stderr_path
        self.start_timeout = start_timeout
        self._stderr = open(stderr_path, "wb") if stderr_path else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(
            list(argv),
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
        self._cond = threading.Condition()
        self.records: list[SeenRecord] = []
        self.bad_lines = 0
        self._states: dict[str, str] = {}
        """:func:`member_states` of the records before ``_states_upto`` (kept incrementally:
        a training member prints a record per step, and the lab asks for views often)."""
        self._states_upto = 0
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if wait_started:
            self.wait_started()

    def wait_started(self) -> None:
        """Wait for the process's ``self`` record (``start_timeout`` seconds from now); sets
        :attr:`node_id`, :attr:`name` and :attr:`addr`. ``DeadlineExceeded`` if none came."""
        first = self.wait_for(lambda r: r["event"] == "self", timeout=self.start_timeout)
        self.node_id = first["node"]
        self.name = first["name"]
        self.addr = first["addr"]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            try:
                rec = json.loads(raw)
            except ValueError:
                self.bad_lines += 1
                continue
            with self._cond:
                self.records.append(SeenRecord(time.monotonic(), rec))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def find(self, pred: Callable[[Record], bool]) -> SeenRecord | None:
        with self._cond:
            return next((s for s in self.records if pred(s.record)), None)

    def wait_for(self, pred: Callable[[Record], bool], timeout: float) -> Record:
        """The first record (already seen or future) matching ``pred``; raises
        ``DeadlineExceeded`` after ``timeout`` seconds or if the process exits first."""
        seen = self.wait_seen(pred, timeout)
        return seen.record

    def wait_seen(self, pred: Callable[[Record], bool], timeout: float) -> SeenRecord:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for s in self.records:
                    if pred(s.record):
                        return s
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self._reader.is_alive()):
                    raise DeadlineExceeded(
                        f"node pid {self.pid}: no matching event within {timeout:.1f}s "
                        f"(exit code {self.proc.poll()}, {len(self.records)} events)"
                    )
                self._cond.wait(min(left, 0.5))

    def events_about(self, node_id: str) -> list[str]:
        with self._cond:
            return [s.record["event"] for s in self.records if s.record.get("node") == node_id]

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def stop(self, timeout: float = 5.0) -> int:
        """SIGTERM (graceful leave), then SIGKILL if it does not exit in time."""
        if self.proc.poll() is None:
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        rc = self.proc.wait()
        self._release()
        return rc

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.proc.wait()
        self._release()

    def _release(self) -> None:
        """Close our ends of its output once it has exited (its reader has seen the end)."""
        self._reader.join(2.0)
        if self.proc.stdout is not None and not self._reader.is_alive():
            self.proc.stdout.close()
        if self._stderr is not subprocess.DEVNULL:
            self._stderr.close()  # type: ignore[union-attr]


MEMBER_KINDS = frozenset({"joined", "alive", "updated", "suspect"})
"""Event kinds after which a member is still in the view (a suspect is still a member)."""


def member_states(node: NodeProcess) -> dict[str, str]:
    """``node``'s view of the others as read from its event stream: node id -> the kind of
    the last event about it (``joined``, ``alive``, ``updated``, ``suspect``, ``dead``,
    ``left``). Events about ``node`` itself are left out."""
    with node._cond:
        records = node.records[node._states_upto :]
        states = node._states
        for s in records:
            r = s.record
            kind = r.get("event")
            other = r.get("node")
            if kind in ("self", "stats") or other == node.node_id or not isinstance(other, str):
                continue
            states[other] = str(kind)
        node._states_upto += len(records)
        return dict(states)


def view(node: NodeProcess) -> frozenset[str]:
    """Ids of the members ``node`` counts in its view (alive or suspect), itself included."""
    return frozenset(
        [node.node_id, *(m for m, k in member_states(node).items() if k in MEMBER_KINDS)]
    )


def joined(node_id: str) -> Callable[[Record], bool]:
    """Predicate: a ``joined`` event about ``node_id``."""
    return lambda r: r["event"] == "joined" and r["node"] == node_id


def declared_dead(node_id: str) -> Callable[[Record], bool]:
    """Predicate: a ``dead`` event about ``node_id``."""
    return lambda r: r["event"] == "dead" and r["node"] == node_id


class NodeGroup:
    """Several ``ftmesh node`` processes of one mesh on this host (local discovery)."""

    def __init__(
        self,
        *,
        mesh: str = "test",
        preset: str = "local",
        extra_args: Sequence[str] = (),
        log_dir: Path | None = None,
    ) -> None:
        self.mesh = mesh
        self.preset = preset
        self.extra_args = list(extra_args)
        self._tmp = tempfile.TemporaryDirectory(prefix="ftmesh-group-")
        self.registry = Path(self._tmp.name) / "registry"
        self.log_dir = log_dir or Path(self._tmp.name)
        self.nodes: list[NodeProcess] = []

    def argv(self, *extra: str) -> list[str]:
        return [
            sys.executable,
            "-m",
            "ftmesh",
            "node",
            "--mesh",
            self.mesh,
            "--preset",
            self.preset,
            "--events",
            "json",
            "--registry-dir",
            str(self.registry),
            *self.extra_args,
            *extra,
        ]

    def start(self, *extra: str, env: dict[str, str] | None = None) -> NodeProcess:
        idx = len(self.nodes)
        node = NodeProcess(
            self.argv(*extra), env=env, stderr_path=self.log_dir / f"node{idx}.stderr"
        )
        self.nodes.append(node)
        return node

    def running(self) -> list[NodeProcess]:
        return [n for n in self.nodes if n.proc.poll() is None]

    def wait_converged(self, nodes: Sequence[NodeProcess], timeout: float) -> None:
        """Every node in ``nodes`` has seen every other one join."""
        deadline = time.monotonic() + timeout
        for a in nodes:
            for b in nodes:
                if a is not b:
                    a.wait_for(joined(b.node_id), max(0.1, deadline - time.monotonic()))

    def close(self) -> None:
        for n in self.nodes:
            if n.proc.poll() is None:
                n.signal(signal.SIGKILL)
        for n in self.nodes:
            n.stop()
        self._tmp.cleanup()

    def __enter__(self) -> NodeGroup:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
