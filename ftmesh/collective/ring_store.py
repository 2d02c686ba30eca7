"""A ``torch.distributed.Store`` whose values travel over the view's authenticated ring.

Theory of operation. torch's process groups (gloo, NCCL) rendezvous through a key-value
store: each rank ``set``s its address (gloo) or the unique id (NCCL) and ``get``s the others'.
torch's own ``TCPStore`` needs a server on one special node; ftmesh has none. Here the values
travel on the collectives of the view itself (``ViewCollectives``: the ring the mesh already
authenticated and agreed on), in *rounds* driven by ``StorePump.round``:

1. While every member builds its process group (in a worker thread: the constructor blocks in
   rendezvous), each member calls ``round`` repeatedly, in lockstep with the others (they are
   collectives). A round is two allgathers: each member's record length (int64), then every
   record padded to the longest. A record (msgpack) is ``[version, namespace, round, status,
   ops]``: the ``set``/``add`` calls made locally since the last round, and whether this
   member's constructor is still running, done, or failed (its deadline included).
2. Every member applies every record's ops in ring (rank) order, so the table is the same
   everywhere after each round, and ``add`` is atomic (its result is the value after the ops
   of lower ranks in the same round). ``get``/``wait`` block until a round brings the key, the
   store is closed, or their deadline passes.
3. The rounds end on the same round everywhere (every member sees the same records): when
   every member is done, or when one failed (a constructor error, a deadline, a bad record).
   A record that does not parse, names another namespace (the view epoch and the set-up id)
   or another round, or passes a cap is a failure of the round, attributed to its sender.

The torch class (``ring_store``) is made lazily so that importing this module loads no torch.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol, TypeVar

import msgpack
import numpy as np

from ..errors import FtmeshError, LocalUsageError
from .dataplane import CollectiveResult
from .view import RingView

T = TypeVar("T")

VERSION = 1
MAX_KEY_BYTES = 1024
"""Longest key (bytes, UTF-8). torch's keys are short (``<prefix>/<rank>``)."""
MAX_VALUE_BYTES = 64 << 10
"""Largest value: gloo's addresses are ~200 bytes and NCCL's unique id 128; bounds the memory
a member can make the others hold per key."""
MAX_RECORD_BYTES = 256 << 10
"""Largest record one member sends in one round; more waits for the next round."""
MAX_KEYS = 4096
"""Keys a store holds; bounds its memory (a process group of N ranks sets O(N) keys)."""
MAX_OPS = 1024
"""Ops in one record."""


class ViewCollectives(Protocol):
    """The collectives of one agreed view (the mesh's ``ViewSession`` satisfies it)."""

    @property
    def view(self) -> RingView: ...
    @property
    def node_id(self) -> str: ...
    def allreduce(self, x: T, op: str = "sum") -> CollectiveResult[T]: ...
    def allgather(self, x: T) -> CollectiveResult[T]: ...
    def broadcast(self, x: T, root: str) -> CollectiveResult[T]: ...
    def barrier(self) -> CollectiveResult[None]: ...


class RingStoreError(FtmeshError):
    """A store call could not be served: the rounds failed or ended without the key, the
    store was closed (the epoch aborted), or the call's deadline passed."""


class Status(enum.IntEnum):
    RUNNING = 0
    DONE = 1
    FAILED = 2


_SET, _ADD = 1, 2


@dataclass(frozen=True)
class RoundFailed:
    """Why the rounds ended without every member done (the same on every member)."""

    member: str
    detail: str


@dataclass(frozen=True)
class PumpStats:
    rounds: int
    keys: int
    bytes_sent: int


class StorePump:
    """The store's table and its rounds, on one member (see the module doc). ``round`` is
    called by one thread (the one building the epoch); the store calls come from others."""

    def __init__(self, ring: ViewCollectives, namespace: str, deadline: float) -> None:
        self._ring = ring
        self.namespace = namespace
        self._deadline = deadline
        """``time.monotonic()`` after which this member declares the rounds failed."""
        self._rank = ring.view.rank_of(ring.node_id)
        self._cond = threading.Condition()
        self._table: dict[str, bytes] = {}
        self._outbox: list[tuple[int, str, Any]] = []
        self._tickets: dict[int, int | None] = {}
        self._ticket_of_op: dict[int, int] = {}
        self._next_ticket = 0
        self._status = Status.RUNNING
        self._detail = ""
        self._round = 0
        self._bytes = 0
        self._sent = 0
        self.finished = False
        self.failure: RoundFailed | None = None
        self._closed: str | None = None

    # -- what torch calls (through the Store) ----------------------------------------------
    def set(self, key: str, value: bytes) -> None:
        _check_key(key)
        if len(value) > MAX_VALUE_BYTES:
            raise LocalUsageError(f"store value of {len(value)} bytes > {MAX_VALUE_BYTES}")
        with self._cond:
            self._usable()
            self._put(key, bytes(value))
            self._outbox.append((_SET, key, bytes(value)))
            self._cond.notify_all()

    def add(self, key: str, amount: int, timeout: float) -> int:
        _check_key(key)
        with self._cond:
            self._usable()
            ticket = self._next_ticket
            self._next_ticket += 1
            self._tickets[ticket] = None
            self._outbox.append((_ADD, key, (int(amount), ticket)))
            self._wait_for(lambda: self._tickets[ticket] is not None, timeout, key)
            value = self._tickets.pop(ticket)
            assert value is not None
            return value

    def get(self, key: str, timeout: float) -> bytes:
        with self._cond:
            self._wait_for(lambda: key in self._table, timeout, key)
            return self._table[key]

    def wait(self, keys: Sequence[str], timeout: float) -> None:
        with self._cond:
            self._wait_for(lambda: all(k in self._table for k in keys), timeout, ",".join(keys))

    def check(self, keys: Sequence[str]) -> bool:
        with self._cond:
            return all(k in self._table for k in keys)

    def num_keys(self) -> int:
        with self._cond:
            return len(self._table)

    def pending(self) -> int:
        """Ops waiting for the next round."""
        with self._cond:
            return len(self._outbox)

    # -- this member's side of the rounds -----------------------------------------------------
    def mark_done(self) -> None:
        with self._cond:
            if self._status is Status.RUNNING:
                self._status = Status.DONE

    def mark_failed(self, detail: str) -> None:
        with self._cond:
            if self._status is not Status.FAILED:
                self._status, self._detail = Status.FAILED, detail[:200]

    def close(self, why: str) -> None:
        """Wake every waiting call with ``RingStoreError`` (the epoch was aborted)."""
        with self._cond:
            self._closed = why
            self._cond.notify_all()

    def round(self) -> bool:
        """Run one round with the other members. True once the rounds are over (check
        ``failure``); raises the ring's errors (a member lost mid-round)."""
        if self.finished:
            return True
        if time.monotonic() > self._deadline:
            self.mark_failed("rendezvous deadline passed")
        mine = self._record()
        lengths = np.array([len(mine)], np.int64)
        lens = np.asarray(self._ring.allgather(lengths).output).reshape(-1)
        ids = self._ring.view.node_ids
        longest = int(lens.max())
        over = [i for i, n in enumerate(lens) if not 0 < n <= MAX_RECORD_BYTES]
        records: list[list[Any] | str] = []
        if over:  # every member sees the same lengths: the round fails alike everywhere
            records = [
                f"record of {int(lens[i])} bytes" if i in over else [Status.RUNNING, "", []]
                for i in range(len(ids))
            ]
        else:
            buf = np.zeros(longest, np.uint8)
            buf[: len(mine)] = np.frombuffer(mine, np.uint8)
            rows = np.asarray(self._ring.allgather(buf).output).reshape(len(ids), longest)
            records = [self._parse(rows[i, : int(lens[i])].tobytes()) for i in range(len(ids))]
        self._bytes += len(mine)
        self._round += 1
        return self._apply(ids, records)

    def statistics(self) -> PumpStats:
        with self._cond:
            return PumpStats(self._round, len(self._table), self._bytes)

    # -- internals -----------------------------------------------------------------------------
    def _record(self) -> bytes:
        with self._cond:
            ops: list[list[Any]] = []
            size = 64 + len(self.namespace)
            n = 0
            for kind, key, value in self._outbox:
                cost = len(key) + (len(value) if kind == _SET else 16) + 8
                if n >= MAX_OPS or size + cost > MAX_RECORD_BYTES:
                    break
                if kind == _SET:
                    ops.append([_SET, key, value])
                else:
                    ops.append([_ADD, key, value[0]])
                    self._ticket_of_op[len(ops) - 1] = value[1]
                size += cost
                n += 1
            self._sent = n
            status = self._status if n == len(self._outbox) else Status.RUNNING
            if self._status is Status.FAILED:
                status = Status.FAILED
            return bytes(
                msgpack.packb(
                    [VERSION, self.namespace, self._round, int(status), self._detail, ops]
                )
            )

    def _parse(self, raw: bytes) -> list[Any] | str:
        """A member's record as ``[status, detail, ops]``, or why it is refused."""
        try:
            rec = msgpack.unpackb(raw, raw=False, strict_map_key=True, max_bin_len=MAX_RECORD_BYTES)
        except Exception as exc:  # any malformed input: refused, attributed by the caller
            return f"malformed record ({type(exc).__name__})"
        if not (isinstance(rec, list) and len(rec) == 6 and rec[0] == VERSION):
            return "not a store record of this version"
        _, ns, rnd, status, detail, ops = rec
        if ns != self.namespace or rnd != self._round:
            return f"record of {ns!r} round {rnd!r}, expected {self.namespace} {self._round}"
        if status not in (0, 1, 2) or not isinstance(detail, str) or not isinstance(ops, list):
            return "bad record fields"
        if len(ops) > MAX_OPS:
            return f"{len(ops)} ops > {MAX_OPS}"
        for op in ops:
            if not (isinstance(op, list) and len(op) == 3 and isinstance(op[1], str)):
                return "bad op"
            if len(op[1].encode()) > MAX_KEY_BYTES:
                return "key over the cap"
            if op[0] == _SET and isinstance(op[2], bytes) and len(op[2]) <= MAX_VALUE_BYTES:
                continue
            if op[0] == _ADD and isinstance(op[2], int) and abs(op[2]) < 1 << 62:
                continue
            return "bad op"
        return [Status(status), detail[:200], ops]

    def _apply(self, ids: Sequence[str], records: Sequence[list[Any] | str]) -> bool:
        with self._cond:
            del self._outbox[: self._sent]
            failure: RoundFailed | None = None
            all_done = True
            for rank, (nid, rec) in enumerate(zip(ids, records, strict=True)):
                if isinstance(rec, str):
                    failure = failure or RoundFailed(nid, rec)
                    continue
                status, detail, ops = rec
                for i, (kind, key, value) in enumerate(ops):
                    if kind == _SET:
                        if not self._put(key, value):
                            failure = failure or RoundFailed(nid, f"more than {MAX_KEYS} keys")
                    else:
                        total = int(self._table.get(key, b"0") or b"0") + value
                        if not self._put(key, str(total).encode()):
                            failure = failure or RoundFailed(nid, f"more than {MAX_KEYS} keys")
                        if rank == self._rank:
                            self._tickets[self._ticket_of_op[i]] = total
                if status is Status.FAILED:
                    failure = failure or RoundFailed(nid, detail or "failed")
                all_done = all_done and status is Status.DONE
            self._ticket_of_op.clear()
            if failure is not None or all_done:
                self.finished, self.failure = True, failure
            self._cond.notify_all()
            return self.finished

    def _put(self, key: str, value: bytes) -> bool:
        if key not in self._table and len(self._table) >= MAX_KEYS:
            return False
        self._table[key] = value
        return True

    def _usable(self) -> None:
        if self._closed is not None:
            raise RingStoreError(f"store {self.namespace} closed: {self._closed}")
        if self.finished:
            raise RingStoreError(f"store {self.namespace}: the rendezvous rounds are over")

    def _wait_for(self, cond: Any, timeout: float, what: str) -> None:
        end = time.monotonic() + timeout
        while not cond():
            if self._closed is not None:
                raise RingStoreError(f"store {self.namespace} closed: {self._closed}")
            if self.finished:
                why = self.failure.detail if self.failure else "every member was done"
                raise RingStoreError(f"store {self.namespace}: {what!r} never came ({why})")
            left = end - time.monotonic()
            if left <= 0:
                raise RingStoreError(f"store {self.namespace}: {what!r} not there in {timeout}s")
            self._cond.wait(min(left, 1.0))


def _check_key(key: str) -> None:
    if len(key.encode()) > MAX_KEY_BYTES:
        raise LocalUsageError(f"store key of {len(key)} characters > {MAX_KEY_BYTES} bytes")


def _seconds(timeout: Any, default: float) -> float:
    if isinstance(timeout, timedelta):
        return timeout.total_seconds()
    return default


_STORE_CLASS: Any = None


def ring_store(pump: StorePump, timeout: float) -> Any:
    """A ``torch.distributed.Store`` on ``pump`` (``timeout``: seconds a ``get`` waits)."""
    global _STORE_CLASS
    if _STORE_CLASS is None:
        _STORE_CLASS = _make_store_class()
    return _STORE_CLASS(pump, timeout)


def _make_store_class() -> Any:
    import torch.distributed as dist

    class RingStore(dist.Store):  # type: ignore[misc,name-defined]
        """torch's Store face of a ``StorePump``."""

        def __init__(self, pump: StorePump, timeout: float) -> None:
            super().__init__()
            self.pump = pump
            self._timeout = timeout

        def set(self, key: str, value: Any) -> None:
            raw = value.encode() if isinstance(value, str) else bytes(value)
            self.pump.set(key, raw)

        def get(self, key: str) -> bytes:
            return self.pump.get(key, self._timeout)

        def add(self, key: str, amount: int) -> int:
            return self.pump.add(key, amount, self._timeout)

        def wait(self, keys: Iterable[str], timeout: Any = None) -> None:
            self.pump.wait(list(keys), _seconds(timeout, self._timeout))

        def check(self, keys: Iterable[str]) -> bool:
            return self.pump.check(list(keys))

        def num_keys(self) -> int:
            return self.pump.num_keys()

        def set_timeout(self, timeout: timedelta) -> None:
            self._timeout = timeout.total_seconds()

    return RingStore
