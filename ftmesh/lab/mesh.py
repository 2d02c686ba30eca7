"""One ``ftmesh node`` per lab host, and the question every lab check asks: is there one view?

Theory of operation: :class:`LabMesh` starts a real ``ftmesh node --events json`` process inside
each host namespace of a :class:`~ftmesh.lab.netns.VirtualLan` (mDNS discovery on the host's LAN
address, so nothing but the lab's multicast is used) and tracks which process is the current
member of each host. A host is *expected* in the view when its current process runs and is not
frozen. Each node's view is read from its own event stream (:func:`~ftmesh.lab.procs.view`), so
checking costs no packets and no processes; :meth:`LabMesh.status_views` asks the nodes
themselves (``ftmesh status --json`` from inside each host) for an end-of-run cross-check.

*One view* means: every expected node counts exactly the expected node ids as members, and none
of them as suspect. Dead processes from earlier faults (a killed member's id) must be gone.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from ..errors import DeadlineExceeded
from ..membership.config import MembershipConfig
from .errors import LabError
from .netns import VirtualLan
from .procs import NodeProcess, member_states

POLL_INTERVAL = 0.1
"""Seconds between view checks while waiting for the mesh to settle."""

STATUS_TIMEOUT = 3.0
"""Seconds ``ftmesh status`` may search for (and then talk to) a member."""

STATUS_WAIT = 30.0
"""Seconds :meth:`LabMesh.status_views` waits for all of its ``ftmesh status`` processes."""


def node_argv(
    lan: VirtualLan,
    host: int,
    *,
    mesh: str,
    preset: str,
    secret_file: Path | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """``ftmesh node`` on lab host ``host``: mDNS on the host's LAN address, JSON events."""
    argv = ["ip", "netns", "exec", lan.ns_name(host), sys.executable, "-m", "ftmesh", "node"]
    argv += ["--mesh", mesh, "--discovery", "mdns", "--interface", lan.host_ip(host)]
    argv += ["--preset", preset, "--events", "json", "--name", f"h{host}"]
    if secret_file is not None:
        argv += ["--secret-file", str(secret_file)]
    return [*argv, *extra]


@dataclass
class HostSlot:
    """The member running on one host, if any, and every process that ever ran there."""

    node: NodeProcess | None = None
    frozen: bool = False
    history: list[NodeProcess] = field(default_factory=list)


class LabMesh:
    """One mesh member per lab host (see the module docstring). Stops every process on exit."""

    def __init__(
        self,
        lan: VirtualLan,
        log_dir: Path,
        *,
        mesh: str = "lab",
        preset: str = "local",
        secret_file: Path | None = None,
        extra_args: Sequence[str] = (),
        argv_factory: Callable[[VirtualLan, int], list[str]] | None = None,
        start_timeout: float = 20.0,
    ) -> None:
        self.lan = lan
        self.argv_factory = argv_factory
        """Replaces :func:`node_argv` (a workload process that prints the same JSON events)."""
        self.start_timeout = start_timeout
        """Seconds a member may take to print its first event (a training worker imports
        torch first, several at once on a small machine)."""
        self.log_dir = log_dir
        self.mesh = mesh
        self.preset = preset
        self.config = MembershipConfig.preset(preset)
        self.secret_file = secret_file
        self.extra_args = list(extra_args)
        self.slots = [HostSlot() for _ in range(lan.hosts)]
        self.final_stats: dict[str, dict[str, int]] = {}
        """Counters printed by each node stopped gracefully, by node id."""

    # --- processes -------------------------------------------------------------------------

    def start(
        self, host: int, *, secret_file: Path | None = None, wait: bool = True
    ) -> NodeProcess:
        """Start a fresh member on ``host`` (a new node id); the host must have none running.
        ``wait=False``: return before its first event (:meth:`NodeProcess.wait_started`)."""
        slot = self.slots[host]
        if slot.node is not None and slot.node.proc.poll() is None:
            raise LabError(f"host {host} already runs member {slot.node.name}")
        n = len(slot.history)
        if self.argv_factory is not None:
            argv = self.argv_factory(self.lan, host)
        else:
            argv = node_argv(
                self.lan,
                host,
                mesh=self.mesh,
                preset=self.preset,
                secret_file=secret_file or self.secret_file,
                extra=self.extra_args,
            )
        node = NodeProcess(
            argv,
            stderr_path=self.log_dir / f"{self.mesh}-h{host}.{n}.stderr",
            start_timeout=self.start_timeout,
            wait_started=wait,
        )
        slot.node, slot.frozen = node, False
        slot.history.append(node)
        return node

    def start_all(self) -> list[NodeProcess]:
        """A member on every host, all started before any is waited for (they import and
        bind in parallel, as machines booting together would)."""
        nodes = [self.start(h, wait=False) for h in range(self.lan.hosts)]
        for node in nodes:
            node.wait_started()
        return nodes

    def node(self, host: int) -> NodeProcess:
        node = self.slots[host].node
        if node is None:
            raise LabError(f"host {host} runs no member")
        return node

    def kill(self, host: int) -> None:
        """kill -9 every process of ``host`` (the member stays gone until :meth:`start`)."""
        slot = self.slots[host]
        self.lan.kill_host(host, signal.SIGKILL)
        if slot.node is not None:
            slot.node.proc.wait(10.0)
        slot.node, slot.frozen = None, False

    def freeze(self, host: int) -> None:
        """SIGSTOP every process of ``host``: a hung machine whose sockets stay open."""
        self.lan.kill_host(host, signal.SIGSTOP)
        self.slots[host].frozen = True

    def thaw(self, host: int) -> None:
        self.lan.kill_host(host, signal.SIGCONT)
        self.slots[host].frozen = False

    def stop(self, host: int, timeout: float = 5.0) -> None:
        """Graceful leave (SIGTERM); keeps the node's final counters in :attr:`final_stats`."""
        slot = self.slots[host]
        node = slot.node
        if node is None:
            return
        if slot.frozen:
            self.thaw(host)
        node.stop(timeout)
        found = node.find(lambda r: r.get("event") == "stats")
        if found is not None:
            self.final_stats[node.node_id] = dict(found.record.get("counters", {}))
        slot.node = None

    def stop_all(self, timeout: float = 5.0) -> dict[str, dict[str, int]]:
        """:meth:`stop` every member, the SIGTERMs sent to all before waiting for any (they
        leave together, as when a whole job is deleted)."""
        asked = []
        for h, slot in enumerate(self.slots):
            if slot.node is not None and slot.node.proc.poll() is None:
                if slot.frozen:
                    self.thaw(h)
                slot.node.signal(signal.SIGTERM)
                asked.append(slot.node)
        deadline = time.monotonic() + timeout
        for node in asked:  # (a second SIGTERM could end a member that has left, not exited)
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.proc.wait(max(0.0, deadline - time.monotonic()))
        for h in range(len(self.slots)):
            self.stop(h, timeout)  # SIGKILL for any still running
        return self.final_stats

    def close(self) -> None:
        """Kill whatever still runs (idempotent; used on failure paths)."""
        for h, slot in enumerate(self.slots):
            if slot.frozen:
                self.thaw(h)
            for node in slot.history:
                if node.proc.poll() is None:
                    node.kill()
                node.stop(0.1)
            slot.node = None

    def __enter__(self) -> LabMesh:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # --- views -----------------------------------------------------------------------------

    def running(self) -> dict[int, NodeProcess]:
        """Members whose process runs (frozen ones included), by host."""
        return {
            h: s.node
            for h, s in enumerate(self.slots)
            if s.node is not None and s.node.proc.poll() is None
        }

    def expected(self) -> dict[int, NodeProcess]:
        """Members that should be in everyone's view: running and not frozen, by host."""
        return {h: n for h, n in self.running().items() if not self.slots[h].frozen}

    def expected_ids(self) -> frozenset[str]:
        return frozenset(n.node_id for n in self.expected().values())

    def disagreements(self) -> list[str]:
        """Why there is not one view yet (empty when there is)."""
        want = self.expected_ids()
        problems = []
        for h, node in self.expected().items():
            states = member_states(node)
            have = {m for m, k in states.items() if k in ("joined", "alive", "updated")}
            suspects = {m for m, k in states.items() if k == "suspect"}
            have.add(node.node_id)
            if have != want or suspects:
                missing = sorted(x[:8] for x in want - have)
                extra = sorted(x[:8] for x in have - want)
                sus = sorted(x[:8] for x in suspects)
                problems.append(f"h{h}: missing {missing} extra {extra} suspect {sus}")
        return problems

    def one_view(self) -> bool:
        return not self.disagreements()

    def wait_one_view(self, timeout: float) -> float:
        """Seconds until every expected member shares one view; ``DeadlineExceeded`` (with
        the disagreements) after ``timeout``."""
        start = time.monotonic()
        deadline = start + timeout
        while True:
            problems = self.disagreements()
            if not problems:
                return time.monotonic() - start
            if time.monotonic() >= deadline:
                raise DeadlineExceeded(
                    f"no single view after {timeout:.1f}s: " + "; ".join(problems)
                )
            time.sleep(POLL_INTERVAL)

    def status_views(self) -> dict[int, frozenset[str]]:
        """Each expected member's alive set as ``ftmesh status --json`` reports it, asked from
        inside its host straight at its gossip address (an end-of-run cross-check of the
        event-stream views; costs one Python process per host)."""
        procs: dict[int, subprocess.Popen[str]] = {}
        try:
            for h, node in self.expected().items():  # all at once, then each awaited
                argv = [sys.executable, "-m", "ftmesh", "status", "--json", "--mesh", self.mesh]
                argv += ["--discovery", "seeds", "--join", node.addr]
                argv += ["--timeout", str(STATUS_TIMEOUT)]
                if self.secret_file is not None:
                    argv += ["--secret-file", str(self.secret_file)]
                procs[h] = self.lan.popen(
                    h, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
                )
            out: dict[int, frozenset[str]] = {}
            deadline = time.monotonic() + STATUS_WAIT
            for h, proc in procs.items():
                try:
                    stdout, stderr = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired as e:
                    raise LabError(f"ftmesh status on host {h} took over {STATUS_WAIT}s") from e
                if proc.returncode != 0:
                    raise LabError(f"ftmesh status on host {h} failed: {stderr.strip()[-300:]}")
                members = json.loads(stdout)
                out[h] = frozenset(m["node"] for m in members if m["state"] == "alive")
            return out
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.communicate()
