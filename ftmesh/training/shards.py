"""Who holds which part of the sharded (ZeRO-1) optimizer state, agreed in the sync. Pure.

Theory of operation. With a sharded optimizer (``ElasticTrainer(shard_optimizer=True)``) the
optimizer state is one flat buffer of ``length`` elements cut into ring shards
(``ftmesh.state.sharding.ShardLayout``): each member holds its own shard and the shards of its
``replicas - 1`` left neighbours, and updates all of them every step (same inputs, same code:
the copies stay bitwise identical without moving a byte).

A member's held state is valid for one *version*: the committed step it belongs to and the
*round* that produced it (a hash of the view epoch whose gradient allreduce it applied; two
rounds of one step on different views reduce different sums). A member may hold two versions
at once: the state of its committed step and, when a step's gradients were reduced but the
parameter allgather that commits it failed, the already-updated state of the next step, which
is valid if other members did commit that step in the same round.

When the view changes, after the replicated part of the state is agreed
(``ftmesh.training.protocol``), every member contributes a fixed-size *holdings record* to one
allgather: per version, its step, round and the ``(start, stop, digest)`` of each piece it
holds. Every member then computes from the same records:

* the *target* version: the agreed step, and the round of the first member that holds a
  version of that step among those whose model is the agreed one (``candidates``: the sync's
  holders of the newest state);
* whether the valid pieces (those of the target version, from any member) still cover the whole
  buffer; a gap means every holder of some shard died (more adjacent losses than replicas), and
  all members raise ``StateLostError`` together (the trainer falls back to its checkpoint);
* for itself, for every range it must hold under the new layout, which parts it already holds
  and which pieces to fetch, and from which members (all that hold exactly that piece, so the
  transfer is striped over them).

Why (step, round) names one state: a step's round is the view it ran on; every collective
on a view needs all of its members, and a member only enters a step's gradient allreduce
after a sync in which it dropped every other pending version. So a step runs again on the same
view only when nobody committed it the first time, and what is then offered for that step is
the result of the one run that somebody did commit (or of none).

Pieces of the layout before a re-shard are kept (and offered) until the next step's gradient
allreduce completes, which proves every member finished its sync: a member whose sync failed
half-way can still fetch from one whose sync completed.

All of this needs every member to run with the same *settings* (``SharedSettings``): whether
the optimizer is sharded, ``replicas`` (the layout, the size of the holdings record) and the
checkpoint period (which steps' parameter allgather carries the optimizer state); and, in
every mode, ``max_peers``, the state-check period, the gradient compression, the recovery
policy, the layouts of
the registered state and of the gradient buckets, and the data order. Members that differ
would fail these collectives on every retry, compute different layouts or train some samples
twice. So each member writes its settings into slots of its own next to the sync vector
(``settings_slots``), in the allreduce every sync already runs, before any collective whose
shape depends on them; every member reads all of them from the same result
(``settings_problem``).
On a difference, the settings of the members holding the mesh's newest state, when they agree,
are the mesh's: members that differ from them raise ``ConfigError`` and the others wait for
them to leave; before anybody trained, or when those disagree, every member raises
``ConfigError``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..compression import COMPRESSIONS
from ..errors import ConfigError, FtmeshError, LocalUsageError, StateLostError
from .config import RECOVERIES
from .protocol import DIGEST_SLOTS, FRESH, SHARES, digest_of, digest_slots

VERSIONS = 2
"""Versions of its state a member advertises at most: committed and pending."""
_VERSION_HEAD = 3  # step, round, piece count
_PIECE_SLOTS = 2 + DIGEST_SLOTS  # start, stop, digest


@dataclass(frozen=True, slots=True)
class SharedSettings:
    """The settings that every member must share (see the module docstring). Replicated
    training (``shard_optimizer`` false) depends on neither ``replicas`` nor
    ``checkpoint_every``: they are 0 then. The others matter in every mode: ``max_peers``
    decides who computes which samples, ``check_every`` which steps carry state digests, and
    the two layouts (hashes) the shapes of the step's collectives."""

    shard_optimizer: bool
    replicas: int
    checkpoint_every: int
    """Steps between checkpoints; 0: none (no ``checkpoint_dir``, or a period <= 0)."""
    max_peers: int = 0
    check_every: int = 0
    compression: int = 0
    """The gradient compression, as its index in ``COMPRESSION_CODES``."""
    state_layout: int = 0
    """A hash of the registered state's names and kinds (``ftmesh.torch.state``)."""
    bucket_layout: int = 0
    """A hash of the gradient buckets' sizes and dtypes (the model's parameters and
    ``bucket_mb``)."""
    data_layout: int = 0
    """A hash of what decides the data order (``ElasticSampler.layout``)."""
    shares: int = 0
    """``TrainerConfig.shares`` as its index in ``SHARES`` (the header's size and the split
    depend on it)."""
    stragglers: int = 0
    """A hash of the straggler rule (who computes depends on it), 0 when off."""
    recovery: int = 0
    """``TrainerConfig.recovery`` as its index in ``RECOVERIES`` (a retry after a loss sends
    kept gradients or computes again: the header's sample count checks one or the other)."""

    @classmethod
    def of(
        cls, shard_optimizer: bool, replicas: int, checkpoint_every: int, **common: int
    ) -> SharedSettings:
        if not shard_optimizer:
            return cls(False, 0, 0, **common)
        return cls(True, replicas, max(checkpoint_every, 0), **common)


ShardSettings = SharedSettings
"""The former name (the settings once were those of sharding only)."""

_FIELDS = (
    "shard_optimizer",
    "replicas",
    "checkpoint_every",
    "max_peers",
    "check_every",
    "compression",
    "state_layout",
    "bucket_layout",
    "data_layout",
    "shares",
    "stragglers",
    "recovery",
)
_SHARD_FIELDS = ("replicas", "checkpoint_every")
_LABELS = {
    "state_layout": "registered state (names and kinds of what each member registered)",
    "bucket_layout": "gradient buckets (the model's trainable parameters, their dtypes, bucket_mb)",
    "data_layout": "data order (dataset size, global batch, seed, shuffle, drop_last)",
    "stragglers": "straggler rule (straggler_factor, straggler_steps, readmit_steps)",
}
COMPRESSION_CODES = ("none", *COMPRESSIONS)
"""``TrainerConfig.compression`` as the number its settings slot carries."""
_VALUE_NAMES = {"compression": COMPRESSION_CODES, "shares": SHARES, "recovery": RECOVERIES}
SETTINGS_SLOTS = len(_FIELDS)
"""Slots per member for its ``SharedSettings`` after the sync vector."""
LAYOUT_BITS = 62
"""Layout hashes are non-negative and below ``2**62``: they fit the int64 slots."""


def settings_slots(settings: SharedSettings, rank: int, size: int) -> np.ndarray:
    """This member's settings for the sync allreduce(max): its own slots hold them (all
    >= 0), every other slot ``FRESH`` (below any real value)."""
    v = np.full(SETTINGS_SLOTS * size, FRESH, dtype=np.int64)
    for k, name in enumerate(_FIELDS):
        v[k * size + rank] = int(getattr(settings, name))
    return v


def read_settings(reduced: np.ndarray, size: int) -> list[SharedSettings]:
    """Every rank's settings from the reduced slots."""
    out = []
    for r in range(size):
        values = [int(reduced[k * size + r]) for k in range(SETTINGS_SLOTS)]
        out.append(SharedSettings(bool(values[0]), *values[1:]))
    return out


class SettingsMismatchError(FtmeshError):
    """Some members of the view were started with other settings than the members holding the
    mesh's newest state (``odd``: their ids). Raised on the members that match: they retry
    once the odd ones, which raise ``ConfigError``, have left the view."""

    def __init__(self, msg: str, odd: Sequence[str]) -> None:
        super().__init__(msg)
        self.odd = tuple(odd)


@dataclass(frozen=True, slots=True)
class SettingsProblem:
    """What :func:`settings_problem` found: ``fatal`` (this member must stop: ``ConfigError``)
    or not (wait for the ``odd`` members to leave)."""

    message: str
    fatal: bool
    odd: tuple[str, ...] = ()


def settings_problem(
    settings: Sequence[SharedSettings],
    members: Sequence[str],
    rank: int,
    established: Sequence[int] = (),
) -> SettingsProblem | None:
    """Compare the members' settings (in rank order; ``rank`` is ours). ``established``: the
    ranks holding the mesh's newest committed state (none before anybody trained). When they
    agree, theirs are the mesh's settings: a member that differs must stop (``fatal``), one
    that matches waits for the odd ones to leave (a misconfigured joiner must not stop a
    running mesh). Otherwise every member must stop. Every member computes the same from the
    same reduced slots."""
    names = [f for f in _FIELDS if f not in _SHARD_FIELDS]
    if all(s.shard_optimizer for s in settings):  # (the others are 0 when it is off)
        names += list(_SHARD_FIELDS)
    problems = []
    for name in names:
        by_value: dict[object, list[str]] = {}
        for s, member in zip(settings, members, strict=True):
            by_value.setdefault(getattr(s, name), []).append(member)
        if len(by_value) > 1:
            groups = list(by_value.values())
            if name in _LABELS:
                who = " vs ".join(_names(ms) for ms in groups)
                problems.append(f"{_LABELS[name]}: {who}")
            else:
                shown = _VALUE_NAMES.get(name)
                who = "; ".join(
                    f"{shown[v] if shown and isinstance(v, int) else v} on {_names(ms)}"
                    for v, ms in by_value.items()
                )
                problems.append(f"{name}: {who}")
    if not problems:
        return None
    what = f"members of the mesh were started with different settings: {' | '.join(problems)}"
    reference = {settings[r] for r in established}
    if len(reference) == 1:
        (ours,) = reference
        if settings[rank] == ours:
            odd = tuple(m for s, m in zip(settings, members, strict=True) if s != ours)
            return SettingsProblem(f"{what}; waiting for {_names(odd)} to leave", False, odd)
        return SettingsProblem(
            f"{what}. This member's settings differ from those of the members holding the "
            f"mesh's newest state: restart it with theirs",
            True,
        )
    return SettingsProblem(
        f"{what}. Start every member with the same settings and registered state "
        "(checkpoint_every counts as 0 without a checkpoint_dir)",
        True,
    )


def check_settings(
    settings: Sequence[SharedSettings],
    members: Sequence[str],
    rank: int,
    established: Sequence[int] = (),
) -> None:
    """:func:`settings_problem` as exceptions: ``ConfigError`` when fatal, else
    ``SettingsMismatchError``."""
    problem = settings_problem(settings, members, rank, established)
    if problem is None:
        return
    if problem.fatal:
        raise ConfigError(problem.message)
    raise SettingsMismatchError(problem.message, problem.odd)


def _names(members: Sequence[str], at_most: int = 4) -> str:
    more = f" and {len(members) - at_most} more" if len(members) > at_most else ""
    return ", ".join(members[:at_most]) + more


def round_id(epoch: str) -> int:
    """The round id of the step that ran on view ``epoch`` (56 bits, non-negative)."""
    return int.from_bytes(hashlib.blake2b(epoch.encode(), digest_size=7).digest(), "big")


@dataclass(frozen=True, slots=True)
class Piece:
    """A contiguous range ``[start, stop)`` of the flat optimizer state, and its digest."""

    start: int
    stop: int
    digest: str


@dataclass(frozen=True, slots=True)
class Version:
    step: int
    round: int
    pieces: tuple[Piece, ...]


def on_offer(ranges: Sequence[tuple[int, int]], at_most: int) -> list[int]:
    """Which of one version's pieces (their element ranges, in the order held) a member
    offers in a sync: at most ``at_most`` (what a holdings record carries), none whose range
    lies inside another's (the pieces of one version hold the same state wherever they
    overlap), the widest first when more are left. Returns their positions, in order.

    A member re-sharded twice at one step keeps, besides the shards of the new layout, the
    pieces it offered before (``ShardedOptimizer``'s previous pieces): without this bound
    they add up (a member that trained alone after a fall-back and then took in two joiners
    one after the other offered 5 of at most 4 and stopped with ``LocalUsageError``)."""
    order = sorted(range(len(ranges)), key=lambda i: (-(ranges[i][1] - ranges[i][0]), i))
    kept: list[int] = []
    for i in order:
        a, b = ranges[i]
        if any(ranges[k][0] <= a and b <= ranges[k][1] for k in kept):
            continue
        kept.append(i)
    return sorted(kept[:at_most])


def record_size(max_pieces: int) -> int:
    return VERSIONS * (_VERSION_HEAD + _PIECE_SLOTS * max_pieces)


def holdings_record(versions: Sequence[Version], max_pieces: int) -> np.ndarray:
    """This member's contribution to the holdings allgather."""
    if len(versions) > VERSIONS:
        raise LocalUsageError(f"at most {VERSIONS} versions, got {len(versions)}")
    rec = np.full(record_size(max_pieces), FRESH, dtype=np.int64)
    width = _VERSION_HEAD + _PIECE_SLOTS * max_pieces
    for v, version in enumerate(versions):
        if len(version.pieces) > max_pieces:
            raise LocalUsageError(f"at most {max_pieces} pieces, got {len(version.pieces)}")
        base = v * width
        rec[base : base + _VERSION_HEAD] = (version.step, version.round, len(version.pieces))
        for k, piece in enumerate(version.pieces):
            at = base + _VERSION_HEAD + k * _PIECE_SLOTS
            rec[at : at + _PIECE_SLOTS] = (piece.start, piece.stop, *digest_slots(piece.digest))
    return rec


def read_holdings(gathered: np.ndarray, max_pieces: int) -> list[list[Version]]:
    """Decode the allgathered records (one row per rank) into each rank's versions. Records
    that do not parse (negative counts, ranges out of order) count as holding nothing."""
    width = _VERSION_HEAD + _PIECE_SLOTS * max_pieces
    out: list[list[Version]] = []
    for row in np.asarray(gathered, dtype=np.int64).reshape(len(gathered), -1):
        versions: list[Version] = []
        for v in range(VERSIONS):
            base = v * width
            step, rnd, count = (int(x) for x in row[base : base + _VERSION_HEAD])
            if step == FRESH or not 0 <= count <= max_pieces:
                continue
            pieces = []
            for k in range(count):
                at = base + _VERSION_HEAD + k * _PIECE_SLOTS
                start, stop = int(row[at]), int(row[at + 1])
                slots = [int(x) for x in row[at + 2 : at + _PIECE_SLOTS]]
                if 0 <= start <= stop and min(slots) >= 0:
                    pieces.append(Piece(start, stop, digest_of(slots)))
            versions.append(Version(step, rnd, tuple(pieces)))
        out.append(versions)
    return out


@dataclass(frozen=True, slots=True)
class Segment:
    """Elements ``[start, stop)`` of a range this member must hold come from ``piece``:
    its own copy (``sources`` empty) or fetched from the ranks ``sources``."""

    start: int
    stop: int
    piece: Piece
    sources: tuple[int, ...]

    @property
    def local(self) -> bool:
        return not self.sources


@dataclass(frozen=True)
class ShardSyncPlan:
    step: int
    round: int
    segments: tuple[Segment, ...]
    """Everything this member must hold under the new layout, in order."""

    def fetches(self) -> dict[Piece, tuple[int, ...]]:
        """The remote pieces to fetch (once each), with the ranks that hold them."""
        return {s.piece: s.sources for s in self.segments if not s.local}


def plan_shard_sync(
    holdings: Sequence[Sequence[Version]],
    step: int,
    candidates: Sequence[int],
    me: int,
    needed: Sequence[tuple[int, int]],
    length: int,
) -> ShardSyncPlan:
    """See the module docstring. ``candidates`` are the ranks holding the agreed model, in
    order; ``needed`` the element ranges ``me`` must hold under the new layout. Raises
    ``StateLostError`` (on every member alike) when the target version's pieces do not cover
    ``[0, length)``."""
    target = next((v for r in candidates for v in holdings[r] if v.step == step and v.pieces), None)
    if target is None:
        raise StateLostError([], f"no member holds optimizer state for step {step}")
    held: list[tuple[int, Piece]] = [
        (rank, p)
        for rank, versions in enumerate(holdings)
        for v in versions
        if (v.step, v.round) == (step, target.round)
        for p in v.pieces
        if p.stop > p.start
    ]
    gaps = _gaps([(p.start, p.stop) for _, p in held], length)
    if gaps:
        ranges = ", ".join(f"[{a}:{b})" for a, b in gaps[:8])
        raise StateLostError(
            [],
            f"no surviving member holds elements {ranges} of the sharded optimizer state of "
            f"step {step} (more adjacent members died than there are replicas)",
        )
    segments: list[Segment] = []
    for start, stop in needed:
        pos = start
        while pos < stop:
            covering = [(r, p) for r, p in held if p.start <= pos < p.stop]
            own = [p for r, p in covering if r == me]
            if own:
                piece = max(own, key=lambda p: p.stop)
                segments.append(Segment(pos, min(stop, piece.stop), piece, ()))
            else:
                # The piece reaching furthest (fewest fetches); ties spread by rank.
                far = max(p.stop for _, p in covering)
                options = sorted({p for _, p in covering if p.stop == far}, key=lambda p: p.digest)
                piece = options[me % len(options)]
                sources = tuple(sorted({r for r, p in covering if p == piece}))
                segments.append(Segment(pos, min(stop, piece.stop), piece, sources))
            pos = segments[-1].stop
    return ShardSyncPlan(step, target.round, tuple(segments))


def anyone_fetches(
    holdings: Sequence[Sequence[Version]],
    step: int,
    candidates: Sequence[int],
    needed: Sequence[Sequence[tuple[int, int]]],
    length: int,
) -> bool:
    """Whether any rank's plan (``needed[rank]``) fetches a piece: then every member waits at a
    barrier after its own fetches, so no member leaves while others still pull from it."""
    return any(
        plan_shard_sync(holdings, step, candidates, rank, ranges, length).fetches()
        for rank, ranges in enumerate(needed)
    )


def _gaps(ranges: Sequence[tuple[int, int]], length: int) -> list[tuple[int, int]]:
    gaps: list[tuple[int, int]] = []
    pos = 0
    for start, stop in sorted(ranges):
        if start > pos:
            gaps.append((pos, start))
        pos = max(pos, stop)
    if pos < length:
        gaps.append((pos, length))
    return gaps
