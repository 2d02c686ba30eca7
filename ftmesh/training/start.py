"""Starting together: when a fresh mesh takes its first step, and when a member gives up.

Theory of operation (sans-IO: the caller passes the time and the members it sees).
A member of a mesh that has not started (no member advertises a committed state yet) says
it is ready (role ``starting``) and waits until ``start_peers`` members are ready; then every
one of them enters the ring. A member counts as ready when it is alive and its role is
``starting`` *or any role a ready member moves on to* (``train``, ``spare``) while nobody
has committed a step: the first member to see the count reached enters the ring at once, so
a member that only counted ``starting`` could miss it for good and wait out the whole
timeout (the start race of issue #12: 11 of 19 ``ftmesh launch`` runs stalled 60 s).

No silent splits. When ``timeout`` runs out with fewer than ``start_peers`` ready, a group
holding more than half of them goes ahead (the others join it as they come: they see its
state), and a smaller one gives up with an error that says what it found. Two groups that
cannot see each other can never both hold more than half, so a mesh told to start with N
members never splits into several meshes that each train their own model. Until then the
member reports, every ``REPORT_EVERY`` seconds (the first after ``REPORT_AFTER``), whom it
found; the caller says it loudly.

A member of a mesh whose training is over (members are ``done`` and nobody trains) stops
with ``FINISHED`` instead of training a model of its own from step 0: say a Kubernetes pod
scaled out after the run ended.

A member started to *join* a running mesh (``join_running``: ``ftmesh launch``'s
``--join-at`` and ``--respawn`` workers) never starts one: it enters once a member trains
with a committed state, stops with ``FINISHED`` when training is over (members finished or
left and nobody trains), and gives up at the timeout.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import ConfigError

DEFAULT_START_TIMEOUT = 60.0
"""Seconds a member waits for its start peers (or a running mesh) before it decides."""
REPORT_AFTER = 5.0
"""Seconds of waiting before the first report of whom a member found."""
REPORT_EVERY = 15.0
"""Seconds between later reports: a user watching the log learns it in the first minute."""
READY_ROLES = ("starting", "train", "spare")
"""Roles of a member that reached the start (``train`` and ``spare`` are where it goes next)."""
FINISHED_ROLES = ("done",)
"""Roles of a member whose training is over."""


@dataclass(frozen=True, slots=True)
class StartConfig:
    """How a member starts: the one owner of ``start_peers`` and the start timeout, their
    defaults (1: no wait; 60 s) and the rule that lays given values over them
    (:meth:`overlay`). Where the values come from, each laid over the one before:

    1. these defaults;
    2. the mesh's settings (``ftmesh.settings.Settings.start_config``: ``--start-peers``,
       ``--start-timeout``, ``$FTMESH_START_PEERS``, ``ftmesh.connect(start_peers=...)``;
       ``ftmesh launch -n N`` gives ``N`` to its first ``N`` workers when none is given),
       kept as ``SyncMesh.start_config``, advertised in the member's metadata;
    3. the trainer's ``TrainerConfig.start_peers`` / ``start_timeout``, explicit overrides
       for the trainer made on that mesh (``None``, the default: the mesh's)."""

    start_peers: int = 1
    """Members a fresh mesh waits for before its first step; 0 or 1: no wait."""
    timeout: float = DEFAULT_START_TIMEOUT
    """Seconds to wait for them (see the module docstring for what happens then)."""
    join_running: bool = False
    """Join a mesh that is already training; never start one."""

    def __post_init__(self) -> None:
        if self.start_peers < 0:
            raise ConfigError(f"start_peers must be 0 or more, got {self.start_peers}")
        if not self.timeout > 0:
            raise ConfigError(f"the start timeout must be positive, got {self.timeout}")

    def overlay(
        self,
        start_peers: int | None = None,
        timeout: float | None = None,
        join_running: bool | None = None,
    ) -> StartConfig:
        """This config with each value that is given (not ``None``) in place of its own."""
        return StartConfig(
            self.start_peers if start_peers is None else start_peers,
            self.timeout if timeout is None else timeout,
            self.join_running if join_running is None else join_running,
        )

    @property
    def waits(self) -> bool:
        """Whether a member with this config waits at all before its first step."""
        return self.join_running or self.start_peers > 1


@dataclass(frozen=True, slots=True)
class Peer:
    """What the gate needs to know of one member (the caller reads it from membership)."""

    node: str
    name: str
    alive: bool
    left: bool
    """It left the mesh on purpose (a finished member leaves)."""
    role: str
    started: bool
    """It advertises a committed state: the mesh has started."""


class Decision(enum.Enum):
    WAIT = "wait"
    """Keep waiting (and report if ``report`` says so)."""
    ENTER = "enter"
    """``start_peers`` are ready: enter the ring and wait for the view that holds them."""
    JOIN = "join"
    """The mesh has started: enter it as a joiner."""
    GO_AHEAD = "go_ahead"
    """Timed out holding more than half of ``start_peers``: start with those."""
    FINISHED = "finished"
    """``join_running``: the training is over, there is nothing to join."""
    GIVE_UP = "give_up"
    """Timed out without enough members: starting would split the mesh."""


@dataclass(frozen=True, slots=True)
class StartStatus:
    decision: Decision
    ready: tuple[str, ...]
    """Names of the ready members (us included), sorted."""
    expected: int
    waited: float
    """Seconds since the gate opened."""
    report: bool = False
    """Time to tell the user whom we found."""

    def describe(self) -> str:
        """One sentence about whom we found, e.g. ``found 1 of 4 members (w0)``."""
        names = ", ".join(self.ready) or "none"
        if self.expected > 1:
            return (
                f"found {len(self.ready)} of {self.expected} members (start_peers) after "
                f"{self.waited:.0f}s: {names}"
            )
        return f"found no training mesh after {self.waited:.0f}s (members ready: {names})"


class StartGate:
    """The start decision of one member; see the module docstring."""

    def __init__(self, config: StartConfig, now: float) -> None:
        self.config = config
        self._opened = now
        self._next_report = now + REPORT_AFTER

    @property
    def deadline(self) -> float:
        return self._opened + self.config.timeout

    def observe(self, now: float, peers: Sequence[Peer]) -> StartStatus:
        cfg = self.config
        live = [p for p in peers if p.alive]
        ready = tuple(sorted(p.name for p in live if p.role in READY_ROLES))
        waited = now - self._opened

        def status(decision: Decision, report: bool = False) -> StartStatus:
            return StartStatus(decision, ready, cfg.start_peers, waited, report)

        training = any(p.role == "train" for p in live)
        if cfg.join_running:
            if any(p.started and p.role == "train" for p in live):
                return status(Decision.JOIN)
            ended = any(p.role in FINISHED_ROLES or p.left for p in peers)
            if ended and not training:
                return status(Decision.FINISHED)
        else:
            if not training and any(p.role in FINISHED_ROLES for p in live):
                return status(Decision.FINISHED)  # (say a pod scaled out after the end)
            if any(p.started for p in peers):
                return status(Decision.JOIN)
            if len(ready) >= cfg.start_peers:
                return status(Decision.ENTER)
        if now >= self.deadline:
            if not cfg.join_running and 2 * len(ready) > cfg.start_peers:
                return status(Decision.GO_AHEAD, report=True)
            return status(Decision.GIVE_UP, report=True)
        report = now >= self._next_report
        if report:
            self._next_report = now + REPORT_EVERY
        return status(Decision.WAIT, report)
