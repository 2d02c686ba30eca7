"""Streaming data (HF ``datasets`` streaming, WebDataset, any iterable) with a committed,
resumable position: :class:`ShardedStream`.

Theory of operation. The user splits the stream into a fixed number of logical *shards* and
gives ``open_shard(shard, offset)``: an iterator over the samples of ``shard`` from its sample
``offset`` on (0-based), the same samples in the same order on every member and at every call
(a deterministic shard). The trainer's committed state holds the stream's :class:`Position`:
the epoch, and for each shard the offset of its next sample and whether it ended (part
``"stream"``: synced, fetched by joiners, saved in checkpoints, compared in the state check).

Each attempt of a step plans from the committed position alone, so every member derives the
same plan: the live shards (not ended) are dealt to the members computing, in sorted order,
round-robin (:func:`assign`); the global batch is split among those that hold a shard
(:func:`planned_counts`: equally, or by the speed weights); each draws its count from its
shards one sample from each in turn (:class:`ShardReader`), and looks one sample past what it
took, so a shard is seen to end in the step that reads its last sample. A shard that runs dry
mid-draw is marked ended and the member goes on with its other shards; when all of them ran
dry its share is short.

How much each member took from each shard, and which shards it saw end, rides in its row of
the step's allgather of header rows (``ElasticTrainer._reduce``; :func:`stream_row`, checked
by :func:`merge_rows`: a member may only report its own shards, up to its planned count), so
every member computes the same next position (:meth:`Position.advance`) from the same rows.
That position becomes the committed one only when the step commits: a failed attempt
leaves it as it was, and the retry re-reads the same samples (from the reader's buffer when
the shard stays with the same member). A view change re-deals the shards; each resumes at its
committed offset. When the step is short (shards ended) the reduced gradients, which the
micro-batches scaled by ``1 / batch_size``, are scaled by ``batch_size / taken`` before the
update: the gradient is the mean over the samples the step has, as for any other step. A step
that took no sample at all (only empty shards were left to its holders) skips the update on
every member.

An *epoch* is one pass over every shard: it ends with the step after which every shard has
ended; the next step starts the next epoch at offset 0 of every shard (a shard is opened again).
Steps near an epoch's end may be short; no step mixes two epochs.

Exactly-once: in every epoch, every sample of every shard is trained in exactly one committed
step (its gradient is in exactly one committed update), whatever the kills, joins, retries and
adoptions, and whatever member computes it: the committed offsets advance by exactly what the
committed step's members took, on every member at once (commit-or-none), and the next step
starts where they stand. A sample read in an attempt that failed is read again by the retry.
Code that records what was trained must count a member's draw only for the attempt that
committed (a committing member's ``step.action.view`` and ``step.workers`` name it), not for
every attempt; a member that adopted the step may still have computed in that attempt (its
row went out before it failed), so its draw counts when it is among those workers
(``tests/test_stream_launch.py`` records it so).

:meth:`ShardedStream.from_iterable` adapts a plain iterable (an ``IterableDataset``): shard
``k`` of ``n`` is its samples ``k, k + n, k + 2n...``, and ``open_shard(k, offset)`` iterates
the dataset from its start and skips what comes before (slow for a long stream: it reads
``offset * n`` samples to skip them; give ``open_shard`` a seek where the stream has one,
e.g. ``ds.shard(num_shards=n, index=k).skip(offset)`` with HF ``datasets``).
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch.utils.data as tud

from ..errors import LocalUsageError
from ..training.protocol import split_share
from ..training.shards import LAYOUT_BITS

OpenShard = Callable[[int, int], Iterable[Any]]
"""``open_shard(shard, offset)``: the samples of ``shard`` from sample ``offset`` on."""

_END = object()
"""A shard has no sample at the asked offset."""


@dataclass(frozen=True, slots=True)
class Position:
    """Where the stream stands (committed with each step): the epoch, each shard's next
    offset, whether each shard ended, and the samples trained in this epoch so far."""

    epoch: int
    offsets: tuple[int, ...]
    ended: tuple[bool, ...]
    samples: int = 0

    @classmethod
    def start(cls, num_shards: int, epoch: int = 0) -> Position:
        return cls(epoch, (0,) * num_shards, (False,) * num_shards)

    @property
    def live(self) -> list[int]:
        """The shards that have not ended, in order."""
        return [s for s, e in enumerate(self.ended) if not e]

    def advance(self, taken: Sequence[int], ended: Sequence[bool]) -> Position:
        """The position after a step that took ``taken[s]`` samples of each shard and saw
        the shards of ``ended`` end; a new epoch once every shard has ended."""
        offsets = tuple(o + t for o, t in zip(self.offsets, taken, strict=True))
        done = tuple(a or b for a, b in zip(self.ended, ended, strict=True))
        samples = self.samples + int(sum(taken))
        if all(done):
            if samples == 0:
                raise LocalUsageError(
                    f"epoch {self.epoch} of the stream ended without a sample: every shard is "
                    "empty (check open_shard)"
                )
            return Position.start(len(offsets), self.epoch + 1)
        return Position(self.epoch, offsets, done, samples)

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "offsets": list(self.offsets),
            "ended": [int(e) for e in self.ended],
            "samples": self.samples,
        }

    @classmethod
    def of(cls, state: dict[str, Any]) -> Position:
        return cls(
            int(state["epoch"]),
            tuple(int(o) for o in state["offsets"]),
            tuple(bool(e) for e in state["ended"]),
            int(state["samples"]),
        )


def assign(position: Position, workers: Sequence[str]) -> dict[str, list[int]]:
    """Which live shards each of ``workers`` (any order) reads in a step: dealt round-robin
    in shard order to the workers in sorted order; a worker beyond the live shards gets none
    (absent from the result)."""
    ordered = sorted(workers)
    out: dict[str, list[int]] = {}
    for i, shard in enumerate(position.live):
        out.setdefault(ordered[i % len(ordered)], []).append(shard)
    return out


def planned_counts(
    batch: int,
    holders: dict[str, list[int]],
    workers: Sequence[str],
    weights: Sequence[float] | None = None,
) -> dict[str, int]:
    """How many samples each shard holder draws in a step: the global ``batch`` split among
    the ``holders`` (in sorted order) equally, or by their ``weights`` (given in the sorted
    order of every one of ``workers``); 0 for the others."""
    ordered = sorted(workers)
    who = [w for w in ordered if w in holders]
    counts = {w: 0 for w in ordered}
    if not who:
        return counts
    sub = None if weights is None else [weights[ordered.index(w)] for w in who]
    if sub is not None and not sum(sub) > 0:
        sub = None
    for w, c in zip(who, split_share(batch, sub, len(who)), strict=True):
        counts[w] = c
    return counts


def stream_row(num_shards: int, taken: dict[int, int], ended: Iterable[int]) -> np.ndarray:
    """A member's stream slots in its gathered row: per shard the samples it took, then per
    shard 1 where it saw the shard end."""
    row = np.zeros(2 * num_shards, dtype=np.float64)
    for s, n in taken.items():
        row[s] = n
    for s in ended:
        row[num_shards + s] = 1
    return row


def merge_rows(
    rows: np.ndarray,
    members: Sequence[str],
    holders: dict[str, list[int]],
    counts: dict[str, int],
) -> tuple[list[int], list[bool]] | str:
    """Every member's stream slots (``rows``, one per member of the view, in ``members``
    order) checked against the plan and added up: (samples taken of each shard, ended
    flags), or what is wrong (a member reported a shard it does not hold, or more samples
    than its planned count, or values that are not counts and flags)."""
    if rows.ndim != 2 or rows.shape[0] != len(members) or rows.shape[1] % 2:
        return f"stream slots of shape {rows.shape}"
    n = rows.shape[1] // 2
    taken = [0] * n
    ended = [False] * n
    for r, m in enumerate(members):
        row = rows[r].tolist()
        mine = set(holders.get(m, ()))
        if not all(np.isfinite(v) and v == int(v) and v >= 0 for v in row):
            return f"{m}: stream slots are not counts"
        if any(row[n + s] not in (0, 1) for s in range(n)):
            return f"{m}: stream end flags are not 0 or 1"
        others = [s for s in range(n) if (row[s] or row[n + s]) and s not in mine]
        if others:
            return f"{m}: reports shards {others[:8]} it does not hold"
        if sum(row[:n]) > counts.get(m, 0):
            return f"{m}: took {sum(row[:n]):.0f} samples, planned {counts.get(m, 0)}"
        for s in mine:
            taken[s] += int(row[s])
            ended[s] = ended[s] or bool(row[n + s])
    return taken, ended


@dataclass
class _Cursor:
    """One shard's open iterator, and the samples read from it not yet committed."""

    start: int
    it: Iterator[Any]
    buf: list[Any] = field(default_factory=list)
    end: int | None = None
    """The offset where the shard ended (once seen)."""


class ShardReader:
    """This member's open shards: the sample at any offset, served from what was read since
    the committed offset (a retry re-reads it without opening the shard again), else from
    the open iterator, else from ``open_shard`` opened anew. One per trainer."""

    def __init__(self, open_shard: OpenShard) -> None:
        self._open = open_shard
        self._cursors: dict[int, _Cursor] = {}
        self._epoch = 0
        self.opened = 0
        """Times a shard was opened (at offset 0 or further)."""

    def get(self, shard: int, offset: int) -> Any:
        """The sample at ``offset`` of ``shard`` (``_END`` past its end)."""
        c = self._cursors.get(shard)
        if c is None or not c.start <= offset <= c.start + len(c.buf):
            c = self._cursors[shard] = _Cursor(offset, iter(self._open(shard, offset)))
            self.opened += 1
        while offset >= c.start + len(c.buf):
            if c.end is not None:
                return _END
            try:
                c.buf.append(next(c.it))
            except StopIteration:
                c.end = c.start + len(c.buf)
                return _END
        return c.buf[offset - c.start]

    def settle(self, position: Position, mine: Iterable[int]) -> None:
        """The committed position moved: drop what lies before it, and the shards not ours."""
        keep = set(mine)
        if position.epoch != self._epoch:
            self._cursors.clear()
            self._epoch = position.epoch
        for shard in list(self._cursors):
            c = self._cursors[shard]
            if shard not in keep or position.ended[shard]:
                del self._cursors[shard]
                continue
            cut = position.offsets[shard] - c.start
            if 0 < cut <= len(c.buf):
                del c.buf[:cut]
                c.start += cut

    def draw(
        self, position: Position, shards: Sequence[int], count: int
    ) -> tuple[list[Any], dict[int, int], set[int]]:
        """Up to ``count`` samples from ``shards`` at their committed offsets, one from each
        in turn: (the samples, how many of each shard, the shards seen to end)."""
        if position.epoch != self._epoch:
            self._cursors.clear()
            self._epoch = position.epoch
        taken = dict.fromkeys(shards, 0)
        ended: set[int] = set()
        samples: list[Any] = []
        active = list(shards)
        while len(samples) < count and active:
            for s in list(active):
                if len(samples) >= count:
                    break
                item = self.get(s, position.offsets[s] + taken[s])
                if item is _END:
                    active.remove(s)
                    ended.add(s)
                    continue
                samples.append(item)
                taken[s] += 1
        for s in active:  # one past what we took: a shard ends in the step of its last sample
            if self.get(s, position.offsets[s] + taken[s]) is _END:
                ended.add(s)
        return samples, {s: n for s, n in taken.items() if n}, ended


class ShardedStream:
    """A stream of samples split into ``num_shards`` deterministic shards (see the module
    docstring), trained ``batch_size`` samples per step (the *global* batch, all members
    together); ``collate_fn`` makes a micro-batch of a list of samples (``torch``'s
    ``default_collate`` when not given). Give it to ``ElasticTrainer`` as ``data``, then
    iterate ``step.batches()``.

    ``open_shard(shard, offset)`` returns an iterable over the samples of ``shard`` from its
    sample ``offset`` on (0-based); it must give the same samples in the same order on every
    member and every time it is called, and may be called again for any shard at any offset
    (after a view change, a retry on another member, a join, a checkpoint resume). Use at
    least as many shards as members computing, many more for an even load near an epoch's
    end."""

    def __init__(
        self,
        num_shards: int,
        open_shard: OpenShard,
        batch_size: int,
        *,
        collate_fn: Callable[[list[Any]], Any] | None = None,
    ) -> None:
        if num_shards < 1 or batch_size < 1:
            raise LocalUsageError(
                f"need num_shards >= 1 and batch_size >= 1, got {num_shards} and {batch_size}"
            )
        if not callable(open_shard):
            raise LocalUsageError("open_shard must be callable as open_shard(shard, offset)")
        self.num_shards = num_shards
        self.open_shard = open_shard
        self.batch_size = batch_size
        self.collate_fn: Callable[[list[Any]], Any] = collate_fn or tud.default_collate

    @classmethod
    def from_iterable(
        cls,
        dataset: Iterable[Any],
        num_shards: int,
        batch_size: int,
        *,
        collate_fn: Callable[[list[Any]], Any] | None = None,
    ) -> ShardedStream:
        """A plain iterable (an ``IterableDataset``) as ``num_shards`` shards: shard ``k`` is
        its samples ``k, k + num_shards...``. Opening a shard at ``offset`` iterates the
        dataset from its start and skips ``offset * num_shards`` samples: slow for long
        streams; ``iter(dataset)`` must give the same samples in the same order every time."""

        def open_shard(shard: int, offset: int) -> Iterator[Any]:
            start = shard + offset * num_shards
            return itertools.islice(iter(dataset), start, None, num_shards)

        return cls(num_shards, open_shard, batch_size, collate_fn=collate_fn)

    @property
    def layout(self) -> int:
        """A hash of what decides the data order (every member must have the same)."""
        text = f"stream,{self.num_shards},{self.batch_size}"
        digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big") >> (64 - LAYOUT_BITS)


class StreamState:
    """The stream's committed position, registered with the trainer's state as ``"stream"``
    (``state_dict()`` / ``load_state_dict()``; captured at the end of every step, after the
    trainer moved it: :meth:`StreamFeed.commit`)."""

    def __init__(self, num_shards: int) -> None:
        self.position = Position.start(num_shards)

    def state_dict(self) -> dict[str, Any]:
        return self.position.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pos = Position.of(state)
        if len(pos.offsets) != len(self.position.offsets):
            raise LocalUsageError(
                f"the stream's saved position has {len(pos.offsets)} shards, this stream "
                f"{len(self.position.offsets)}"
            )
        self.position = pos


@dataclass(frozen=True, slots=True)
class StreamAttempt:
    """What this member drew for one attempt of a step: the plan every member derives, and
    this member's samples in micro-batches."""

    key: tuple[int, tuple[str, ...], tuple[float, ...] | None]
    position: Position
    holders: dict[str, list[int]]
    counts: dict[str, int]
    samples: list[Any]
    micro: list[np.ndarray]
    taken: dict[int, int]
    ended: frozenset[int]


class StreamFeed:
    """The trainer's side of a :class:`ShardedStream`: the committed position (:attr:`state`),
    this member's reader, the current attempt's draw, and the next position once the
    attempt's rows are gathered (made committed by :meth:`commit`)."""

    def __init__(self, stream: ShardedStream) -> None:
        self.stream = stream
        self.state = StreamState(stream.num_shards)
        self.reader = ShardReader(stream.open_shard)
        self.attempt: StreamAttempt | None = None
        self.next: Position | None = None
        """The position after the current attempt (set once its rows are gathered)."""
        self.taken = 0
        """Samples the current attempt took, all members together (once gathered)."""

    @property
    def position(self) -> Position:
        """The committed position."""
        return self.state.position

    def draw(
        self,
        index: int,
        workers: tuple[str, ...],
        weights: tuple[float, ...] | None,
        me: str,
        micro_batch: int,
        split: Callable[[np.ndarray, int], list[np.ndarray]],
    ) -> StreamAttempt:
        """This member's samples of an attempt of step ``index`` on ``workers``."""
        pos = self.position
        holders = assign(pos, workers)
        counts = planned_counts(self.stream.batch_size, holders, workers, weights)
        mine = holders.get(me, [])
        samples, taken, ended = self.reader.draw(pos, mine, counts.get(me, 0))
        micro = split(np.arange(len(samples)), micro_batch)
        self.attempt = StreamAttempt(
            (index, workers, weights),
            pos,
            holders,
            counts,
            samples,
            micro,
            taken,
            frozenset(ended),
        )
        self.next = None
        return self.attempt

    def row(self) -> np.ndarray:
        """Our stream slots for the gathered rows of the current attempt."""
        a = self.attempt
        assert a is not None
        return stream_row(self.stream.num_shards, a.taken, a.ended)

    def gathered(self, rows: np.ndarray, members: Sequence[str]) -> str:
        """Every member's stream slots of the current attempt: the next position ("") or
        what is wrong with them."""
        a = self.attempt
        assert a is not None
        merged = merge_rows(rows, members, a.holders, a.counts)
        if isinstance(merged, str):
            return merged
        taken, ended = merged
        self.taken = sum(taken)
        self.next = a.position.advance(taken, ended)
        return ""

    def commit(self, me: str) -> None:
        """The current attempt's step commits: its next position is the committed one."""
        a, nxt = self.attempt, self.next
        if a is None or nxt is None:
            return
        self.state.position = nxt
        self.attempt, self.next = None, None
        self.reader.settle(nxt, a.holders.get(me, []))

    def next_batch(self, key: tuple[int, tuple[str, ...], tuple[float, ...] | None, int]) -> Any:
        """Micro-batch ``k`` of the current attempt (``key``: step, workers, weights, k),
        collated."""
        a = self.attempt
        if a is None or a.key != key[:3]:
            raise LocalUsageError(f"no drawn stream samples for the attempt {key[:3]}")
        idx = a.micro[key[3]]
        return self.stream.collate_fn([a.samples[i] for i in idx.tolist()])


class StreamSizes:
    """The trainer's ``sampler`` face of a stream: the global batch of every step, the
    committed epoch. A stream has no fixed number of steps per epoch."""

    def __init__(self, feed: StreamFeed) -> None:
        self._feed = feed
        self.global_batch = feed.stream.batch_size

    @property
    def layout(self) -> int:
        return self._feed.stream.layout

    def batch_size(self, step: int) -> int:
        """Every step's planned global batch (a short one says so in its report's rows)."""
        return self.global_batch

    def epoch_of(self, step: int) -> int:
        """The committed position's epoch (the stream's epochs do not follow step numbers)."""
        return self._feed.position.epoch

    @property
    def steps_per_epoch(self) -> int:
        raise LocalUsageError(
            "a stream has no fixed number of steps per epoch: its epoch ends when every shard "
            "has (step.epoch, trainer.stream_position)"
        )
