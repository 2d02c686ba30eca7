"""The training workload of the chaos soak, and the invariants that must hold of it.

Theory of operation: :class:`TrainingWorkload` runs one :mod:`ftmesh.lab.train_worker` per lab
host (fault-tolerant data-parallel training with ``ElasticTrainer``, which prints the usual
membership events plus one ``commit`` record per committed step). A :class:`CommitLog` reads
those records incrementally from every process that ever ran on a host (killed ones included)
and the invariants below read the log, so each record is parsed once however many checks run.

What must hold (each a :class:`~ftmesh.lab.chaos.Invariant`; violations fail the run):

* ``digest`` (:class:`DigestAgreement`): members that commit step ``s`` on the same view
  (epoch) hold bitwise-identical state (equal digests). Every member of a view starts the
  view's first step from one synced state and applies the same reduced gradients, so a
  mismatch is a data-plane or protocol bug. The same step committed on *different* views with
  different digests is a **fork**, counted, not a violation: a member that completed a step
  just before being cut off (killed, frozen, partitioned, suspected under loss) keeps a commit
  the others then redo without it (an *orphan* it discards when it syncs again), and two sides
  of a partition that outlasts the quorum grace both train (``ElasticTrainer(quorum=...)``);
  the ``converge`` check below requires that only one line survives.
* ``step`` (:class:`StepSequence`): per process the committed step goes up by exactly one per
  record; it may jump forward only on a step that began with a sync (the process adopted newer
  state from the others), a fresh process's first record must be such a step, and every step
  is computed from a state of the step before (the record's ``parent_step``), except an
  *adopted* step (taken from the others in a sync), whose parent is the very state it holds.
* ``lost_commit`` (:class:`NoLostCommits`): each state that all running members committed
  together in one ring (after each fault, and at startup) descends, step by step through the
  records' ``parent`` digests, from the previous such state. Forks die out; what the whole
  mesh once agreed on is never thrown away (with the trainer's "newest step wins" sync, the
  mesh's committed step cannot go backwards for the survivors; this checks the stronger
  property that their *line of states* does not either).
* ``progress`` and ``converge`` (checked by the runner through
  :meth:`TrainingWorkload.recovered` after each fault's single view, and at startup): within
  :attr:`TrainingWorkload.recovery_bound` seconds some member commits a step newer than any
  before the view settled, and every running member commits one same step on one view made
  of exactly the running members (one ring, one model again).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .netns import VirtualLan

if TYPE_CHECKING:
    from .chaos import ChaosContext, Invariant, Phase

RECOVERY_BOUND = 30.0
"""Seconds from a single view to every member training together again. The slowest legitimate
path we know: a collective stalled on a member that vanished waits the data plane's
``io_timeout`` (10 s), the retry waits ``view_timeout`` (5 s) for ring agreement, a member
that finds no training mesh waits ``join_settle`` (2 s) before entering the ring (one that
finds one enters at once), a member that lost its majority waits the quorum grace (5 s);
plus CPU slack (``chaos.CPU_SLACK``) and a state fetch."""

STARTUP_BOUND = 120.0
"""Seconds from the first single view to every member training together (each worker imports
torch and the members enter the ring one after the other, on a shared 2-core machine)."""

FORKS_KEPT = 20
"""Forked steps listed in the summary (all are counted)."""

LOSS_WINDOW = 50
"""Commits averaged for the first and last loss of the summary."""


@dataclass(frozen=True, slots=True)
class Commit:
    """One ``commit`` record of one process."""

    proc: str
    """``h<host>.<k>``: the k-th process started on that host (0 is the first)."""
    host: int
    step: int
    digest: str
    parent_step: int
    parent: str
    """Digest of the state the step was computed from (at ``parent_step``)."""
    epoch: str
    members: tuple[str, ...]
    synced: bool
    fetched: int
    loss: float
    mono: float
    """``time.monotonic()`` in the runner when the record was read."""
    first: bool = False
    """The process's first commit."""
    adopted: bool = False
    """Taken from the others in a sync, not computed here (parent: that state itself)."""


def commit_of(proc: str, host: int, rec: dict[str, Any], mono: float, first: bool) -> Commit:
    """A :class:`Commit` from a JSON record; ``ValueError`` (or ``KeyError``, ``TypeError``)
    if a field is missing or malformed."""
    return Commit(
        proc=proc,
        host=host,
        step=int(rec["step"]),
        digest=str(rec["digest"]),
        parent_step=int(rec["parent_step"]),
        parent=str(rec["parent"]),
        epoch=str(rec["epoch"]),
        members=tuple(str(m) for m in rec["members"]),
        synced=bool(rec["synced"]),
        fetched=int(rec.get("fetched") or 0),
        loss=float(rec.get("loss") or 0.0),
        mono=mono,
        first=first,
        adopted=bool(rec.get("adopted")),
    )


@dataclass
class CommitLog:
    """Every commit of a run, in the order the runner read them (per process: in order)."""

    commits: list[Commit] = field(default_factory=list)
    malformed: int = 0
    parents: dict[tuple[int, str], str] = field(default_factory=dict)
    """(step, digest) -> digest of its parent state at step - 1 (the line of states)."""
    _read: dict[str, int] = field(default_factory=dict)
    """Per process: records already looked at."""
    _seen: set[str] = field(default_factory=set)
    """Processes with at least one commit."""

    def add(self, proc: str, host: int, rec: dict[str, Any], mono: float) -> Commit | None:
        """Append one record (tests feed fabricated ones here); None if it is malformed."""
        try:
            c = commit_of(proc, host, rec, mono, first=proc not in self._seen)
        except (KeyError, TypeError, ValueError):
            self.malformed += 1
            return None
        self._seen.add(proc)
        self.commits.append(c)
        if c.parent_step == c.step - 1:
            self.parents.setdefault((c.step, c.digest), c.parent)
        return c

    def descends(self, later: tuple[int, str], earlier: tuple[int, str]) -> bool | None:
        """Whether state ``later`` (step, digest) was computed, step by step, from state
        ``earlier``; None if a link is unknown (no member printed it: all that committed it
        were killed before they could)."""
        step, digest = later
        while step > earlier[0]:
            parent = self.parents.get((step, digest))
            if parent is None:
                return None
            step, digest = step - 1, parent
        return (step, digest) == earlier

    def line(self, state: tuple[int, str]) -> set[tuple[int, str]]:
        """``state`` and its known ancestors."""
        out = set()
        while state[0] >= 0:
            out.add(state)
            parent = self.parents.get(state)
            if parent is None:
                break
            state = (state[0] - 1, parent)
        return out

    def poll(self, ctx: ChaosContext) -> None:
        """Read the new records of every process that ever ran in the lab."""
        for h, slot in enumerate(ctx.mesh.slots):
            for k, node in enumerate(slot.history):
                proc = f"h{h}.{k}"
                start = self._read.get(proc, 0)
                with node._cond:
                    new = node.records[start:]
                self._read[proc] = start + len(new)
                for s in new:
                    if s.record.get("event") == "commit":
                        self.add(proc, h, s.record, s.mono)

    @property
    def max_step(self) -> int:
        return max((c.step for c in self.commits), default=0)


def proc_key(ctx: ChaosContext, host: int) -> str:
    """The :class:`CommitLog` name of the process now current on ``host``."""
    return f"h{host}.{len(ctx.mesh.slots[host].history) - 1}"


class _LogReader:
    """An invariant that looks at each commit of the shared log once."""

    def __init__(self, log: CommitLog) -> None:
        self.log = log
        self._next = 0

    def _new(self, ctx: ChaosContext | None) -> list[Commit]:
        if ctx is not None:
            self.log.poll(ctx)
        new = self.log.commits[self._next :]
        self._next = len(self.log.commits)
        return new


class DigestAgreement(_LogReader):
    """Commits of one step on one view carry one digest; forks across views are counted."""

    name = "digest"

    def __init__(self, log: CommitLog) -> None:
        super().__init__(log)
        self.by_view: dict[tuple[str, int], tuple[str, str]] = {}
        """(epoch, step) -> (digest, process that committed it first)."""
        self.by_step: dict[int, str] = {}
        """Step -> the first digest seen for it."""
        self.forks: dict[int, set[str]] = {}
        """Steps committed with more than one digest (on different views) -> the digests."""
        self.checks = 0
        """Commits compared with an earlier commit of the same step on the same view."""

    def check(self, ctx: ChaosContext | None, phase: Phase) -> Sequence[str]:
        out = []
        for c in self._new(ctx):
            key = (c.epoch, c.step)
            have = self.by_view.get(key)
            if have is None:
                self.by_view[key] = (c.digest, c.proc)
            else:
                self.checks += 1
                if have[0] != c.digest:
                    out.append(
                        f"step {c.step} on view {c.epoch[:8]}: {c.proc} holds digest "
                        f"{c.digest[:12]}, {have[1]} holds {have[0][:12]}"
                    )
            first = self.by_step.setdefault(c.step, c.digest)
            if first != c.digest:
                self.forks.setdefault(c.step, {first}).add(c.digest)
        return out


class StepSequence(_LogReader):
    """Per process: steps go up one at a time, or jump forward on a synced step."""

    name = "step"

    def __init__(self, log: CommitLog) -> None:
        super().__init__(log)
        self.last: dict[str, int] = {}
        self.jumps = 0
        """Steps where a process adopted newer state (joined, or came back behind)."""

    def check(self, ctx: ChaosContext | None, phase: Phase) -> Sequence[str]:
        out = []
        for c in self._new(ctx):
            prev = self.last.get(c.proc)
            self.last[c.proc] = max(c.step, prev or 0)
            if c.adopted and (c.parent_step, c.parent) != (c.step, c.digest):
                out.append(f"{c.proc}: adopted step {c.step} is not the state it fetched")
            elif not c.adopted and c.parent_step != c.step - 1:
                out.append(f"{c.proc}: step {c.step} was computed from a state of step "
                           f"{c.parent_step}")  # fmt: skip
            if prev is None:
                if not c.synced:
                    out.append(f"{c.proc}: first commit (step {c.step}) began without a sync")
                continue
            if c.step <= prev:
                out.append(f"{c.proc}: committed step {c.step} after step {prev}")
            elif c.step > prev + 1:
                if c.synced:
                    self.jumps += 1
                else:
                    out.append(f"{c.proc}: skipped from step {prev} to {c.step} without a sync")
        return out


class NoLostCommits:
    """Every state all running members trained on together (after a fault, or at startup) is
    an ancestor of every later such state: what the whole mesh once agreed on is never
    thrown away, whatever the partitions and forks in between."""

    name = "lost_commit"

    def __init__(self, log: CommitLog) -> None:
        self.log = log
        self.agreed: list[tuple[int, str]] = []
        """(step, digest) of each state the whole mesh converged on, in order."""
        self._checked = 0
        self.checks = 0
        self.unknown = 0
        """Checks that could not be decided (a link of the line was never printed)."""

    def agree(self, state: tuple[int, str]) -> None:
        """The whole mesh (every running member, one view) just committed ``state``."""
        self.agreed.append(state)

    def check(self, ctx: ChaosContext | None, phase: Phase) -> Sequence[str]:
        out = []
        while self._checked + 1 < len(self.agreed):
            earlier, later = self.agreed[self._checked], self.agreed[self._checked + 1]
            self._checked += 1
            found = self.log.descends(later, earlier)
            self.checks += 1
            if found is None:
                self.unknown += 1
            elif not found:
                out.append(
                    f"the mesh agreed on step {earlier[0]} ({earlier[1][:12]}), later on step "
                    f"{later[0]} ({later[1][:12]}), which does not descend from it"
                )
        return out


@dataclass
class _Mark:
    mono: float
    high: int
    index: int


class TrainingWorkload:
    """Fault-tolerant training on every lab host; see the module docstring."""

    name = "train"

    def __init__(
        self,
        *,
        seed: int = 0,
        step_delay: float = 0.05,
        recovery_bound: float = RECOVERY_BOUND,
        startup_bound: float = STARTUP_BOUND,
    ) -> None:
        self.seed = seed
        self.step_delay = step_delay
        self.recovery_bound = recovery_bound
        self.startup_bound = startup_bound
        self.log = CommitLog()
        self.digests = DigestAgreement(self.log)
        self.steps = StepSequence(self.log)
        self.lost = NoLostCommits(self.log)
        self._mark = _Mark(0.0, 0, 0)

    def argv(
        self, lan: VirtualLan, host: int, *, mesh: str, preset: str, extra: Sequence[str] = ()
    ) -> list[str]:
        argv = ["ip", "netns", "exec", lan.ns_name(host), sys.executable]
        argv += ["-m", "ftmesh.lab.train_worker", "--mesh", mesh, "--preset", preset]
        argv += ["--interface", lan.host_ip(host), "--name", f"h{host}"]
        argv += ["--seed", str(self.seed), "--step-delay", str(self.step_delay)]
        return [*argv, *extra]

    def invariants(self) -> Sequence[Invariant]:
        return [self.digests, self.steps, self.lost]

    def mark(self, ctx: ChaosContext) -> None:
        """A single view was just reached: what follows must be newer than what came before."""
        self.log.poll(ctx)
        self._mark = _Mark(time.monotonic(), self.log.max_step, len(self.log.commits))

    def recovered(self, ctx: ChaosContext) -> tuple[str, str] | None:
        """None once training has recovered since :meth:`mark`, else (violation kind, why)."""
        self.log.poll(ctx)
        since = self.log.commits[self._mark.index :]
        if not any(c.step > self._mark.high for c in since):
            return "progress", f"no step committed after step {self._mark.high}"
        expected = ctx.mesh.expected()
        procs = {proc_key(ctx, h) for h in expected}
        ids = frozenset(n.node_id for n in expected.values())
        who: dict[tuple[str, int], set[str]] = defaultdict(set)
        last: dict[str, Commit] = {}
        for c in since:
            if c.proc in procs and frozenset(c.members) == ids:
                who[(c.epoch, c.step)].add(c.proc)
            last[c.proc] = c
        together = [k for k, p in who.items() if p == procs]
        if together:
            epoch, step = min(together, key=lambda k: k[1])
            digest = next(c.digest for c in since if c.epoch == epoch and c.step == step)
            self.lost.agree((step, digest))
            return None
        status = ", ".join(
            f"{p} " + (f"at step {last[p].step} on {len(last[p].members)}" if p in last else "-")
            for p in sorted(procs)
        )
        return "converge", f"the {len(procs)} members do not train together ({status})"

    def summary(self) -> dict[str, Any]:
        commits = self.log.commits
        forks = sorted(self.digests.forks)
        final = self.lost.agreed[-1] if self.lost.agreed else None
        line = self.log.line(final) if final else set()
        computed = [c for c in commits if not c.adopted]
        head = [c.loss for c in computed[:LOSS_WINDOW]]
        tail = [c.loss for c in computed[-LOSS_WINDOW:]]
        upto = final[0] if final else -1
        off = [c for c in commits if c.step <= upto and (c.step, c.digest) not in line]
        return {
            "workload": self.name,
            "commits": len(commits),
            "max_step": self.log.max_step,
            "processes": len({c.proc for c in commits}),
            "views": len({c.epoch for c in commits}),
            "digest_checks": self.digests.checks,
            "lineage_checks": self.lost.checks,
            "lineage_unknown": self.lost.unknown,
            "synced_jumps": self.steps.jumps,
            "forked_steps": len(forks),
            "forks": {str(s): len(self.digests.forks[s]) for s in forks[:FORKS_KEPT]},
            "discarded_commits": len(off),
            "discarded_states": len({(c.step, c.digest) for c in off}),
            "mean_loss_first": round(statistics.fmean(head), 4) if head else None,
            "mean_loss_last": round(statistics.fmean(tail), 4) if tail else None,
            "malformed_records": self.log.malformed,
        }
