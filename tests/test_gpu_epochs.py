"""The GPU epoch lifecycle (``ftmesh.collective.epochs``) without a GPU.

Two backends behind the same interfaces NCCL sits behind: an injected one that hangs or
fails where NCCL would (init never ready, a collective never done, an error code), driven
by a fake clock so the deadline paths take no time; and the real TCP ring (in-process data
planes on loopback), for the id exchange over the control channel, results, suspicion,
a peer lost mid-collective, view changes and the fallback to staging when one member
cannot set up NCCL.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
from gpu_fakes import FakeClock, FakeControl, FakeFactory
from hypothesis import given, settings
from hypothesis import strategies as st

from ftmesh.collective import CollectiveConfig, Peer, RingPeerLostError, RingView, SyncDataPlane
from ftmesh.collective.aborts import Abort, AbortKind, CommFailure
from ftmesh.collective.backend import Backend
from ftmesh.collective.epochs import (
    SETUP_BYTES,
    EpochConfig,
    EpochManager,
    GpuCall,
    Kind,
    SetupRecord,
)
from ftmesh.collective.errors import PeerStalledError, ViewSupersededError
from ftmesh.collective.session import SessionRing, nested_sessions
from ftmesh.collective.tcp_backend import TcpControl, TcpFactory
from ftmesh.errors import CollectiveError, MeshClosedError


def view_of(*ids: str) -> RingView:
    return RingView.of(Peer(i, "127.0.0.1", 1000 + n) for n, i in enumerate(ids))


def manager(
    factory: FakeFactory,
    control: FakeControl | None = None,
    clock: FakeClock | None = None,
    **kw: Any,
) -> EpochManager:
    clock = clock or FakeClock()
    return EpochManager(
        "a",
        factory,
        control or FakeControl(),
        config=EpochConfig(init_timeout=5.0, op_timeout=7.0),
        clock=clock,
        sleep=clock.sleep,
        **kw,
    )


def test_setup_then_collectives_on_one_communicator() -> None:
    f = FakeFactory()
    m = manager(f)
    v = view_of("a", "b")
    x = np.ones(4, np.float32)
    for _ in range(3):
        res = m.allreduce(v, x)
        assert res.epoch == v.epoch and res.members == ("a", "b") and res.output is x
    assert f.events.count(f"create {v.epoch}") == 1 and f.events.count("start allreduce") == 3
    st_ = m.statistics()
    assert (st_.setups, st_.nccl_views, st_.collectives, st_.fallbacks) == (1, 1, 3, 0)
    assert m.backend_of(v) is Backend.NCCL


def test_init_that_never_finishes_falls_back_to_staging_at_the_deadline() -> None:
    f, clock, staged = FakeFactory(), FakeClock(), []
    f.init_hangs = True
    m = manager(f, clock=clock, fallback=lambda view, op: staged.append(op.kind))
    v = view_of("a", "b")
    m.allreduce(v, np.ones(2, np.float32))
    assert 5.0 <= clock.now < 5.1  # waited exactly the init deadline
    assert m.wait_aborts(10)
    assert staged == [Kind.ALLREDUCE] and m.backend_of(v) is Backend.STAGING
    assert f.groups == [[v.epoch]]  # the hung init was aborted
    stats = m.statistics()
    assert stats.fallbacks == 1 and stats.aborts == {"stalled": 1}
    m.allreduce(v, np.ones(2, np.float32))  # the view stays on staging, no second set-up
    assert len(staged) == 2 and stats.setups == m.statistics().setups


def test_a_member_that_cannot_init_makes_everyone_fall_back() -> None:
    f, control = FakeFactory(), FakeControl()
    control.others_ok = False  # another member's init failed
    m = manager(f, control, fallback=lambda view, op: None)
    v = view_of("a", "b")
    m.allreduce(v, np.ones(2, np.float32))
    assert control.ok_votes == [True] and m.backend_of(v) is Backend.STAGING
    assert m.wait_aborts(10)
    assert f.groups == [[v.epoch]]  # our ready communicator was aborted, not left behind
    f2, control2 = FakeFactory(), FakeControl()
    f2.init_error = 5
    m2 = manager(f2, control2)
    with pytest.raises(CollectiveError, match="no fallback") as info:
        m2.allreduce(v, np.ones(2, np.float32))
    assert getattr(info.value.abort, "kind", None) is AbortKind.COMM_FAILED
    assert control2.ok_votes == [False]


def test_collective_deadline_aborts_and_the_next_call_rebuilds() -> None:
    f, clock = FakeFactory(), FakeClock()
    m = manager(f, clock=clock)
    v = view_of("a", "b")
    m.allreduce(v, np.ones(2, np.float32))
    f.op_hangs = True
    with pytest.raises(PeerStalledError) as info:
        m.allreduce(v, np.ones(2, np.float32))
    assert info.value.abort == Abort(
        AbortKind.STALLED, "", "a", "GPU allreduce passed its 7s deadline"
    )
    assert isinstance(info.value, RingPeerLostError)  # the trainer retries it like a loss
    assert m.wait_aborts(10)
    assert f.groups == [[v.epoch]]
    f.op_hangs = False
    m.allreduce(v, np.ones(2, np.float32))
    assert f.events.count(f"create {v.epoch}") == 2  # a fresh communicator, fresh id


def test_a_collective_waits_for_a_member_busy_between_steps_up_to_start_wait() -> None:
    """While ``b`` declares itself busy between steps (an evaluation), the collective waiting
    for it outlives ``op_timeout`` (7 s here) and completes when ``b`` comes; busy for longer
    than ``start_wait`` past it, or not busy at all, the deadline stands."""
    f, clock = FakeFactory(), FakeClock()
    busy: list[str] = []
    m = EpochManager(
        "a",
        f,
        FakeControl(),
        config=EpochConfig(init_timeout=5.0, op_timeout=7.0, start_wait=60.0),
        busy=lambda view: [n for n in busy if n in view],
        clock=clock,
        sleep=clock.sleep,
    )
    v = view_of("a", "b")
    m.allreduce(v, np.ones(2, np.float32))
    f.op_hangs, busy[:] = True, ["b"]
    start = clock.now

    def comes_back(dt: float) -> None:  # b ends its evaluation 40 s after the call began
        FakeClock.sleep(clock, dt)
        if clock.now - start >= 40.0:
            f.op_hangs = False
            busy.clear()

    m._sleep = comes_back
    m.allreduce(v, np.ones(2, np.float32))
    assert 40.0 <= clock.now - start < 41.0 and f.groups == []
    m._sleep = clock.sleep
    f.op_hangs, busy[:] = True, ["b"]
    start = clock.now
    with pytest.raises(PeerStalledError):
        m.allreduce(v, np.ones(2, np.float32))
    assert 67.0 <= clock.now - start < 68.0  # op_timeout + start_wait
    assert m.wait_aborts(10)
    f.op_hangs, busy[:] = True, []
    start = clock.now
    with pytest.raises(PeerStalledError):
        m.allreduce(v, np.ones(2, np.float32))
    assert 7.0 <= clock.now - start < 7.5


@pytest.mark.parametrize(
    ("code", "error", "kind"),
    [(6, RingPeerLostError, AbortKind.PEER_LOST), (3, CollectiveError, AbortKind.COMM_FAILED)],
)
def test_library_errors_are_typed(code: int, error: type[Exception], kind: AbortKind) -> None:
    f = FakeFactory()
    m = manager(f)
    v = view_of("a", "b")
    f.op_error = code
    with pytest.raises(error) as info:
        m.broadcast(v, np.ones(2, np.float32), root="b")
    assert isinstance(info.value.abort, Abort) and info.value.abort.kind is kind
    assert m.wait_aborts(10)
    assert f.groups == [[v.epoch]]


def test_suspicion_aborts_a_hung_collective_and_poisons_the_view() -> None:
    f = FakeFactory()
    m = EpochManager("a", f, FakeControl(), config=EpochConfig(op_timeout=120.0))
    v = view_of("a", "b", "c")
    m.allreduce(v, np.ones(2, np.float32))
    f.op_hangs, f.started = True, threading.Event()
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(m.allreduce, v, np.ones(2, np.float32))
        assert f.started.wait(10)
        m.peer_suspected("zz", "not in the view")  # ignored
        m.peer_suspected("a", "ourselves")  # ignored
        assert not fut.done()
        m.peer_suspected("c", "membership: c is suspect")
        with pytest.raises(RingPeerLostError) as info:
            fut.result(timeout=10)  # far below op_timeout: the abort ended it
    why = info.value.abort
    assert info.value.peer == "c" and isinstance(why, Abort)
    assert (why.kind, why.peer, why.origin) == (AbortKind.PEER_LOST, "c", "a")
    assert "membership: c is suspect" in why.detail
    assert m.wait_aborts(10) and m.statistics().aborts == {"lost": 1}
    creates = f.events.count(f"create {v.epoch}")
    with pytest.raises(RingPeerLostError):  # at once, no new set-up
        m.allreduce(v, np.ones(2, np.float32))
    assert f.events.count(f"create {v.epoch}") == creates
    m.clear_abort(v.epoch)  # c refuted the suspicion
    f.op_hangs = False
    m.allreduce(v, np.ones(2, np.float32))
    assert f.events.count(f"create {v.epoch}") == creates + 1


def test_view_change_aborts_the_old_communicator_before_the_new_one_exists() -> None:
    f = FakeFactory()
    m = manager(f)
    v1, v2, v3 = view_of("a", "b", "c"), view_of("a", "b"), view_of("a", "d")
    m.allreduce(v1, np.ones(2, np.float32))
    m.view_changed(v2)
    assert m.wait_aborts(10) and f.events[-1] == f"abort {[v1.epoch]}"
    with pytest.raises(ViewSupersededError):
        m.allreduce(v1, np.ones(2, np.float32))  # collectives on the view left fail...
    m.allreduce(v2, np.ones(2, np.float32))  # ...and the new one is set up
    m.allreduce(v3, np.ones(2, np.float32))  # moving on without being told also aborts first
    i_abort = f.events.index(f"abort {[v2.epoch]}")
    assert i_abort < f.events.index(f"create {v3.epoch}")
    m.close()
    assert f.groups[-1] == [v3.epoch]
    with pytest.raises(MeshClosedError):
        m.allreduce(v3, np.ones(2, np.float32))


def test_one_caller_at_a_time_and_members_only() -> None:
    f = FakeFactory()
    m = EpochManager("a", f, FakeControl(), config=EpochConfig(op_timeout=60))
    f.op_hangs = True
    v = view_of("a", "b")
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(m.allreduce, v, np.ones(1, np.float32))
        assert f.started.wait(10)
        with pytest.raises(ValueError, match="one at a time"):
            m.allreduce(v, np.ones(1, np.float32))
        m.close()
        with pytest.raises(MeshClosedError):
            fut.result(10)
    with pytest.raises(ValueError, match="not a member"):
        m.allreduce(view_of("x", "y"), np.ones(1, np.float32))


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=0, max_size=SETUP_BYTES + 4), st.integers(0, SETUP_BYTES - 1))
def test_setup_records_from_the_network_are_checked(junk: bytes, flip: int) -> None:
    epoch = view_of("a", "b").epoch
    good = SetupRecord(Backend.NCCL, 3, epoch, b"\x01" * 100).encode()
    assert SetupRecord.decode(good, epoch).uid == b"\x01" * 100
    with pytest.raises(CommFailure):
        SetupRecord.decode(good, view_of("a", "c").epoch)  # another view's record
    bad = bytearray(good)
    bad[flip] ^= 0xFF
    for raw in (junk, bytes(bad)):
        try:
            rec = SetupRecord.decode(raw, epoch)
        except CommFailure:
            continue
        assert rec.epoch == epoch and len(rec.uid) <= 128  # anything accepted is well-formed


# -- the TCP ring behind the same interfaces ------------------------------------------------------

FAST = CollectiveConfig(
    chunk_bytes=1 << 16, io_timeout=60.0, connect_timeout=5.0, view_timeout=5.0, poll_interval=0.02
)


@contextlib.contextmanager
def tcp_members(n: int) -> Iterator[tuple[list[SyncDataPlane], RingView]]:
    dps = [SyncDataPlane.start(f"m{i}", config=FAST) for i in range(n)]
    try:
        yield dps, RingView.of(Peer(d.node_id, *d.address) for d in dps)
    finally:
        for d in dps:
            d.close()


def tcp_manager(dp: SyncDataPlane, factory: Any = None, **kw: Any) -> EpochManager:
    ring = SessionRing(nested_sessions(dp.session))
    factory = factory or TcpFactory(ring, lambda ep: dp.abort_view(ep, "", "GPU epoch aborted"))
    return EpochManager(dp.node_id, factory, TcpControl(ring), **kw)


def on_each(fns: Sequence[Callable[[], Any]], timeout: float = 60) -> list[Any]:
    with ThreadPoolExecutor(len(fns)) as pool:
        futs = [pool.submit(fn) for fn in fns]
        return [f.result(timeout) for f in futs]


def test_tcp_lifecycle_id_exchange_results_suspicion_and_view_change() -> None:
    with tcp_members(3) as (dps, view):
        mgrs = [tcp_manager(d) for d in dps]
        xs = [np.full(1000, i + 1, np.float32) for i in range(3)]
        on_each([lambda i=i: mgrs[i].allreduce(view, xs[i]) for i in range(3)])
        assert all((x == 6).all() for x in xs)
        b = [np.arange(5, dtype=np.int64) * (i + 1) for i in range(3)]
        on_each([lambda i=i: mgrs[i].broadcast(view, b[i], root=dps[2].node_id) for i in range(3)])
        assert all((y == np.arange(5) * 3).all() for y in b)
        assert [m.statistics().setups for m in mgrs] == [1, 1, 1]

        # m2 freezes (never calls); membership suspects it: m0 and m1 abort at once
        stuck = ThreadPoolExecutor(2)
        futs = [stuck.submit(mgrs[i].allreduce, view, np.ones(10, np.float32)) for i in (0, 1)]
        for i in (0, 1):
            mgrs[i].peer_suspected(dps[2].node_id, "membership: m2 is suspect")
        for i, fut in enumerate(futs):
            with pytest.raises(RingPeerLostError) as info:
                fut.result(timeout=20)  # io_timeout is 60 s: the abort ended it
            # m0 was told first. m1 raises its own suspicion or m0's abort, whichever came
            # first: an abort from another member names nobody (as NCCL's ncclRemoteError).
            assert info.value.peer in ((dps[2].node_id,) if i == 0 else (dps[2].node_id, ""))
        stuck.shutdown()

        # the survivors move to the view without m2: old communicator aborted first
        small = RingView.of(p for p in view.members if p.node_id != dps[2].node_id)
        for i in (0, 1):
            mgrs[i].view_changed(small)
        ys = [np.full(7, 2.0, np.float32) for _ in range(2)]
        on_each([lambda i=i: mgrs[i].allreduce(small, ys[i]) for i in (0, 1)])
        assert all((y == 4).all() for y in ys)
        for i in (0, 1):
            assert mgrs[i].statistics().setups == 2


def test_tcp_peer_lost_mid_collective() -> None:
    with tcp_members(2) as (dps, view):
        mgrs = [tcp_manager(d) for d in dps]
        on_each([lambda i=i: mgrs[i].allreduce(view, np.ones(4, np.float32)) for i in range(2)])
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(mgrs[0].allreduce, view, np.ones(1 << 20, np.float32))
            dps[1].close()  # the peer's process goes away: its sockets close
            with pytest.raises(RingPeerLostError):
                fut.result(timeout=30)


class NoNcclFactory(TcpFactory):
    def create(self, view: RingView, node_id: str, uid: bytes) -> Any:
        raise ImportError("no NCCL binding on this member")


def test_tcp_one_member_without_nccl_sends_the_whole_view_to_staging() -> None:
    with tcp_members(3) as (dps, view):

        def staging(dp: SyncDataPlane) -> Callable[[RingView, GpuCall], None]:
            return lambda v, op: dp.session(v).allreduce(op.buffer, op.op)

        mgrs = [
            tcp_manager(
                d, NoNcclFactory(d, lambda _e: None) if i == 1 else None, fallback=staging(d)
            )
            for i, d in enumerate(dps)
        ]
        xs = [np.full(3, i, np.float32) for i in range(3)]
        on_each([lambda i=i: mgrs[i].allreduce(view, xs[i]) for i in range(3)])
        assert all((x == 3).all() for x in xs)
        assert [m.backend_of(view) for m in mgrs] == [Backend.STAGING] * 3
        assert [m.statistics().fallbacks for m in mgrs] == [1, 1, 1]


def test_tcp_agreement_needs_every_vote_and_one_token() -> None:
    with tcp_members(3) as (dps, view):
        ctl = [TcpControl(SessionRing(nested_sessions(d.session))) for d in dps]
        same = bytes(range(16))
        assert on_each([lambda i=i: ctl[i].agree(view, True, same) for i in range(3)]) == [True] * 3
        assert (
            on_each([lambda i=i: ctl[i].agree(view, i != 1, same) for i in range(3)]) == [False] * 3
        )
        other = bytes(16)
        votes = on_each(
            [lambda i=i: ctl[i].agree(view, True, other if i == 2 else same) for i in range(3)]
        )
        assert votes == [False] * 3


def test_an_abort_that_never_returns_blocks_nobody() -> None:
    """NCCL's abort has hung in the wild (NVIDIA/nccl#863): callers and membership must not
    wait for it, and no new communicator may be built beside it."""
    f = FakeFactory()
    release = threading.Event()
    plain_abort = f.abort_group

    def stuck_abort(comms: Sequence[Any]) -> None:
        release.wait(30)
        plain_abort(comms)

    f.abort_group = stuck_abort  # type: ignore[method-assign]
    m = EpochManager("a", f, FakeControl(), config=EpochConfig(op_timeout=120, abort_timeout=0.3))
    v = view_of("a", "b")
    m.allreduce(v, np.ones(1, np.float32))
    f.op_hangs, f.started = True, threading.Event()
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(m.allreduce, v, np.ones(1, np.float32))
        assert f.started.wait(10)
        m.peer_suspected("b", "membership")  # returns although the abort hangs
        with pytest.raises(RingPeerLostError):
            fut.result(timeout=10)
    creates = sum(e.startswith("create") for e in f.events)
    with pytest.raises(PeerStalledError, match="abort"):
        m.allreduce(view_of("a", "c"), np.ones(1, np.float32))  # not beside a stuck abort
    assert sum(e.startswith("create") for e in f.events) == creates
    release.set()
    assert m.wait_aborts(10)
    f.op_hangs = False
    m.allreduce(view_of("a", "c"), np.ones(1, np.float32))
    assert m.statistics().aborts["lost"] == 1
