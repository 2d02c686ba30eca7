"""The ring store (``ftmesh.collective.ring_store``): rounds, caps, failures, and torch's
gloo process group built on it.

A lockstep in-memory ring (threads meeting at a barrier) drives the pure rounds
deterministically; torch's ``ProcessGroupGloo`` is then built on the store over real
in-process data planes on loopback.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from session_adapter import PlaneSession

from ftmesh.collective import CollectiveConfig, CollectiveResult, Peer, RingView, SyncDataPlane
from ftmesh.collective.ring_store import (
    MAX_RECORD_BYTES,
    MAX_VALUE_BYTES,
    VERSION,
    RingStoreError,
    StorePump,
    ring_store,
)
from ftmesh.errors import LocalUsageError


def view_of(*ids: str) -> RingView:
    return RingView.of(Peer(i, "127.0.0.1", 1000 + n) for n, i in enumerate(ids))


class LocalRing:
    """Allgather among threads of one process (one ``Member`` per thread)."""

    def __init__(self, ids: Sequence[str]) -> None:
        self.view = view_of(*ids)
        self._barrier = threading.Barrier(len(ids), timeout=10)
        self._slots: list[Any] = [None] * len(ids)
        self.tamper: Callable[[int, np.ndarray], np.ndarray] | None = None

    def member(self, nid: str) -> Member:
        return Member(self, nid)

    def gather(self, rank: int, x: np.ndarray) -> np.ndarray:
        if self.tamper is not None:
            x = self.tamper(rank, x)
        self._slots[rank] = x
        self._barrier.wait()
        out = np.stack(self._slots)
        self._barrier.wait()
        return out


class Member:
    def __init__(self, ring: LocalRing, nid: str) -> None:
        self._ring, self._nid = ring, nid

    @property
    def view(self) -> RingView:
        return self._ring.view

    @property
    def node_id(self) -> str:
        return self._nid

    def allgather(self, x: Any) -> CollectiveResult[Any]:
        out = self._ring.gather(self.view.rank_of(self._nid), x)
        return CollectiveResult(self.view.epoch, self.view.node_ids, out)

    def allreduce(self, x: Any, op: str = "sum") -> CollectiveResult[Any]:
        raise NotImplementedError

    def broadcast(self, x: Any, root: str) -> CollectiveResult[Any]:
        raise NotImplementedError

    def barrier(self) -> CollectiveResult[None]:
        raise NotImplementedError


def pumps(ring: LocalRing, deadline: float = 30.0) -> list[StorePump]:
    end = time.monotonic() + deadline
    return [StorePump(ring.member(n), "ep/1", end) for n in ring.view.node_ids]


def rounds(ps: Sequence[StorePump], limit: int = 50) -> list[int]:
    """Run rounds on every pump (one thread each) until they end; rounds each one ran."""

    def drive(p: StorePump) -> int:
        for n in range(1, limit + 1):
            if p.round():
                return n
        raise AssertionError("rounds did not end")

    with ThreadPoolExecutor(len(ps)) as pool:
        return [f.result(30) for f in [pool.submit(drive, p) for p in ps]]


def test_values_and_adds_reach_every_member_alike() -> None:
    ring = LocalRing(["a", "b", "c"])
    ps = pumps(ring)
    ps[0].set("k0", b"zero")
    ps[2].set("k2", b"two")
    results: list[int] = []

    def adder(p: StorePump) -> None:
        results.append(p.add("n", 5, timeout=10))

    threads = [threading.Thread(target=adder, args=(p,)) for p in ps]
    for t in threads:
        t.start()
    end = time.monotonic() + 10
    while sum(p.pending() for p in ps) < 5 and time.monotonic() < end:  # the adds are queued
        time.sleep(0.001)
    assert ps[1].check(["k0"]) is False  # only a round brings another member's value
    for p in ps:
        p.mark_done()
    n = rounds(ps)
    for t in threads:
        t.join(10)
    assert n[0] == n[1] == n[2]  # the rounds end on the same round everywhere
    assert sorted(results) == [5, 10, 15]  # atomic: one add after the other, rank order
    for p in ps:
        assert p.get("k0", 1) == b"zero" and p.get("k2", 1) == b"two" and p.get("n", 1) == b"15"
        assert p.finished and p.failure is None
    with pytest.raises(RingStoreError, match="never came"):
        ps[0].get("missing", 10)  # the rounds are over: no wait for a key that cannot come


def test_a_member_that_fails_ends_the_rounds_everywhere_named() -> None:
    ring = LocalRing(["a", "b", "c"])
    ps = pumps(ring)
    waiting: list[BaseException] = []

    def getter() -> None:
        try:
            ps[0].get("never", 30)
        except RingStoreError as exc:
            waiting.append(exc)

    t = threading.Thread(target=getter)
    t.start()
    ps[0].mark_done()
    ps[2].mark_done()
    ps[1].mark_failed("constructor raised")
    assert rounds(ps) == [1, 1, 1]
    t.join(10)
    assert len(waiting) == 1  # the waiting get was woken, not left to its deadline
    for p in ps:
        assert p.failure is not None and p.failure.member == "b"
        assert "constructor raised" in p.failure.detail


def test_deadline_is_a_failure_of_the_round_and_close_wakes_waiters() -> None:
    ring = LocalRing(["a", "b"])
    ps = pumps(ring, deadline=-1.0)  # already past
    assert rounds(ps) == [1, 1]
    assert all(p.failure is not None and "deadline" in p.failure.detail for p in ps)

    q = pumps(LocalRing(["a", "b"]))
    errs: list[BaseException] = []
    t = threading.Thread(target=lambda: errs.extend(_raises(lambda: q[0].get("x", 30))))
    t.start()
    time.sleep(0.05)
    q[0].close("epoch aborted")
    t.join(10)
    assert len(errs) == 1 and "epoch aborted" in str(errs[0])
    with pytest.raises(RingStoreError, match="not there"):
        q[1].get("x", 0.01)


def _raises(fn: Callable[[], Any]) -> list[BaseException]:
    try:
        fn()
    except BaseException as exc:
        return [exc]
    return []


def test_local_caps_are_usage_errors() -> None:
    p = pumps(LocalRing(["a"]))[0]
    with pytest.raises(LocalUsageError):
        p.set("k", b"x" * (MAX_VALUE_BYTES + 1))
    with pytest.raises(LocalUsageError):
        p.set("k" * 2000, b"x")


def _record(ns: str, rnd: int, status: int, ops: list[Any]) -> bytes:
    return bytes(msgpack.packb([VERSION, ns, rnd, status, "", ops]))


@pytest.mark.parametrize(
    "junk",
    [
        b"\xc1garbage",
        bytes(msgpack.packb({"a": 1})),
        _record("other/1", 0, 1, []),  # another epoch's record
        _record("ep/1", 7, 1, []),  # another round
        _record("ep/1", 0, 9, []),
        _record("ep/1", 0, 1, [[1, "k", "not bytes"]]),
        _record("ep/1", 0, 1, [[2, "k", 1 << 63]]),
        _record("ep/1", 0, 1, [[1, "k" * 2000, b"v"]]),
    ],
)
def test_a_bad_record_fails_the_round_attributed_to_its_sender(junk: bytes) -> None:
    ring = LocalRing(["a", "b", "c"])

    def tamper(rank: int, x: np.ndarray) -> np.ndarray:
        if rank != 1:
            return x
        if x.size == 1:  # the length round
            return np.array([len(junk)], np.int64)
        out = np.zeros_like(x)
        out[: len(junk)] = np.frombuffer(junk, np.uint8)[: x.size]
        return out

    ring.tamper = tamper
    ps = pumps(ring)
    for p in ps:
        p.mark_done()
    # pad everyone's record to at least the junk's length so it fits the gather
    ps[0].set("pad", b"p" * (len(junk) + 64))
    assert rounds(ps) == [1, 1, 1]
    for p in ps:
        assert p.failure is not None and p.failure.member == "b"


def test_an_oversized_length_fails_the_round_alike() -> None:
    ring = LocalRing(["a", "b"])
    ring.tamper = lambda r, x: np.array([MAX_RECORD_BYTES + 1], np.int64) if r == 1 else x
    ps = pumps(ring)
    assert rounds(ps) == [1, 1]
    assert all(p.failure is not None and p.failure.member == "b" for p in ps)


FAST = CollectiveConfig(
    chunk_bytes=1 << 16, io_timeout=20.0, connect_timeout=5.0, view_timeout=5.0, poll_interval=0.02
)


@contextlib.contextmanager
def tcp_members(n: int) -> Iterator[tuple[list[SyncDataPlane], RingView]]:
    dps = [SyncDataPlane.start(f"m{i}", config=FAST) for i in range(n)]
    try:
        yield dps, RingView.of(Peer(d.node_id, *d.address) for d in dps)
    finally:
        for d in dps:
            d.close()


def test_gloo_process_group_on_the_ring_store_of_real_data_planes() -> None:
    torch = pytest.importorskip("torch")
    dist = pytest.importorskip("torch.distributed")
    with tcp_members(3) as (dps, view):
        end = time.monotonic() + 20
        ps = [StorePump(PlaneSession(d, view), f"{view.epoch}/x", end) for d in dps]
        outs: list[Any] = [None] * 3

        def build(i: int) -> None:
            try:
                store = ring_store(ps[i], 20.0)
                pg = dist.ProcessGroupGloo(store, i, 3, timedelta(seconds=20))
                t = torch.arange(8, dtype=torch.float32) * (i + 1)
                pg.allreduce([t]).wait()
                outs[i] = t
                ps[i].mark_done()
            except BaseException as exc:
                ps[i].mark_failed(repr(exc))

        builders = [threading.Thread(target=build, args=(i,)) for i in range(3)]
        for b in builders:
            b.start()
        n = rounds(ps, limit=10_000)
        for b in builders:
            b.join(10)
        assert all(p.failure is None for p in ps), [p.failure for p in ps]
        assert len(set(n)) == 1
        want = torch.arange(8, dtype=torch.float32) * 6
        assert all(torch.equal(o, want) for o in outs)
        assert all(p.statistics().keys >= 3 for p in ps)  # every rank's address, everywhere


@settings(max_examples=40, deadline=None)
@given(junk=st.binary(min_size=1, max_size=3000))
def test_random_bytes_from_a_member_never_crash_a_round(junk: bytes) -> None:
    ring = LocalRing(["a", "b", "c"])

    def tamper(rank: int, x: np.ndarray) -> np.ndarray:
        if rank != 1:
            return x
        if x.size == 1:
            return np.array([len(junk)], np.int64)
        out = np.zeros_like(x)
        out[: len(junk)] = np.frombuffer(junk, np.uint8)
        return out

    ring.tamper = tamper
    ps = pumps(ring)
    for p in ps:
        p.mark_done()
    assert rounds(ps) == [1, 1, 1]
    assert all(p.failure is not None and p.failure.member == "b" for p in ps)
