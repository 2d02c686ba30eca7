"""Chaos soak: random faults on a real mesh in a virtual LAN, invariants checked throughout.

Theory of operation: :class:`ChaosRunner` builds a :class:`~ftmesh.lab.netns.VirtualLan` of N
hosts, starts one member per host (:class:`~ftmesh.lab.mesh.LabMesh`), waits for one view, then
until ``duration`` has passed injects one fault at a time, drawn from a seeded RNG:

===============  ==============================================================================
``kill``         kill -9 a host's processes; wait for the survivors to drop it (detection); start
                 a fresh member there (a new node id, as after a reboot)
``freeze``       SIGSTOP a host for 0.3-4 s (often past the detection bound), then SIGCONT: a hung
                 machine that comes back and must refute its death
``link_flap``    take a host's cable out 1-4 times, 0.2-2.5 s each
``partition``    split the LAN into two random groups for 1-6 s, then heal
``loss``         10-30 % loss on one host's link, or 10-20 % across the LAN, for 2-6 s
``rate``         limit one host's link to 256 kbit/s or 1 Mbit/s for 2-5 s
``junk``         one host floods the others' gossip ports with junk datagrams for 2-5 s
``one_way``      drop the IPv4 packets from one host to another for 3-10 s (a one-way link: gossip
                 reaches both through a third host, no TCP connection opens between them)
``unreachable``  block the TCP port of one member's data plane for 4-10 s (a firewall in front of
                 the port; gossip passes): its ring neighbours must leave it out and take it back
``clock_step``   step one member's wall clock ``insider.CLOCK_STEP`` (90 s) ahead for 4-10 s, then
                 back (the mesh has a secret in runs with this kind, so the replay check matters)
``conn_flood``   one host holds ``FLOOD_CONNECTIONS`` idle TCP connections to another member's
                 gossip and data-plane ports for 3-8 s (no secret, no handshake)
``bad_meta``     a rogue member (``ftmesh node``, with the secret if the mesh has one) joins from
                 one host with garbage metadata for 3-8 s, then leaves
===============  ==============================================================================

``unreachable`` and ``clock_step`` need a workload whose members have a data plane and the
fault hook (``TrainingWorkload``); they are left out of the default kinds without one.

Every decision (kind, hosts, durations) is drawn before the fault starts, from ``seed`` only, so
a seed names a fault schedule; the timings that result are real and vary from run to run.

After each fault is repaired the runner waits for *one view* (every running, unfrozen member
counts exactly the running, unfrozen members, none suspect) and records the recovery time.
Violations (the run fails with any):

* ``recovery``: no single view within :func:`recovery_bound` seconds of the repair, or a killed
  member not dropped by everyone within :func:`detection_bound`;
* ``false_death``: a running member declared dead while no fault was active (a fault's window
  runs from its start to one second after it settled; a member the runner killed is really
  dead whenever it is declared so). Deaths of members the active fault did not
  touch are counted as ``collateral_deaths`` instead: events do not name the accuser, and a
  member cut off by the fault legitimately accuses everyone it cannot reach, which spreads once
  it reconnects;
* ``resurrect``: a killed member seen joined or alive again after being declared dead (it
  cannot refute: a stale rumour beat its death);
* ``leak``: a process in a host namespace that is neither that host's member nor a fault
  helper, a member socket count above its first-settle baseline plus ``SOCKET_SLACK``, a member
  that does not exit cleanly on SIGTERM at the end, processes left in a namespace after the
  stop, or a namespace left after teardown;
* ``crash``: a member process that exited without being killed by the runner;
* ``status``: ``ftmesh status`` (asked inside every host at the end) disagrees with the view
  read from the event streams;
* anything a plugged-in :class:`Invariant` reports;
* with a :class:`Workload`: the kind it names (``progress``, ``converge`` for training) when it
  has not recovered within its bound of a single view.

The summary also carries a ``timeline`` (:mod:`ftmesh.lab.timeline`: commits per member
process and view changes, bounded), which ``--plot`` draws with the fault records.

Plugging in a workload: a :class:`Workload` (``workload=``) runs its own per-host process
instead of ``ftmesh node`` (it must print the same JSON membership events on stdout, plus
whatever it needs, e.g. ``{"event": "commit", "step": s, "digest": ...}``), brings
:class:`Invariant` objects that read those records from ``ctx.mesh`` at ``tick``, ``settled``
and ``final``, and says when it has recovered: after every single view (at startup and after
each fault) the runner waits until :meth:`Workload.recovered` holds, up to the workload's
bound, before the ``settled`` checks and the next fault, and records that time as the fault's
``resume_s``. :class:`ftmesh.lab.training.TrainingWorkload` is the fault-tolerant training
one (``ftmesh lab chaos --workload train``). The lower-level ``argv_factory`` and
``invariants`` arguments do the first two parts alone.
"""

from __future__ import annotations

import functools
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from ..discovery.mdns import DEFAULT_REFRESH_INTERVAL
from ..errors import DeadlineExceeded
from ..membership.config import MembershipConfig
from ..net.node import JOIN_RETRY_BOUND
from .errors import LabError
from .mesh import LabMesh, node_argv
from .netns import VirtualLan, _list_netns
from .procs import NodeProcess
from .timeline import chaos_timeline

Phase = Literal["tick", "settled", "final"]

KINDS = (
    "kill",
    "freeze",
    "link_flap",
    "partition",
    "loss",
    "rate",
    "junk",
    "one_way",
    "unreachable",
    "clock_step",
    "conn_flood",
    "bad_meta",
)
"""Fault kinds, in the order their weights are listed in ``WEIGHTS``."""

WEIGHTS = (2, 2, 2, 2, 2, 1, 1, 2, 2, 1, 1, 1)
"""Relative frequency of each kind."""

WORKLOAD_KINDS = ("unreachable", "clock_step")
"""Kinds that need members with a data plane and the fault hook (a training workload)."""

FLOOD_CONNECTIONS = 600
"""Idle connections per port in a ``conn_flood`` (the number that stalled a mesh in issue 17)."""

BAD_META = (
    ("data=garbage", "role=train"),
    ("data=10.255.255.1:notaport", "role=train"),
    ("role=train", "state=garbage", "state_bytes=-7"),
    ("role=train", "state_bytes=3000000000000"),
    ("role=train", "reach=garbage"),
    ("role=spaceship", "data=:"),
)
"""Metadata a ``bad_meta`` rogue joins with (``ftmesh node --meta``), one drawn per fault."""

TICK = 0.25
"""Seconds between cheap continuous checks while a fault holds or settles."""

CPU_SLACK = 5.0
"""Seconds added to every bound for a shared, noisy machine: a CI runner with 2 cores also
runs N Python members, their event readers and this runner."""

SOCKET_SLACK = 16
"""Sockets a member may hold above its count at the first settle (transient TCP syncs)."""

WORKER_START = 90.0
"""Seconds a workload's member may take to print its first event (it imports torch first)."""

MESH = "chaos"
"""Mesh name of the members of a chaos run."""

MAX_FAULTS = 10_000
"""Upper bound on faults in one run, whatever the duration."""

JUNK_PPS = 2000
"""Total junk datagrams per second during a ``junk`` fault."""


def detection_bound(cfg: MembershipConfig, n: int) -> float:
    """Seconds within which every survivor must drop a killed member: the protocol's crash
    detection bound (:meth:`MembershipConfig.crash_detection_bound`) plus ``CPU_SLACK``."""
    return cfg.crash_detection_bound(n) + CPU_SLACK


def recovery_bound(cfg: MembershipConfig, n: int) -> float:
    """Seconds from a repair to one view. The slowest path: detect a death the fault caused
    (crash detection bound), then find the member again through discovery (one mDNS refresh
    interval, the longest join retry wait) and sync with it over TCP (``tcp_timeout``), plus
    ``CPU_SLACK``. Refutation through gossip-to-the-dead is usually much faster."""
    return (
        cfg.crash_detection_bound(n)
        + DEFAULT_REFRESH_INTERVAL
        + JOIN_RETRY_BOUND
        + cfg.tcp_timeout
        + CPU_SLACK
    )


@dataclass(frozen=True, slots=True)
class FaultPlan:
    """One fault, fully decided before it starts."""

    kind: str
    hosts: tuple[int, ...]
    """Hosts the fault acts on (for ``partition``: the first group)."""
    hold: float
    """Seconds the fault lasts (for ``link_flap``: each outage; ``kill``: down time)."""
    groups: tuple[tuple[int, ...], ...] = ()
    percent: float = 0.0
    rate: str = ""
    flaps: int = 0
    lan_wide: bool = False
    meta: tuple[str, ...] = ()
    """``bad_meta``: the rogue's ``--meta`` items."""


@dataclass(slots=True)
class FaultRecord:
    index: int
    kind: str
    hosts: list[int]
    started_s: float
    """Seconds since the mesh first settled."""
    hold_s: float
    recovery_s: float | None = None
    """Seconds from the repair to one view (None: never within the bound)."""
    detection_s: float | None = None
    """``kill`` only: seconds from the kill until every survivor dropped the member."""
    resume_s: float | None = None
    """With a workload: seconds from the single view until it recovered (None: never within
    its bound)."""
    settled_at: float = 0.0
    touched: list[int] = field(default_factory=list)


@dataclass
class ChaosSummary:
    seed: int
    hosts: int
    preset: str
    duration_s: float
    wall_s: float = 0.0
    faults: dict[str, int] = field(default_factory=dict)
    faults_total: int = 0
    recoveries: int = 0
    worst_recovery_s: float = 0.0
    worst_recovery_kind: str = ""
    mean_recovery_s: float = 0.0
    worst_detection_s: float = 0.0
    recovery_bound_s: float = 0.0
    detection_bound_s: float = 0.0
    suspicions: int = 0
    deaths: int = 0
    false_deaths: int = 0
    collateral_deaths: int = 0
    """Deaths of untouched members seen by untouched members while a fault was active: a
    member cut off by the fault accused them, and its accusation spread once it reconnected."""
    junk_dropped: int = 0
    resurrections: int = 0
    """Killed members seen joined or alive again after a member had declared them dead (no
    killed process can refute its death: a stale rumour won)."""
    workload: str = "membership"
    worst_resume_s: float = 0.0
    """With a workload: the longest time from a single view to the workload's recovery."""
    worst_resume_kind: str = ""
    mean_resume_s: float = 0.0
    resume_bound_s: float = 0.0
    startup_resume_s: float = 0.0
    workload_stats: dict[str, Any] = field(default_factory=dict)
    """What the workload reports of itself (``Workload.summary``)."""
    violations: list[str] = field(default_factory=list)
    violations_by_kind: dict[str, int] = field(default_factory=dict)
    records: list[FaultRecord] = field(default_factory=list)
    timeline: dict[str, Any] = field(default_factory=dict)
    """Commits per member process and view changes over time (``ftmesh.lab.timeline``)."""

    @property
    def ok(self) -> bool:
        return not self.violations

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["violations_total"] = len(self.violations)
        return out

    def text(self) -> str:
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(self.faults.items()))
        lines = [
            f"chaos: {self.hosts} hosts, preset {self.preset}, seed {self.seed}, "
            f"{self.duration_s:.0f} s of faults ({self.wall_s:.0f} s wall)",
            f"faults injected: {self.faults_total} ({kinds})",
            f"recoveries: {self.recoveries}/{self.faults_total}, worst "
            f"{self.worst_recovery_s:.2f} s ({self.worst_recovery_kind}), mean "
            f"{self.mean_recovery_s:.2f} s, bound {self.recovery_bound_s:.1f} s",
            f"worst kill detection: {self.worst_detection_s:.2f} s "
            f"(bound {self.detection_bound_s:.1f} s)",
            f"suspicions {self.suspicions}, deaths {self.deaths} (collateral "
            f"{self.collateral_deaths}, false {self.false_deaths}), killed members "
            f"resurrected {self.resurrections}, junk datagrams dropped {self.junk_dropped}",
        ]
        if self.workload != "membership":
            lines.append(
                f"workload {self.workload}: resumed after worst {self.worst_resume_s:.2f} s "
                f"({self.worst_resume_kind}), mean {self.mean_resume_s:.2f} s, bound "
                f"{self.resume_bound_s:.1f} s; startup {self.startup_resume_s:.1f} s"
            )
            stats = self.workload_stats
            lines += [f"  {k}: {stats[k]}" for k in stats]
        by_kind = ", ".join(f"{k} {v}" for k, v in sorted(self.violations_by_kind.items()))
        lines += [
            f"violations: {len(self.violations)}" + (f" ({by_kind})" if by_kind else ""),
            *(f"  - {v}" for v in self.violations),
        ]
        return "\n".join(lines)


@dataclass
class ChaosContext:
    """What invariants see: the lab, the mesh, the fault in progress and the helpers running."""

    lan: VirtualLan
    mesh: LabMesh
    current: FaultPlan | None = None
    helper_pids: set[int] = field(default_factory=set)
    killed_pids: set[int] = field(default_factory=set)
    killed_at: dict[str, float] = field(default_factory=dict)
    """Node id -> monotonic time the runner killed its process (``kill`` faults)."""
    socket_baseline: dict[int, int] = field(default_factory=dict)
    """Socket count of each member process (by pid) at its first settle."""


class Invariant(Protocol):
    """A property checked during a chaos run; returns violation messages (empty: holds).

    ``phase``: ``tick`` (every ``TICK`` seconds; keep it cheap), ``settled`` (one view was just
    reached after a fault) or ``final`` (after the last fault settled, members still running).
    """

    name: str

    def check(self, ctx: ChaosContext, phase: Phase) -> Sequence[str]: ...


class Workload(Protocol):
    """What runs on every host of a chaos run instead of ``ftmesh node``, and what must hold
    of it (see the module docstring)."""

    name: str
    recovery_bound: float
    """Seconds from a single view after a fault until :meth:`recovered` must hold."""
    startup_bound: float
    """The same from the first single view of the run."""

    def argv(
        self, lan: VirtualLan, host: int, *, mesh: str, preset: str, extra: Sequence[str] = ()
    ) -> list[str]:
        """The member process of ``host``: it must print ``ftmesh node``'s JSON events.
        ``extra``: arguments the runner needs its members to have (``--secret-file``,
        ``--fault clock-step``)."""
        ...

    def invariants(self) -> Sequence[Invariant]: ...

    def mark(self, ctx: ChaosContext) -> None:
        """A single view was just reached; :meth:`recovered` judges from now on."""
        ...

    def recovered(self, ctx: ChaosContext) -> tuple[str, str] | None:
        """None once the workload has recovered since :meth:`mark`; else the violation kind
        and why not (reported if the bound passes)."""
        ...

    def summary(self) -> dict[str, Any]: ...


class NoCrashes:
    """Every member process the runner did not kill is still running."""

    name = "crash"

    def check(self, ctx: ChaosContext, phase: Phase) -> Sequence[str]:
        out = []
        for h, slot in enumerate(ctx.mesh.slots):
            node = slot.node
            dead = node is not None and node.proc.poll() is not None
            if node is not None and dead and node.pid not in ctx.killed_pids:
                out.append(
                    f"member {node.name} on h{h} exited with {node.proc.returncode}"
                    + _last_words(node.stderr_path)
                )
                ctx.killed_pids.add(node.pid)  # report once
        return out


def _last_words(path: Path | None) -> str:
    """The last line of a member's stderr log (why it exited), or nothing."""
    if path is None:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 2000))
            lines = f.read().decode(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return f": {lines[-1][-300:]}" if lines else ""


def _socket_count(pid: int) -> int | None:
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None
    n = 0
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:"):
                n += 1
        except OSError:
            continue
    return n


class NoLeaks:
    """Each host runs only its member and the fault helpers; sockets stay bounded."""

    name = "leak"

    def check(self, ctx: ChaosContext, phase: Phase) -> Sequence[str]:
        if phase == "tick":
            return []
        out = []
        running = ctx.mesh.running()
        for h in range(ctx.lan.hosts):
            allowed = set(ctx.helper_pids)
            if h in running:
                allowed.add(running[h].pid)
            stray = [p for p in ctx.lan.host_pids(h) if p not in allowed]
            if stray:
                out.append(f"h{h}: stray processes {stray}")
        for h, node in running.items():
            count = _socket_count(node.pid)
            if count is None:
                continue
            base = ctx.socket_baseline.setdefault(node.pid, count)
            if count > base + SOCKET_SLACK:
                out.append(f"h{h}: member holds {count} sockets (baseline {base})")
        return out


class ChaosRunner:
    """See the module docstring. ``invariants`` are checked in addition to the built-in ones
    (and the workload's); ``argv_factory(lan, host)`` replaces the per-host member command
    line (``workload`` does both and more)."""

    def __init__(
        self,
        *,
        hosts: int = 5,
        duration: float = 180.0,
        seed: int = 1,
        preset: str = "local",
        kinds: Sequence[str] | None = None,
        log_dir: Path | None = None,
        invariants: Sequence[Invariant] = (),
        argv_factory: Callable[[VirtualLan, int], list[str]] | None = None,
        workload: Workload | None = None,
        progress: Callable[[str], None] | None = None,
    ) -> None:
        if not 2 <= hosts <= 64:
            raise LabError(f"chaos needs 2..64 hosts, got {hosts}")
        if not 0 < duration <= 24 * 3600:
            raise LabError(f"duration {duration} s must be within (0, 86400]")
        if kinds is None:
            kinds = [k for k in KINDS if workload is not None or k not in WORKLOAD_KINDS]
        unknown = set(kinds) - set(KINDS)
        if unknown or not kinds:
            raise LabError(f"unknown fault kinds {sorted(unknown)}; choose from {KINDS}")
        needs = sorted(set(kinds) & set(WORKLOAD_KINDS))
        if needs and workload is None:
            raise LabError(f"fault kinds {needs} need a workload with a data plane (train)")
        self.hosts = hosts
        self.duration = duration
        self.seed = seed
        self.preset = preset
        self.kinds = tuple(k for k in KINDS if k in kinds)
        self.weights = tuple(w for k, w in zip(KINDS, WEIGHTS, strict=True) if k in kinds)
        self.cfg = MembershipConfig.preset(preset)
        self.log_dir = log_dir
        self.invariants: list[Invariant] = [NoCrashes(), NoLeaks(), *invariants]
        self.workload = workload
        self._secret_dir: tempfile.TemporaryDirectory[str] | None = None
        self.secret_file: Path | None = None
        """The mesh secret of runs with clock steps (written at ``run``)."""
        self._member_extra: list[str] = []
        if "clock_step" in self.kinds:
            self._member_extra = ["--fault", "clock-step"]
        if workload is not None:
            self.invariants += workload.invariants()
            argv_factory = functools.partial(
                _workload_argv, workload, preset, extra=self._member_extra
            )
        self.argv_factory = argv_factory
        self.progress = progress or (lambda _msg: None)
        self.rng = random.Random(seed)
        self.summary = ChaosSummary(seed=seed, hosts=hosts, preset=preset, duration_s=duration)
        self.summary.recovery_bound_s = recovery_bound(self.cfg, hosts)
        self.summary.detection_bound_s = detection_bound(self.cfg, hosts)
        if workload is not None:
            self.summary.workload = workload.name
            self.summary.resume_bound_s = workload.recovery_bound
        self._t0 = 0.0

    # --- planning (all randomness is here) ----------------------------------------------------

    def plan(self) -> FaultPlan:
        rng, n = self.rng, self.hosts
        kind = rng.choices(self.kinds, weights=self.weights)[0]
        host = rng.randrange(n)
        if kind == "kill":
            return FaultPlan(kind, (host,), hold=round(rng.uniform(0.0, 1.0), 2))
        if kind == "freeze":
            return FaultPlan(kind, (host,), hold=round(rng.uniform(0.3, 4.0), 2))
        if kind == "link_flap":
            flaps = rng.randint(1, 4)
            return FaultPlan(kind, (host,), hold=round(rng.uniform(0.2, 2.5), 2), flaps=flaps)
        if kind == "partition":
            hosts = list(range(n))
            rng.shuffle(hosts)
            cut = rng.randint(1, n // 2)
            a, b = tuple(sorted(hosts[:cut])), tuple(sorted(hosts[cut:]))
            return FaultPlan(kind, a, hold=round(rng.uniform(1.0, 6.0), 2), groups=(a, b))
        if kind == "loss":
            if rng.random() < 0.3:
                pct = rng.choice((10.0, 15.0, 20.0))
                hold = round(rng.uniform(2.0, 6.0), 2)
                return FaultPlan(kind, tuple(range(n)), hold=hold, percent=pct, lan_wide=True)
            pct = rng.choice((10.0, 20.0, 30.0))
            return FaultPlan(kind, (host,), hold=round(rng.uniform(2.0, 6.0), 2), percent=pct)
        if kind == "rate":
            rate = rng.choice(("256kbit", "1mbit"))
            return FaultPlan(kind, (host,), hold=round(rng.uniform(2.0, 5.0), 2), rate=rate)
        if kind == "junk":
            return FaultPlan("junk", (host,), hold=round(rng.uniform(2.0, 5.0), 2))
        if kind in ("one_way", "conn_flood"):
            other = rng.choice([h for h in range(n) if h != host])
            lo, hi = (3.0, 10.0) if kind == "one_way" else (3.0, 8.0)
            return FaultPlan(kind, (host, other), hold=round(rng.uniform(lo, hi), 2))
        if kind == "bad_meta":
            meta = rng.choice(BAD_META)
            return FaultPlan(kind, (host,), hold=round(rng.uniform(3.0, 8.0), 2), meta=meta)
        return FaultPlan(kind, (host,), hold=round(rng.uniform(4.0, 10.0), 2))

    # --- running ------------------------------------------------------------------------------

    def _now(self) -> float:
        return time.monotonic() - self._t0

    def _violate(self, kind: str, msg: str) -> None:
        text = f"[{self._now():7.1f}s] {kind}: {msg}"
        self.summary.violations.append(text)
        by_kind = self.summary.violations_by_kind
        by_kind[kind] = by_kind.get(kind, 0) + 1
        self.progress("VIOLATION " + text)

    def _check(self, ctx: ChaosContext, phase: Phase) -> None:
        for inv in self.invariants:
            try:
                found = inv.check(ctx, phase)
            except Exception as exc:  # a broken plug-in is a failed check, not a dead runner
                found = [f"check raised {exc!r}"]
            for msg in found:
                self._violate(inv.name, msg)

    def _hold(self, ctx: ChaosContext, seconds: float) -> None:
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            time.sleep(min(TICK, left))
            self._check(ctx, "tick")

    def _settle(self, ctx: ChaosContext, bound: float, since: float | None = None) -> float | None:
        """Seconds from ``since`` (default: now) until one view, checking ticks meanwhile;
        None if there is none ``bound`` seconds after ``since``."""
        start = time.monotonic() if since is None else since
        end = start + bound
        while True:
            if ctx.mesh.one_view():
                return time.monotonic() - start
            if time.monotonic() >= end:
                return None
            time.sleep(TICK / 2)
            self._check(ctx, "tick")

    def _resume(self, ctx: ChaosContext, bound: float, what: str) -> float | None:
        """With a workload: seconds from now (a single view was just reached) until it has
        recovered, checking ticks meanwhile; a violation and None after ``bound`` seconds."""
        wl = self.workload
        if wl is None:
            return 0.0
        wl.mark(ctx)
        start = time.monotonic()
        while True:
            why = wl.recovered(ctx)
            if why is None:
                return time.monotonic() - start
            if time.monotonic() - start >= bound:
                self._violate(why[0], f"{what}: not recovered within {bound:.1f}s: {why[1]}")
                return None
            time.sleep(TICK / 2)
            self._check(ctx, "tick")

    def _inject(self, ctx: ChaosContext, plan: FaultPlan, rec: FaultRecord) -> float:
        """Run the fault to its repair; returns the monotonic time of the repair."""
        lan, mesh = ctx.lan, ctx.mesh
        h = plan.hosts[0]
        if plan.kind == "kill":
            victim = mesh.node(h)
            ctx.killed_pids.add(victim.pid)
            ctx.killed_at[victim.node_id] = time.monotonic()
            mesh.kill(h)
            found = self._settle(ctx, self.summary.detection_bound_s)
            if found is None:
                self._violate(
                    "recovery",
                    f"fault {rec.index}: killed h{h} not dropped within "
                    f"{self.summary.detection_bound_s:.1f}s: {'; '.join(mesh.disagreements())}",
                )
            rec.detection_s = found
            self._hold(ctx, plan.hold)
            try:
                mesh.start(h)
            except DeadlineExceeded as exc:
                self._violate("recovery", f"fault {rec.index}: h{h} did not restart: {exc}")
        elif plan.kind == "freeze":
            mesh.freeze(h)
            self._hold(ctx, plan.hold)
            mesh.thaw(h)
        elif plan.kind == "link_flap":
            for k in range(plan.flaps):
                lan.link(h, False)
                self._hold(ctx, plan.hold)
                lan.link(h, True)
                if k + 1 < plan.flaps:
                    self._hold(ctx, 0.2 + 0.8 * self.rng.random())
        elif plan.kind == "partition":
            lan.partition([list(g) for g in plan.groups])
            self._hold(ctx, plan.hold)
            lan.heal()
        elif plan.kind == "loss":
            if plan.lan_wide:
                lan.set_lan_loss(plan.percent)
                self._hold(ctx, plan.hold)
                lan.set_lan_loss(0)
            else:
                lan.set_loss(h, plan.percent)
                self._hold(ctx, plan.hold)
                lan.set_loss(h, 0)
        elif plan.kind == "rate":
            lan.set_rate(h, plan.rate)
            self._hold(ctx, plan.hold)
            lan.set_rate(h, None)
        elif plan.kind == "junk":
            self._junk(ctx, plan)
        elif plan.kind == "one_way":
            lan.one_way(h, plan.hosts[1])
            self._hold(ctx, plan.hold)
            lan.one_way(h, plan.hosts[1], broken=False)
        elif plan.kind == "unreachable":
            port = _data_port(mesh.node(h))
            if port:
                lan.block_port(h, port)
            self._hold(ctx, plan.hold)
            if port:
                lan.block_port(h, port, blocked=False)
        elif plan.kind == "clock_step":
            node = mesh.node(h)
            node.signal(signal.SIGUSR1)
            self._hold(ctx, plan.hold)
            if node is mesh.slots[h].node:
                node.signal(signal.SIGUSR2)
        elif plan.kind == "conn_flood":
            self._conn_flood(ctx, plan)
        else:
            self._rogue(ctx, plan)
        return time.monotonic()

    def _helper(self, ctx: ChaosContext, host: int, argv: list[str], hold: float) -> None:
        """Run a fault helper in ``host`` for ``hold`` seconds (checks ticking), then stop it:
        SIGTERM (a rogue member leaves), SIGKILL after 5 s."""
        proc = ctx.lan.popen(host, argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        ctx.helper_pids.add(proc.pid)
        try:
            self._hold(ctx, hold)
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(5.0)
                except subprocess.TimeoutExpired:
                    proc.kill()
            proc.wait(5.0)
            ctx.helper_pids.discard(proc.pid)

    def _conn_flood(self, ctx: ChaosContext, plan: FaultPlan) -> None:
        target = ctx.mesh.slots[plan.hosts[1]].node
        if target is None:
            self._hold(ctx, plan.hold)
            return
        ip = target.addr.rpartition(":")[0]
        addrs = [target.addr]
        port = _data_port(target)
        if port:
            addrs.append(f"{ip}:{port}")
        argv = [sys.executable, "-m", "ftmesh.lab.junk", "--duration", str(plan.hold + 5.0)]
        argv += ["--connections", str(FLOOD_CONNECTIONS)]
        for a in addrs:
            argv += ["--connect", a]
        self._helper(ctx, plan.hosts[0], argv, plan.hold)

    def _rogue(self, ctx: ChaosContext, plan: FaultPlan) -> None:
        h = plan.hosts[0]
        extra = [f"--meta={m}" for m in plan.meta]
        argv = node_argv(
            ctx.lan, h, mesh=MESH, preset=self.preset, secret_file=self.secret_file, extra=extra
        )[4:]  # (popen adds "ip netns exec <ns>")
        argv[argv.index("--name") + 1] = f"rogue-h{h}"
        self._helper(ctx, h, argv, plan.hold)

    def _junk(self, ctx: ChaosContext, plan: FaultPlan) -> None:
        h = plan.hosts[0]
        others = [n for k, n in ctx.mesh.expected().items() if k != h]
        if not others:
            return
        argv = [sys.executable, "-m", "ftmesh.lab.junk", "--mesh", ctx.mesh.mesh]
        argv += ["--pps", str(JUNK_PPS), "--duration", str(plan.hold)]
        argv += ["--seed", str(self.rng.randrange(1 << 30))]
        for n in others:
            argv += ["--target", n.addr, "--victim", n.node_id]
        proc = ctx.lan.popen(h, argv, stdout=open(os.devnull, "wb"), stderr=open(os.devnull, "wb"))  # noqa: SIM115
        ctx.helper_pids.add(proc.pid)
        try:
            self._hold(ctx, plan.hold)
            deadline = time.monotonic() + 15.0
            while proc.poll() is None and time.monotonic() < deadline:
                self._hold(ctx, TICK)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait(5.0)
            ctx.helper_pids.discard(proc.pid)

    def run(self) -> ChaosSummary:
        """Build the lab, run the soak, tear everything down; returns the summary."""
        wall0 = time.monotonic()
        tmp = None
        log_dir = self.log_dir
        if log_dir is None:
            tmp = tempfile.TemporaryDirectory(prefix="ftmesh-chaos-")
            log_dir = Path(tmp.name)
        log_dir.mkdir(parents=True, exist_ok=True)
        prefix = ""
        if self._member_extra:
            # Clock steps only matter to a mesh whose replay check reads the clock.
            self._secret_dir = tempfile.TemporaryDirectory(prefix="ftmesh-chaos-secret-")
            self.secret_file = Path(self._secret_dir.name) / "secret"
            self.secret_file.write_text(os.urandom(24).hex() + "\n")
            self._member_extra += ["--secret-file", str(self.secret_file)]
        try:
            with VirtualLan(hosts=self.hosts, prefix="ftmchaos") as lan:
                prefix = lan.prefix
                self._run_in(lan, log_dir)
            leftovers = [ns for ns in _list_netns() if ns.startswith(prefix)]
            if leftovers:
                self._violate("leak", f"namespaces left after teardown: {leftovers}")
        finally:
            if tmp is not None:
                tmp.cleanup()
            if self._secret_dir is not None:
                self._secret_dir.cleanup()
        self.summary.wall_s = round(time.monotonic() - wall0, 1)
        return self.summary

    def _run_in(self, lan: VirtualLan, log_dir: Path) -> None:
        s = self.summary
        with LabMesh(
            lan,
            log_dir,
            mesh=MESH,
            preset=self.preset,
            secret_file=self.secret_file,
            argv_factory=self.argv_factory,
            start_timeout=WORKER_START if self.workload is not None else 20.0,
        ) as mesh:
            ctx = ChaosContext(lan=lan, mesh=mesh)
            try:
                mesh.start_all()
                mesh.wait_one_view(60.0)
            except DeadlineExceeded as exc:
                self._violate("recovery", f"the mesh never formed: {exc}")
                return
            self._t0 = time.monotonic()
            if self.workload is not None:
                took = self._resume(ctx, self.workload.startup_bound, "startup")
                if took is None:
                    self._violate("recovery", "the workload never started; run aborted")
                    return
                s.startup_resume_s = round(took, 3)
                self._t0 = time.monotonic()
            self._check(ctx, "settled")
            records: list[FaultRecord] = []
            while self._now() < self.duration and len(records) < MAX_FAULTS:
                plan = self.plan()
                rec = FaultRecord(
                    index=len(records),
                    kind=plan.kind,
                    hosts=list(plan.hosts),
                    started_s=round(self._now(), 2),
                    hold_s=plan.hold,
                    touched=sorted({h for g in plan.groups for h in g} | set(plan.hosts)),
                )
                records.append(rec)
                s.faults[plan.kind] = s.faults.get(plan.kind, 0) + 1
                ctx.current = plan
                self.progress(f"[{self._now():7.1f}s] fault {rec.index}: {plan}")
                repaired = self._inject(ctx, plan, rec)
                took = self._settle(ctx, s.recovery_bound_s, since=repaired)
                if took is not None:
                    rec.recovery_s = round(took, 3)
                else:
                    self._violate(
                        "recovery",
                        f"fault {rec.index} ({plan.kind}): no single view within "
                        f"{s.recovery_bound_s:.1f}s of the repair: "
                        + "; ".join(mesh.disagreements()),
                    )
                    # Give it one more bound to come back before giving up the run.
                    if self._settle(ctx, s.recovery_bound_s) is None:
                        self._violate("recovery", "mesh did not recover; run aborted")
                        break
                rec.settled_at = self._now()
                if self.workload is not None:
                    what = f"fault {rec.index} ({plan.kind})"
                    resumed = self._resume(ctx, s.resume_bound_s, what)
                    if resumed is None:
                        resumed = self._resume(ctx, s.resume_bound_s, what + ", again")
                        if resumed is None:
                            self._violate("recovery", "the workload did not recover; run aborted")
                            break
                    else:
                        rec.resume_s = round(resumed, 3)
                ctx.current = None
                self._check(ctx, "settled")
                self._hold(ctx, self.rng.uniform(0.5, 2.0))
            s.records = records
            self._final(ctx)

    def _final(self, ctx: ChaosContext) -> None:
        s, mesh, lan = self.summary, ctx.mesh, ctx.lan
        self._check(ctx, "final")
        try:
            views = mesh.status_views()
            want = mesh.expected_ids()
            for h, v in views.items():
                if v != want:
                    self._violate("status", f"h{h}: ftmesh status shows {len(v)} alive members")
        except (LabError, ValueError) as exc:
            self._violate("status", f"ftmesh status failed: {exc}")
        self._count_deaths(ctx)
        running = mesh.running()
        stats = mesh.stop_all()
        for h, node in running.items():
            if node.proc.returncode != 0:
                self._violate("leak", f"h{h}: member exited with {node.proc.returncode} on SIGTERM")
        for h in range(lan.hosts):
            left = lan.host_pids(h)
            if left:
                self._violate("leak", f"h{h}: processes left after stop: {left}")
        s.junk_dropped = sum(
            v for c in stats.values() for k, v in c.items() if k.startswith("rx_dropped_")
        )
        rec_times = [r.recovery_s for r in s.records if r.recovery_s is not None]
        s.faults_total = len(s.records)
        s.recoveries = len(rec_times)
        if rec_times:
            worst = max(s.records, key=lambda r: r.recovery_s or 0.0)
            s.worst_recovery_s = max(rec_times)
            s.worst_recovery_kind = worst.kind
            s.mean_recovery_s = round(statistics.fmean(rec_times), 3)
        det = [r.detection_s for r in s.records if r.detection_s is not None]
        s.worst_detection_s = round(max(det), 3) if det else 0.0
        resumes = [r for r in s.records if r.resume_s is not None]
        if resumes:
            worst_r = max(resumes, key=lambda r: r.resume_s or 0.0)
            s.worst_resume_s = worst_r.resume_s or 0.0
            s.worst_resume_kind = worst_r.kind
            s.mean_resume_s = round(statistics.fmean(r.resume_s or 0.0 for r in resumes), 3)
        if self.workload is not None:
            s.workload_stats = self.workload.summary()
        s.timeline = chaos_timeline(ctx.mesh.slots, self._t0)
        if self.log_dir is not None:
            self._dump_events(ctx, self.log_dir)

    def _dump_events(self, ctx: ChaosContext, log_dir: Path) -> None:
        """Every record each member printed, next to its stderr log (``-h<host>.<k>
        .events.jsonl``), with ``t``: seconds since the first fault's start, as in the
        violation messages (negative: during startup)."""
        for h, slot in enumerate(ctx.mesh.slots):
            for k, node in enumerate(slot.history):
                with node._cond:
                    seen = list(node.records)
                path = log_dir / f"{MESH}-h{h}.{k}.events.jsonl"
                with open(path, "w") as f:
                    for rec in seen:
                        line = {"t": round(rec.mono - self._t0, 3), **rec.record}
                        f.write(json.dumps(line, separators=(",", ":")) + "\n")

    def _count_deaths(self, ctx: ChaosContext) -> None:
        """Tally suspicions and deaths from every member's events; flag false deaths (of
        members that ran) and resurrections (of members that had been killed)."""
        s = self.summary
        host_of: dict[str, int] = {}
        proc_of: dict[str, str] = {}
        for h, slot in enumerate(ctx.mesh.slots):
            for k, node in enumerate(slot.history):
                host_of[node.node_id] = h
                proc_of[node.node_id] = f"h{h}.{k}"
        windows = [(r.started_s - 0.5, r.settled_at + 1.0, set(r.touched)) for r in s.records]
        for h, slot in enumerate(ctx.mesh.slots):
            for node in slot.history:
                with node._cond:
                    seen = list(node.records)
                dead_seen: set[str] = set()
                for rec in seen:
                    kind = rec.record.get("event")
                    victim_id = str(rec.record.get("node"))
                    killed = ctx.killed_at.get(victim_id)
                    if kind == "suspect":
                        s.suspicions += 1
                    if kind in ("joined", "alive", "updated") and victim_id in dead_seen:
                        if killed is not None and rec.mono > killed:
                            s.resurrections += 1
                            self._violate(
                                "resurrect",
                                f"{proc_of.get(victim_id, '?')} ({victim_id[:8]}), killed at "
                                f"{killed - self._t0:.1f}s and declared dead, was {kind} again "
                                f"for h{h} at {rec.mono - self._t0:.1f}s",
                            )
                        dead_seen.discard(victim_id)
                    if kind != "dead":
                        continue
                    dead_seen.add(victim_id)
                    s.deaths += 1
                    victim = host_of.get(victim_id, -1)
                    at = rec.mono - self._t0
                    if at < 0 or (killed is not None and rec.mono > killed):
                        continue  # startup, or a member that was really dead
                    active = [t for a, b, t in windows if a <= at <= b]
                    if not active:
                        s.false_deaths += 1
                        self._violate(
                            "false_death",
                            f"h{h} ({node.name} {node.node_id[:8]}) declared "
                            f"{proc_of.get(victim_id, '?')} ({victim_id[:8]}) dead at {at:.1f}s "
                            "with no fault active",
                        )
                    elif not any(h in t or victim in t for t in active):
                        s.collateral_deaths += 1


def _workload_argv(
    workload: Workload, preset: str, lan: VirtualLan, host: int, *, extra: list[str]
) -> list[str]:
    return workload.argv(lan, host, mesh=MESH, preset=preset, extra=extra)


def parse_kinds(text: str) -> list[str] | None:
    """``"kill,partition"`` -> ``["kill", "partition"]`` (validated); empty: None (every
    kind that fits the workload)."""
    kinds = [k for k in re.split(r"[,\s]+", text.strip()) if k]
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        raise LabError(f"unknown fault kinds {bad}; choose from {', '.join(KINDS)}")
    return kinds or None


def _data_port(node: NodeProcess | None) -> int:
    """The data-plane port ``node`` last published (its ``self`` records), 0 if none."""
    if node is None:
        return 0
    with node._cond:
        seen = [r.record for r in node.records if r.record.get("event") == "self"]
    for rec in reversed(seen):
        data = rec.get("meta", {}).get("data") if isinstance(rec.get("meta"), dict) else None
        if isinstance(data, str) and data.rpartition(":")[2].isdigit():
            return int(data.rpartition(":")[2])
    return 0
