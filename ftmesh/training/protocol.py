"""The per-step agreement of fault-tolerant training, as pure functions.

Theory of operation. Every member counts its *committed* steps. A step runs on one view, in
parts that the rest of the package cites by number:

1. **Sync** (only when the view's epoch differs from the last one we trained on): one
   allreduce(max) of every member's committed step, state size and digest
   (:func:`sync_vector`), from which every member computes the same :class:`SyncPlan`
   (:func:`plan_sync`): the newest step wins, and the members behind fetch its state.
2. **Step.** Gradients on each member's share, added up by one allreduce(sum) that carries
   the step's header (sample count, loss, round check, leave slots, check values, speeds).
3. **Failure.** A broken allreduce fails every survivor's round; they sync on the next view,
   where members that completed the step hand it to the others: a step is committed by every
   survivor or by none, never applied twice, never skipped.
4. **Planned departure.** A leaver sets its bit in the leave slots (:func:`leave_slots`,
   :func:`leavers`), or, asked to leave after its header went out, the ``FLAG_LEAVING`` bit in
   its gathered row (:func:`row_leaves`); all pass one barrier, and the others go on without
   it, without a sync.
5. **Speed-proportional shares** (``shares="speed"``): speeds ride in the header, and every
   member makes the same next split from them (:func:`speed_weights`, :func:`split_tag`).

Checks guard against data of another round (:func:`own_slots_intact`, :func:`round_tag`),
against diverged state (:func:`check_value`, :func:`diverged_members`) and against a member's
false claims, read from its own gathered row (:func:`row_faults`, :func:`rows_mismatch`).

The invariant this rests on: two members with the same committed step hold bitwise-identical
state, because they started identical (1) and applied the same reduced gradients, which every
ring member receives bitwise identical (``ftmesh.collective``).

Each part and check in full: ``docs/DESIGN-NOTES.md``, "The per-step agreement".
"""

from __future__ import annotations

import enum
import hashlib
import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import LocalUsageError

QUORUM_POLICIES = ("majority", "any")
SHARES = ("equal", "speed")
"""How a step's global batch is split among the members computing (``TrainerConfig.shares``)."""

FRESH = -1
"""Committed step of a member that has not yet trained in this mesh."""


DIGEST_HEX = 64
"""Hex characters of a state digest (``ftmesh.state``: BLAKE2b-256)."""
_DIGEST_CUTS = (0, 14, 28, 42, 56, 64)
"""The digest travels as 5 non-negative int64 slots of at most 14 hex characters (56 bits)."""
DIGEST_SLOTS = len(_DIGEST_CUTS) - 1
SLOTS = 2 + DIGEST_SLOTS
"""Slots per member in the sync vector: committed step, state bytes, digest."""


@dataclass(frozen=True, slots=True)
class SyncPlan:
    target_step: int
    """The committed step every member holds after the sync."""
    root: int
    """First rank holding the state everybody adopts (``-1``: nobody is behind)."""
    behind: tuple[int, ...]
    """Ranks that load the root's state."""
    nbytes: int
    """Size of that state in bytes."""
    digest: str = ""
    """Its full digest (what the ranks behind fetch and verify)."""
    holders: tuple[int, ...] = ()
    """Ranks that hold exactly that state and can serve it (the root first)."""


def digest_slots(digest: str) -> list[int]:
    if len(digest) != DIGEST_HEX:
        raise LocalUsageError(f"a state digest has {DIGEST_HEX} hex characters, got {len(digest)}")
    return [int(digest[a:b], 16) for a, b in itertools.pairwise(_DIGEST_CUTS)]


def digest_of(slots: list[int]) -> str:
    return "".join(
        f"{v:0{b - a}x}" for v, (a, b) in zip(slots, itertools.pairwise(_DIGEST_CUTS), strict=True)
    )


def sync_vector(rank: int, size: int, committed: int, nbytes: int, digest: str) -> np.ndarray:
    """This member's contribution to the sync allreduce(max): its slots hold its committed
    step, state size and digest, every other slot ``FRESH`` (below any real value)."""
    v = np.full(SLOTS * size, FRESH, dtype=np.int64)
    v[rank] = committed
    v[size + rank] = nbytes
    for k, d in enumerate(digest_slots(digest)):
        v[(2 + k) * size + rank] = d
    return v


def own_slots_intact(reduced: np.ndarray, own: np.ndarray, rank: int, size: int) -> bool:
    """Whether the reduced sync vector still holds this member's own values: every other
    member writes ``FRESH`` (the minimum) there, so a vector that does not is data of another
    round and must not be acted on."""
    slots = [k * size + rank for k in range(SLOTS)]
    return bool(np.array_equal(reduced[slots], own[slots]))


def plan_sync(reduced: np.ndarray) -> SyncPlan:
    """The sync decision from the reduced vector; every member computes the same one."""
    size = len(reduced) // SLOTS
    steps = [int(s) for s in reduced[:size]]
    sizes = [int(b) for b in reduced[size : 2 * size]]
    digests = [
        digest_of([int(reduced[(2 + k) * size + r]) for k in range(DIGEST_SLOTS)])
        for r in range(size)
    ]
    newest = max(steps)
    if newest == FRESH:
        # Nobody has trained: rank 0's initial state becomes everybody's starting point.
        behind = tuple(range(1, size))
        if not behind:
            return SyncPlan(0, -1, (), 0)
        return SyncPlan(0, 0, behind, sizes[0], digests[0], (0,))
    root = steps.index(newest)
    same = tuple(r for r in range(size) if steps[r] == newest and digests[r] == digests[root])
    behind = tuple(r for r in range(size) if r not in same)
    if not behind:
        return SyncPlan(newest, -1, (), 0)
    return SyncPlan(newest, root, behind, sizes[root], digests[root], same)


def round_tag(step: int) -> float:
    """Each member's value in the gradient allreduce's round-check slot for computing
    ``step``: the reduced sum must be ``size * round_tag(step)``, exactly (float32 holds it for
    any view of up to 256 members), else the reduced gradients are not all of this step."""
    return float(step % (1 << 15) + 1)


LEAVE_BITS = 24
"""Ranks per leave slot: each slot is a float32 sum of distinct powers of two below 2**24,
an integer float32 holds exactly whatever order the ring adds it in."""
LEAVE_SLOTS = 11
"""Leave slots in the gradient allreduce: ranks 0..263, beyond the 256 members a view may
have (the round check, ``round_tag``, is exact up to there)."""


def leave_slots(rank: int) -> np.ndarray:
    """This member's contribution to the leave slots when it leaves after the step: its
    rank's bit (zeros where the rank is beyond ``LEAVE_SLOTS * LEAVE_BITS``)."""
    slots = np.zeros(LEAVE_SLOTS, dtype=np.float32)
    word, bit = divmod(rank, LEAVE_BITS)
    if word < LEAVE_SLOTS:
        slots[word] = float(1 << bit)
    return slots


def leavers(reduced: np.ndarray, size: int) -> tuple[int, ...] | None:
    """The ranks whose bit is set in the reduced leave slots, or None when the slots are not
    a valid sum of leave bits of a view of ``size`` (data of another round: never act on it)."""
    ranks: list[int] = []
    for word, value in enumerate(reduced[:LEAVE_SLOTS].tolist()):
        if value == 0:
            continue
        if not (math.isfinite(value) and 0 < value < 1 << LEAVE_BITS):
            return None
        bits = int(value)
        if bits != value or not 0 < bits < 1 << LEAVE_BITS:
            return None
        ranks += [word * LEAVE_BITS + b for b in range(LEAVE_BITS) if bits >> b & 1]
    return tuple(ranks) if all(r < size for r in ranks) else None


COUNTER_SLOTS = 3
"""The first slots of the gradient allreduce's header: the member's sample count, its summed
loss and the round check."""
HEADER_SLOTS = COUNTER_SLOTS + LEAVE_SLOTS
"""Slots of the header before the check slots: the counters, then the leave slots."""
CHECK_BITS = 16
"""Bits of a part's digest that ride in a check slot: ``size * value`` must stay exact in
float32 (below 2**24) for views of up to 256 members."""


SPEED_RANKS = 256
"""Ranks with a speed slot (``shares="speed"``): the views of up to 256 members the round
check is exact for; a rank beyond writes none and counts at the median speed."""
SPEED_SLOTS = SPEED_RANKS + 1
"""The speed part of the header (``shares="speed"`` only): one compute speed per rank, then
the split tag (:func:`split_tag`)."""
SHARE_SMOOTHING = 0.3
"""Weight of the newest step in a member's smoothed compute speed: an EWMA of its seconds per
sample (of its own forward and backward), so the speed is a harmonic mean of its steps'. A
member fast on some steps and stalled on others (a CPU quota whose period is longer than its
compute) counts at its throughput over them, which is what the steps it slows see; an EWMA of
samples per second let one fast step in four hide a 20x throttle from the straggler rule
(seen in the lab)."""
SHARE_FLOOR = 0.1
"""A member's weight is at least this fraction of an equal share (a slowed member keeps
measuring, and comes back when it speeds up)."""
SHARE_HYSTERESIS = 0.1
"""The split changes only when the slowest member's predicted compute time (its share at its
smoothed speed) exceeds the mean of those computing by more than this fraction: shares do
not move with measurement noise, nor where compute time hardly depends on the share (a
fixed per-step cost dominates), which would otherwise let noise walk the split anywhere."""


def header_size(parts: int, speeds: bool = False) -> int:
    """Slots of the gradient allreduce's header for ``parts`` registered parts: counters,
    leave slots, check slots, and with ``speeds`` the speed slots."""
    return HEADER_SLOTS + parts + (SPEED_SLOTS if speeds else 0)


def split_tag(workers: Sequence[str], counts: Sequence[int]) -> int:
    """Each member's value in the split-tag slot: a 16-bit hash of the split it computed
    (who computes how many samples), plus one. The reduced slot is ``size * split_tag``
    exactly when every member of the view split the step alike (float32 is exact there for
    views of up to 256 members), else two members may have computed overlapping samples."""
    text = ",".join(f"{w}:{c}" for w, c in zip(workers, counts, strict=True))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=2).digest(), "big") + 1


MAX_SPEED = 1e9
"""The highest compute speed (samples/s) a member may claim: far above any real forward and
backward (a tiny model on a fast GPU does about 1e6), far below where the arithmetic on
speeds (sums of 256, ``* 1000`` into an int64 sync slot) could overflow. A claim above it
is an offence of its member (``RowFault.SPEED``)."""


def speeds_problem(speeds: Sequence[float], size: int, tag: int) -> str:
    """What is wrong with the reduced speed slots of a view of ``size`` ("" when sound):
    the split tag must be ``size * tag``, every speed finite and in ``[0, MAX_SPEED]``."""
    if len(speeds) != SPEED_SLOTS or speeds[-1] != size * tag:
        return f"split tag {speeds[-1] if speeds else None}, expected {size * tag}"
    if not all(math.isfinite(v) and 0 <= v <= MAX_SPEED for v in speeds[:-1]):
        return f"speed slots not finite and in [0, {MAX_SPEED:g}]"
    return ""


def proportional_weights(speeds: Sequence[float], floor: float) -> tuple[float, ...]:
    """Weights (summing to 1) proportional to ``speeds`` (all > 0), each at least ``floor``
    of an equal share, then normalized."""
    n, total = len(speeds), sum(speeds)
    clipped = [max(s / total, floor / n) for s in speeds]
    norm = sum(clipped)
    return tuple(w / norm for w in clipped)


def filled_speeds(speeds: Sequence[float]) -> list[float] | None:
    """``speeds`` with unmeasured ones (0) at the median of the others (``None``: none
    measured)."""
    known = sorted(s for s in speeds if s > 0)
    if not known:
        return None
    median = known[len(known) // 2]
    return [s if s > 0 else median for s in speeds]


def speed_weights(
    speeds: Sequence[float],
    counts: Sequence[int],
    current: Sequence[float] | None,
    floor: float = SHARE_FLOOR,
) -> tuple[float, ...] | None:
    """The next split's weights (summing to 1) of members with these smoothed ``speeds``
    (samples/s; 0: not measured, counts at the median of the others) that computed ``counts``
    samples with the ``current`` weights (``None``: equal shares). Kept (returned as they
    are) unless the members' predicted compute times ``count / speed`` are uneven by more
    than ``SHARE_HYSTERESIS``; else proportional to speed, each at least ``floor`` of an
    equal share (then normalized). ``None``: equal shares."""
    kept = None if current is None else tuple(current)
    filled = filled_speeds(speeds)
    if filled is None:
        return kept
    times = [c / s for c, s in zip(counts, filled, strict=True) if c > 0]
    if times and max(times) <= (1 + SHARE_HYSTERESIS) * sum(times) / len(times):
        return kept
    return proportional_weights(filled, floor)


def check_value(digest: str) -> int:
    """A part's check value (its digest's first ``CHECK_BITS`` bits, plus one so that a
    member that checks never adds up to a member that does not)."""
    return int(digest[: CHECK_BITS // 4], 16) + 1


@dataclass(frozen=True, slots=True)
class ReductionProblem:
    """What is wrong with a reduced header: ``desync`` (data of another round, or members
    that split the batch differently: retry from a sync) or ``diverged`` (indices of the
    parts whose digests differ between members: a fatal error)."""

    desync: str = ""
    diverged: tuple[int, ...] = ()


def reduction_problem(
    step: int,
    size: int,
    samples: int,
    header: Sequence[float],
    own_checks: Sequence[int] | None,
    rank: int = 0,
    announced: bool = False,
) -> ReductionProblem | None:
    """Check the reduced header of computing ``step`` (0-based) on a view of ``size``:
    ``samples`` is the step's global batch size, ``own_checks`` our check values (``None``:
    not a check step, the slots must be 0), ``announced``: whether we (``rank``) set our leave
    bit (the reduced leave slots must hold it exactly then)."""
    total, _, tags = header[:COUNTER_SLOTS]
    if tags != round_tag(step) * size:
        return ReductionProblem(
            desync=f"step {step + 1}: round check {tags}, expected {round_tag(step) * size}"
        )
    if total != samples:
        return ReductionProblem(
            desync=f"step {step + 1}: {total:.0f} samples reduced, the step has {samples}"
        )
    gone = leavers(np.asarray(header[COUNTER_SLOTS:HEADER_SLOTS]), size)
    if gone is None or (rank in gone) != announced:
        return ReductionProblem(
            desync=f"step {step + 1}: leave slots {list(header[COUNTER_SLOTS:HEADER_SLOTS])}"
        )
    checks = header[HEADER_SLOTS:]
    expected = [0] * len(checks) if own_checks is None else [v * size for v in own_checks]
    diverged = tuple(
        i for i, (got, want) in enumerate(zip(checks, expected, strict=True)) if got != want
    )
    if diverged and own_checks is None:
        return ReductionProblem(desync=f"step {step + 1}: check slots set on a non-check step")
    return ReductionProblem(diverged=diverged) if diverged else None


# -- each member's own contribution, gathered (``DESIGN-NOTES``: the step header) ------------

ROW_FLAG = 1
"""Slots a member's gathered row has after its header contribution: its flags, a sum of
``FLAG_*`` bits (0 to 15)."""
FLAG_NONFINITE = 1
"""Its own gradients held a NaN or an infinity, so it sent zeros instead."""
FLAG_LEAVING = 2
"""It leaves after the step (4 above), asked to after its leave bit had gone out in the
header: said in its row, so that it need not compute one more step to announce. Every member
reads the same rows, so every member sees the same leavers (:func:`row_leaves`)."""
FLAG_FROZE = 4
"""Its process stood still (``ftmesh.torch.freezes``) since its last committed step: every
member reads who froze in the same step, so a stall of the whole host (most members freezing
together) is told apart from one fail-slow member (``ftmesh.training.pace``)."""
FLAG_STEPS_OUT = 8
"""It is fail-slow and asks to step out of the ring after the step; the rows decide who may
(:func:`may_step_out`)."""
MAX_FLAGS = 15


def row_flag(flags: float, bit: int) -> bool:
    """Whether a row's flags hold ``bit`` (a ``FLAG_*``); False for flags that are not a
    sum of them (:func:`row_faults` says so), whatever the value."""
    f = float(flags)
    return math.isfinite(f) and 0 <= f <= MAX_FLAGS and f == int(f) and bool(int(f) & bit)


def row_nonfinite(flags: float) -> bool:
    """Whether a row's flags (checked by :func:`row_faults`) say ``FLAG_NONFINITE``."""
    return row_flag(flags, FLAG_NONFINITE)


def row_leaves(flags: float) -> bool:
    """Whether a row's flags (checked by :func:`row_faults`) say ``FLAG_LEAVING``."""
    return row_flag(flags, FLAG_LEAVING)


def may_step_out(asking: Sequence[str], workers: Sequence[str]) -> tuple[str, ...]:
    """Who of the members ``asking`` to step out (``FLAG_STEPS_OUT``) after a step computed
    by ``workers`` may: the first by node id, as many as leave two members computing. The same
    for every member that read the same rows."""
    return tuple(sorted(asking)[: max(0, len(workers) - 2)])


class RowFault(enum.Enum):
    """What is wrong with one member's own contribution to a step's header (its gathered
    row, :func:`row_faults`), or with the rows together. The value is the name logged and
    counted. ``SPEED`` and ``OTHERS_SLOT`` are *soft*: the member's speed is not used (it
    counts as unmeasured) and the step goes on; the others fail the attempt."""

    SHAPE = "shape"
    """The rows are not one per member of the view, of the header's length."""
    NOT_FINITE = "not_finite"
    """A slot other than the loss is NaN, infinite, or not a float32 (the header is)."""
    SAMPLES = "samples"
    """Its sample count is not an integer in ``[0, global batch]``."""
    ROUND = "round"
    """Its round tag is not the step's (:func:`round_tag`)."""
    LEAVE = "leave"
    """Its leave slots hold anything but nothing or its own bit (:func:`leave_slots`)."""
    CHECKS = "checks"
    """Its check slots are not 0 (no check step) or integers in ``[1, 2**CHECK_BITS]``."""
    SPLIT = "split"
    """Its split tag is not the step's (:func:`split_tag`)."""
    FLAG = "flag"
    """Its flags are not a sum of ``FLAG_*`` bits (0 to 15)."""
    SPEED = "speed"
    """Its own speed is out of ``[0, MAX_SPEED]``, or 0 although it computed samples."""
    OTHERS_SLOT = "others_slot"
    """It wrote into another member's speed slot (a claim about another member)."""
    MISMATCH = "mismatch"
    """The reduced header is not the sum of the rows: some member reported a row that is not
    what it added (which one, nobody can say)."""

    @property
    def soft(self) -> bool:
        return self in (RowFault.SPEED, RowFault.OTHERS_SLOT)


@dataclass(frozen=True, slots=True)
class Offence:
    """One member's fault in one step's header (``rank`` in the view; -1: not attributable)."""

    rank: int
    fault: RowFault
    detail: str


def row_faults(
    row: Sequence[float],
    *,
    step: int,
    rank: int,
    batch: int,
    parts: int,
    check: bool,
    tag: int | None,
) -> list[Offence]:
    """The faults of the gathered ``row`` of the member at ``rank`` (its header contribution,
    then its flags) for computing ``step`` (0-based) of ``batch`` samples with
    ``parts`` check slots (``check``: a check step), ``tag``: the split tag (``None``: no
    speed slots). Never raises, whatever the values: every read is range-checked first."""
    found: list[Offence] = []

    def bad(fault: RowFault, detail: str) -> None:
        found.append(Offence(rank, fault, detail))

    v = [float(x) for x in row]
    n = HEADER_SLOTS + parts + (SPEED_SLOTS if tag is not None else 0)
    if len(v) != n + ROW_FLAG:
        bad(RowFault.SHAPE, f"row of {len(v)} slots, expected {n + ROW_FLAG}")
        return found
    with np.errstate(over="ignore"):
        exact = np.asarray(v, dtype=np.float64) == np.asarray(v, dtype=np.float32)
    odd = [i for i, x in enumerate(v) if i != 1 and not (math.isfinite(x) and exact[i])]
    if odd:
        bad(RowFault.NOT_FINITE, f"slots {odd[:8]} not finite float32 values")
        return found
    share = v[0]
    if not (share == int(share) and 0 <= share <= batch):
        bad(RowFault.SAMPLES, f"{share:g} samples of a step of {batch}")
    if v[2] != round_tag(step):
        bad(RowFault.ROUND, f"round tag {v[2]:g}, expected {round_tag(step):g}")
    leave = v[COUNTER_SLOTS:HEADER_SLOTS]
    if any(leave) and leave != leave_slots(rank).tolist():
        bad(RowFault.LEAVE, f"leave slots {leave}")
    checks = v[HEADER_SLOTS : HEADER_SLOTS + parts]
    top = 1 << CHECK_BITS
    if not all((c == int(c) and 1 <= c <= top) if check else c == 0 for c in checks):
        bad(RowFault.CHECKS, f"check slots {checks} on a{'' if check else ' non'}-check step")
    if tag is not None:
        speeds = v[HEADER_SLOTS + parts : n - 1]
        own = speeds[rank] if rank < SPEED_RANKS else 0.0
        others = [i for i, x in enumerate(speeds) if x != 0 and i != rank]
        if others:
            bad(RowFault.OTHERS_SLOT, f"wrote into the speed slots of ranks {others[:8]}")
        if not 0 <= own <= MAX_SPEED or (own == 0 and share > 0 and rank < SPEED_RANKS):
            bad(RowFault.SPEED, f"speed {own:g} samples/s with {share:g} samples computed")
        if v[n - 1] != tag:
            bad(RowFault.SPLIT, f"split tag {v[n - 1]:g}, expected {tag}")
    if not (v[n] == int(v[n]) and 0 <= v[n] <= MAX_FLAGS):
        bad(RowFault.FLAG, f"flags {v[n]:g}")
    return found


def rows_mismatch(rows: np.ndarray, header: Sequence[float], speeds: int = 0) -> str:
    """What differs between the reduced ``header`` and the sum of the gathered rows' header
    parts ("": nothing). Not compared: the loss (a float sum, order-dependent) and the
    ``speeds`` speed slots before the split tag at the end (each member's speed is read from
    its own row, never from the sum). The others hold integers below 2**24, which the
    float32 ring sums exactly in any order."""
    sums = rows[:, : len(header)].astype(np.float64).sum(axis=0)
    end = len(header) - 1 - speeds
    differ = [
        i
        for i, (a, b) in enumerate(zip(sums.tolist(), header, strict=True))
        if i != 1 and not end <= i < end + speeds and a != float(np.float32(b))
    ]
    return (
        f"reduced header slots {differ[:8]} are not the sum of the members' rows" if differ else ""
    )


def diverged_members(
    names: Sequence[str], members: Sequence[str], rows: Sequence[Sequence[int]]
) -> dict[str, list[list[str]]]:
    """From every member's check values (``rows``, in the order of ``members``): for each part
    that differs, the groups of members that agree with each other, largest first."""
    out: dict[str, list[list[str]]] = {}
    for i, name in enumerate(names):
        groups: dict[int, list[str]] = {}
        for member, row in zip(members, rows, strict=True):
            groups.setdefault(int(row[i]), []).append(member)
        if len(groups) > 1:
            out[name] = sorted(groups.values(), key=lambda g: (-len(g), g))
    return out


def split_share(n: int, weights: Sequence[float] | None, parts: int) -> list[int]:
    """How many of a step's ``n`` samples each of ``parts`` members computes: proportional to
    ``weights`` (largest remainders, ties to the lower rank, at least one each where ``n >=
    parts``), equal shares when ``None`` (as ``numpy.array_split``: the first ``n % parts``
    get one more)."""
    if parts < 1:
        raise LocalUsageError("a step needs at least one member computing")
    if weights is None:
        base, extra = divmod(n, parts)
        return [base + (r < extra) for r in range(parts)]
    if len(weights) != parts or any(not w >= 0 for w in weights) or not sum(weights) > 0:
        raise LocalUsageError(
            f"need {parts} non-negative weights with a positive sum, got {weights}"
        )
    total = sum(weights)
    exact = [n * w / total for w in weights]
    counts = [int(e) for e in exact]
    order = sorted(range(parts), key=lambda r: (-(exact[r] - counts[r]), r))
    for r in order[: n - sum(counts)]:
        counts[r] += 1
    while n >= parts and 0 in counts:
        # Everyone gets a sample where there are enough (a member with a share of 0 would
        # never be measured again): from the largest share, ties to the lowest rank.
        counts[counts.index(max(counts))] -= 1
        counts[counts.index(0)] = 1
    return counts


def has_quorum(
    policy: str, ring: Iterable[str], last_view: Iterable[str], dead: Iterable[str]
) -> bool:
    """May a member train on ``ring``, given the view it last trained on?

    ``majority`` (default): the ring must hold more than half of the last view's members,
    not counting those in ``dead`` (the caller passes members that left gracefully, and
    members declared dead for longer than a grace period). A member cut off from the others
    (or so slow that it suspects everybody) therefore stops and waits instead of training
    alone, while a crash costs no wait as long as the survivors are a majority; lost members
    stop counting after the grace period, so a mesh can shrink down to one member. A true
    partition whose sides declare each other dead lets both sides go on after the grace
    period; when it heals, the sync keeps the side with the newest step (ties: the lowest
    ring rank), deterministically.

    ``any``: every view trains (no waiting, no protection against split brain).
    """
    if policy == "any":
        return True
    dead_set = set(dead)
    base = {m for m in last_view if m not in dead_set}
    if not base:
        return True
    return 2 * len(base & set(ring)) > len(base)
