"""Data-plane tests with several members in one trio run (real loopback sockets).

The wide dtype x op x size matrix lives here because it is cheap in one process; the
multi-process tests (test_collective_procs.py) cover real process boundaries and kills."""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import trio

from ftmesh.collective import (
    CollectiveConfig,
    DataPlane,
    InputMismatchError,
    Peer,
    PeerStalledError,
    RingView,
    SyncDataPlane,
    ViewMismatchError,
    open_data_plane,
    wire,
)
from ftmesh.errors import CollectiveError, LocalUsageError
from ftmesh.security import MeshAuth

FAST = CollectiveConfig(chunk_bytes=4096, io_timeout=5.0, connect_timeout=2.0, view_timeout=1.0)


@asynccontextmanager
async def ring_of(
    n: int, config: CollectiveConfig = FAST, auths: list[MeshAuth] | None = None
) -> AsyncIterator[tuple[list[DataPlane], RingView]]:
    async with AsyncExitStack() as stack:
        dps = [
            await stack.enter_async_context(
                open_data_plane(f"m{i}", config=config, auth=(auths or [MeshAuth.none()] * n)[i])
            )
            for i in range(n)
        ]
        yield dps, RingView.of(Peer(d.node_id, *d.address) for d in dps)


async def on_all(dps: list[DataPlane], fn: Callable[[int, DataPlane], Awaitable[Any]]) -> list[Any]:
    """Run ``fn`` on every member concurrently; exceptions are returned, not raised."""
    out: list[Any] = [None] * len(dps)

    async def one(i: int) -> None:
        try:
            out[i] = await fn(i, dps[i])
        except Exception as exc:
            out[i] = exc

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            for i in range(len(dps)):
                nursery.start_soon(one, i)
    return out


def inputs(dtype: str, size: int, n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    if dtype.startswith("float"):
        return [rng.uniform(-1, 1, size).astype(dtype) for _ in range(n)]
    hi = 40 if dtype == "uint8" else 1000
    lo = 0 if dtype == "uint8" else -hi
    return [rng.integers(lo, hi, size).astype(dtype) for _ in range(n)]


def reference(arrs: list[np.ndarray], op: str) -> np.ndarray:
    stack = np.stack([a.astype(np.float64) for a in arrs])
    return {
        "sum": stack.sum(0),
        "avg": stack.mean(0),
        "min": stack.min(0),
        "max": stack.max(0),
    }[op]


TOL = {"float16": 2e-2, "float32": 1e-5, "float64": 1e-12}


def check(got: np.ndarray, want: np.ndarray, dtype: str, n: int) -> None:
    atol = TOL.get(dtype, 0.0) * n
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=0, atol=atol)


def digest(a: Any) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


DTYPES = ["float16", "float32", "float64", "int32", "int64", "uint8"]


@pytest.mark.parametrize("n", [2, 3, 5])
async def test_allreduce_matrix(n: int) -> None:
    sizes = [0, 1, n - 1, 7, 1021, 5003]  # 5003 float64 spans several 4 KiB chunks
    async with ring_of(n) as (dps, view):
        for dtype in DTYPES:
            for op in ("sum", "avg", "min", "max"):
                if op == "avg" and not dtype.startswith("float"):
                    continue
                for size in sizes:
                    arrs = inputs(dtype, size, n, seed=size)
                    want = reference(arrs, op)
                    res = await on_all(
                        dps, lambda i, dp, arrs=arrs, op=op: dp.allreduce(view, arrs[i], op=op)
                    )
                    for r in res:
                        assert not isinstance(r, Exception), r
                        assert r.epoch == view.epoch and r.members == view.node_ids
                    check(arrs[0], want, dtype, n)
                    assert len({digest(a) for a in arrs}) == 1, (dtype, op, size)


@pytest.mark.parametrize("n", [1, 2, 4])
async def test_reduce_scatter_allgather_broadcast_barrier(n: int) -> None:
    async with ring_of(n) as (dps, view):
        for dtype in ("float32", "int64", "float16"):
            for size in (0, 1, 3, 1031):
                arrs = inputs(dtype, size, n, seed=size + 1)
                keep = [a.copy() for a in arrs]
                want = reference(arrs, "sum")
                res = await on_all(dps, lambda i, dp, arrs=arrs: dp.reduce_scatter(view, arrs[i]))
                parts = np.array_split(want, n)
                for i, r in enumerate(res):
                    assert not isinstance(r, Exception), r
                    check(r.output, parts[i], dtype, n)
                    np.testing.assert_array_equal(arrs[i], keep[i])  # input untouched

                res = await on_all(dps, lambda i, dp, arrs=arrs: dp.allgather(view, arrs[i]))
                for r in res:
                    assert not isinstance(r, Exception), r
                    assert r.output.shape == (n, size)
                    np.testing.assert_array_equal(r.output, np.stack(arrs))

                root = view.node_ids[-1]
                res = await on_all(
                    dps, lambda i, dp, arrs=arrs, root=root: dp.broadcast(view, arrs[i], root=root)
                )
                assert not any(isinstance(r, Exception) for r in res), res
                for a in arrs:
                    np.testing.assert_array_equal(a, keep[n - 1])
        res = await on_all(dps, lambda i, dp: dp.barrier(view))
        assert all(r.epoch == view.epoch for r in res)


async def test_non_contiguous_and_multidim_numpy() -> None:
    async with ring_of(3) as (dps, view):
        bases = [np.arange(60, dtype=np.float64).reshape(6, 10) * (i + 1) for i in range(3)]
        views_ = [b[:, ::3] for b in bases]  # non-contiguous
        want = sum(v.copy() for v in views_)
        await on_all(dps, lambda i, dp: dp.allreduce(view, views_[i]))
        for b, v in zip(bases, views_, strict=True):
            np.testing.assert_array_equal(v, want)
            assert b[0, 1] in (1.0, 2.0, 3.0)  # untouched columns kept


async def test_torch_tensors_all_dtypes() -> None:
    torch = pytest.importorskip("torch")
    n = 3
    async with ring_of(n) as (dps, view):
        for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.int32, torch.uint8):
            for size in (0, 1, 1000):
                ts = [
                    (torch.arange(size) % 17 + i).to(dtype).reshape(-1, 1).repeat(1, 2)[:, 1]
                    for i in range(n)
                ]  # non-contiguous
                want = sum(t.double() for t in ts)
                await on_all(dps, lambda i, dp, ts=ts: dp.allreduce(view, ts[i]))
                for t in ts:
                    assert t.dtype == dtype
                    assert torch.allclose(
                        t.double(), want, atol=0.05 * float(want.abs().max() if size else 0) + 1e-9
                    )
                bits = {digest(t.double().numpy()) for t in ts}  # exact widening
                assert len(bits) == 1, dtype
        # avg on bfloat16, allgather returns a tensor
        ts = [torch.full((5,), float(i), dtype=torch.bfloat16) for i in range(n)]
        await on_all(dps, lambda i, dp: dp.allreduce(view, ts[i], op="avg"))
        assert all(float(t[0]) == 1.0 for t in ts)
        res = await on_all(dps, lambda i, dp: dp.allgather(view, torch.tensor([i, i])))
        assert torch.equal(res[0].output, torch.tensor([[0, 0], [1, 1], [2, 2]]))


async def test_dtype_and_shape_mismatch_raise_everywhere() -> None:
    async with ring_of(4) as (dps, view):
        arrs: list[np.ndarray] = [np.ones(100, np.float32) for _ in range(4)]
        arrs[2] = np.ones(100, np.float64)
        res = await on_all(dps, lambda i, dp: dp.allreduce(view, arrs[i]))
        assert all(isinstance(r, InputMismatchError) for r in res), res
        assert "float64" in str(res[0]) and "float32" in str(res[0])
        arrs = [np.ones(100, np.float32) for _ in range(4)]
        arrs[1] = np.ones(101, np.float32)
        res = await on_all(dps, lambda i, dp: dp.allreduce(view, arrs[i]))
        assert all(isinstance(r, InputMismatchError) for r in res), res
        # different collectives on different members
        res = await on_all(
            dps,
            lambda i, dp: dp.barrier(view) if i == 0 else dp.allreduce(view, np.ones(3)),
        )
        assert all(isinstance(r, InputMismatchError) for r in res), res
        # the ring is still usable afterwards
        arrs = [np.full(10, float(i)) for i in range(4)]
        res = await on_all(dps, lambda i, dp: dp.allreduce(view, arrs[i]))
        assert not any(isinstance(r, Exception) for r in res), res
        assert all((a == 6.0).all() for a in arrs)


async def test_view_mismatch_never_runs_a_collective() -> None:
    async with ring_of(3) as (dps, view):
        peers = view.members
        stale = RingView.of([peers[0], peers[2]])  # m2 believes m1 has gone
        views = [view, view, stale]
        arrs = [np.full(8, float(i + 1)) for i in range(3)]
        res = await on_all(dps, lambda i, dp: dp.allreduce(views[i], arrs[i]))
        assert all(isinstance(r, ViewMismatchError) for r in res), res
        for i, a in enumerate(arrs):
            np.testing.assert_array_equal(a, np.full(8, float(i + 1)))  # untouched
        assert "epoch" in str(res[2])


async def test_wrong_secret_cannot_join() -> None:
    good = MeshAuth.from_secrets([b"0123456789abcdef-good"])
    bad = MeshAuth.from_secrets([b"0123456789abcdef-bad!"])
    cfg = CollectiveConfig(io_timeout=2.0, connect_timeout=1.0, view_timeout=1.0)
    async with ring_of(2, cfg, auths=[good, bad]) as (dps, view):
        res = await on_all(dps, lambda i, dp: dp.allreduce(view, np.ones(4)))
        assert all(isinstance(r, CollectiveError) for r in res), res
        assert any("handshake" in str(r) for r in res), res
    async with ring_of(2, cfg, auths=[good, good]) as (dps, view):
        arrs = [np.ones(4), np.ones(4)]
        res = await on_all(dps, lambda i, dp: dp.allreduce(view, arrs[i]))
        assert not any(isinstance(r, Exception) for r in res), res
        assert (arrs[0] == 2).all()


async def test_usage_errors() -> None:
    async with ring_of(2) as (dps, view):
        with pytest.raises(LocalUsageError):
            await dps[0].allreduce(view, np.ones(3, np.int32), op="avg")
        with pytest.raises(LocalUsageError):
            await dps[0].allreduce(view, np.ones(3), op="prod")
        with pytest.raises(LocalUsageError):
            await dps[0].allreduce(view, np.ones(3, np.complex64))
        with pytest.raises(LocalUsageError):
            await dps[0].allreduce(RingView.of([Peer("other", "127.0.0.1", 1)]), np.ones(3))


def test_sync_facade() -> None:
    dps = [SyncDataPlane.start(f"s{i}", config=FAST) for i in range(3)]
    try:
        view = RingView.of(Peer(d.node_id, *d.address) for d in dps)
        arrs = [np.full(10_000, i, np.float32) for i in range(3)]
        errors: list[BaseException] = []

        def go(i: int) -> None:
            try:
                for _ in range(3):
                    dps[i].session(view).allreduce(arrs[i], op="max")
                dps[i].session(view).barrier()
            except BaseException as exc:  # reported below
                errors.append(exc)

        import threading

        ts = [threading.Thread(target=go, args=(i,)) for i in range(3)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(30)
        assert not errors, errors
        assert all((a == 2).all() for a in arrs)
    finally:
        for d in dps:
            d.close()


async def test_nothing_is_written_before_the_receiver_starts_the_collective() -> None:
    """m1 connects its ring but runs no collective. m0 must not write the collective into
    m1's connection: had it done so and then given the ring up, m1 could later read those
    frames as its own first collective (same sequence number and shape, data of a round long
    gone). m0 and m2 fail (stalled); then, all three present, the result is right."""
    config = replace(FAST, io_timeout=1.0, poll_interval=0.05)
    async with ring_of(3, config) as (dps, view):
        x = [np.full(1000, i + 1, dtype=np.int64) for i in range(3)]

        async def m1_only_connects(i: int, dp: DataPlane) -> Any:
            if i == 1:
                return await dp.open_ring(view)
            return await dp.allreduce(view, x[i], "sum")

        out = await on_all(dps, m1_only_connects)
        assert isinstance(out[0], PeerStalledError) and out[0].peer == "m1", out[0]
        assert isinstance(out[2], PeerStalledError) and out[2].peer == "m1", out[2]
        ring = dps[1].cached_ring(view)
        assert ring is not None and ring.recv_sock is not None
        pending = b""
        with contextlib.suppress(BlockingIOError):
            while chunk := ring.recv_sock.recv(1 << 16, socket.MSG_DONTWAIT):
                pending += chunk
        kinds = []
        while len(pending) >= wire.FRAME.size:
            kind, length = wire.FRAME.unpack_from(pending)
            kinds.append(kind)
            pending = pending[wire.FRAME.size + (0 if kind == wire.READY else length) :]
        assert wire.HEADER not in kinds and wire.DATA not in kinds, kinds
        for _ in range(3):  # the first tries may still hit the rings m0 and m2 gave up
            x = [np.full(1000, i + 1, dtype=np.int64) for i in range(3)]
            out = await on_all(dps, lambda i, dp, x=x: dp.allreduce(view, x[i], "sum"))
            if not any(isinstance(o, Exception) for o in out):
                break
        for i in range(3):
            assert not isinstance(out[i], Exception), out[i]
            np.testing.assert_array_equal(x[i], np.full(1000, 6, dtype=np.int64))


def test_a_round_interrupted_in_the_callers_thread_breaks_the_ring() -> None:
    """A collective run in the caller's thread (``SyncDataPlane``) that is interrupted
    mid-round by an exception (here from a signal handler, as KeyboardInterrupt would be)
    leaves its streams out of sync: the ring must be marked broken, not reused."""
    import signal
    import threading

    class Interrupted(Exception):
        pass

    def interrupt(_sig: int, _frame: Any) -> None:
        raise Interrupted

    dps = [SyncDataPlane.start(f"i{i}", config=FAST) for i in range(2)]
    old = signal.signal(signal.SIGUSR1, interrupt)  # (pytest-timeout owns SIGALRM)
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGUSR1))
    try:
        view = RingView.of(Peer(d.node_id, *d.address) for d in dps)
        opener = threading.Thread(target=dps[1].open_ring, args=(view,))
        opener.start()
        dps[0].open_ring(view)  # both ends connected; only we start a round
        opener.join(10)
        timer.start()
        with pytest.raises(Interrupted):
            dps[0].session(view).allreduce(np.ones(1 << 16, np.float32))
        assert dps[0].dp.whole_ring(view.epoch) is None
    finally:
        timer.cancel()
        signal.signal(signal.SIGUSR1, old)
        for d in dps:
            d.close()
