"""torch's process group per view epoch (``ftmesh.collective.torch_pg``) behind the epoch
manager, with gloo standing in for NCCL (a test setting): in-process members on real
loopback data planes, then real processes on a real mesh with a freeze, a ``kill -9`` and a
rebuild (tests/scripts/torch_pg_worker.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from session_adapter import plane_sessions

from ftmesh.collective import CollectiveConfig, Peer, RingView, SyncDataPlane
from ftmesh.collective.epochs import EpochConfig, EpochManager, GpuCall
from ftmesh.collective.errors import PeerStalledError, RingPeerLostError
from ftmesh.collective.torch_pg import SessionControl, TorchPGFactory

torch = pytest.importorskip("torch")

FAST = CollectiveConfig(
    chunk_bytes=1 << 16, io_timeout=60.0, connect_timeout=5.0, view_timeout=5.0, poll_interval=0.02
)
ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("scripts") / "torch_pg_worker.py"


@contextlib.contextmanager
def tcp_members(n: int) -> Iterator[tuple[list[SyncDataPlane], RingView]]:
    dps = [SyncDataPlane.start(f"m{i}", config=FAST) for i in range(n)]
    try:
        yield dps, RingView.of(Peer(d.node_id, *d.address) for d in dps)
    finally:
        for d in dps:
            d.close()


def manager(
    dp: SyncDataPlane, factory: TorchPGFactory | None = None, **kw: Any
) -> tuple[EpochManager, TorchPGFactory]:
    sessions = plane_sessions(dp)
    factory = factory or TorchPGFactory(sessions, "gloo", init_timeout=20.0, op_timeout=60.0)

    def staging(view: RingView, op: GpuCall) -> None:
        sessions(view).allreduce(op.buffer, op.op)

    cfg = kw.pop("config", EpochConfig(init_timeout=30.0, op_timeout=60.0))
    m = EpochManager(dp.node_id, factory, SessionControl(sessions), fallback=staging, config=cfg)
    return m, factory


def on_each(fns: Sequence[Callable[[], Any]], timeout: float = 60) -> list[Any]:
    with ThreadPoolExecutor(len(fns)) as pool:
        futs = [pool.submit(fn) for fn in fns]
        return [f.result(timeout) for f in futs]


@pytest.mark.leaks_ok(
    "gloo, the stand-in for NCCL here, keeps a group whose collective was aborted in flight,"
    " and its sockets, until its op timeout ends (60 s; measured: all closed by then)"
)
def test_gloo_per_epoch_results_suspicion_in_flight_and_rebuild() -> None:
    with tcp_members(3) as (dps, view):
        pairs = [manager(d) for d in dps]
        mgrs = [m for m, _ in pairs]
        rng = np.random.default_rng(5)
        xs = [rng.standard_normal(10_000).astype(np.float32) for _ in range(3)]
        on_each([lambda i=i: mgrs[i].allreduce(view, xs[i]) for i in range(3)])
        assert all(x.tobytes() == xs[0].tobytes() for x in xs)  # bitwise identical
        b = [torch.arange(6, dtype=torch.int64) * (i + 1) for i in range(3)]
        on_each([lambda i=i: mgrs[i].broadcast(view, b[i], root=dps[1].node_id) for i in range(3)])
        assert all(torch.equal(t, torch.arange(6) * 2) for t in b)
        avg = [np.full(4, float(i), np.float64) for i in range(3)]
        on_each([lambda i=i: mgrs[i].allreduce(view, avg[i], "avg") for i in range(3)])
        assert all((a == 1.0).all() for a in avg)
        assert [m.statistics().setups for m in mgrs] == [1, 1, 1]

        # m2 never calls (frozen); gloo would wait for it up to its 60 s timeout: the
        # suspicion aborts the collective in flight on m0 and m1
        with ThreadPoolExecutor(2) as pool:
            futs = [pool.submit(mgrs[i].allreduce, view, np.ones(10, np.float32)) for i in (0, 1)]
            for i in (0, 1):
                mgrs[i].peer_suspected(dps[2].node_id, "membership: m2 is suspect")
            for fut in futs:
                with pytest.raises(RingPeerLostError):
                    fut.result(timeout=20)
        for i in (0, 1):
            assert mgrs[i].wait_aborts(20)
            assert pairs[i][1].aborted == [[view.epoch]]

        # the survivors move on: a new process group on the new view's store
        small = RingView.of(p for p in view.members if p.node_id != dps[2].node_id)
        for i in (0, 1):
            mgrs[i].view_changed(small)
        ys = [np.full(7, i + 1.0, np.float32) for i in range(2)]
        on_each([lambda i=i: mgrs[i].allreduce(small, ys[i]) for i in (0, 1)])
        assert all((y == 3).all() for y in ys)
        assert [mgrs[i].statistics().setups for i in (0, 1)] == [2, 2]


class HangingGroup:
    """A process group that hangs where NCCL would: its collectives never complete (after
    the first, the factory's probe)."""

    def __init__(self) -> None:
        self.calls = 0
        self.aborted = threading.Event()

    def allreduce(self, tensors: Any, opts: Any = None) -> Any:
        self.calls += 1
        return _Work(self.calls == 1)

    def abort(self) -> None:
        self.aborted.set()


class _Work:
    def __init__(self, done: bool) -> None:
        self._done = done

    def is_completed(self) -> bool:
        return self._done

    def wait(self) -> bool:
        return True

    def get_future(self) -> Any:
        fut = torch.futures.Future()
        if self._done:
            fut.set_result(None)
        return fut


def test_a_collective_that_never_completes_is_aborted_at_its_deadline() -> None:
    with tcp_members(2) as (dps, view):
        groups: list[HangingGroup] = []

        def make(store: Any, rank: int, size: int, timeout: timedelta) -> HangingGroup:
            groups.append(HangingGroup())
            return groups[-1]

        cfg = EpochConfig(init_timeout=30.0, op_timeout=1.0)
        pairs = [
            manager(d, TorchPGFactory(plane_sessions(d), "gloo", make_group=make), config=cfg)
            for d in dps
        ]
        outs = on_each(
            [lambda i=i: _raised(lambda: pairs[i][0].allreduce(view, np.ones(3))) for i in (0, 1)]
        )
        assert all(isinstance(o, PeerStalledError) for o in outs), outs
        for m, f in pairs:
            assert m.wait_aborts(20) and f.aborted == [[view.epoch]]
        assert all(g.aborted.is_set() for g in groups)  # ProcessGroup.abort() was called


def test_an_init_that_never_finishes_falls_back_to_staging_alike() -> None:
    release = threading.Event()

    def hang(store: Any, rank: int, size: int, timeout: timedelta) -> Any:
        release.wait(30)  # as NCCL's init with a peer gone (NVIDIA/nccl#289)
        raise RuntimeError("released")

    with tcp_members(2) as (dps, view):
        pairs = [
            manager(d, TorchPGFactory(plane_sessions(d), "gloo", init_timeout=0.5, make_group=hang))
            for d in dps
        ]
        xs = [np.full(5, i + 1.0, np.float32) for i in range(2)]
        try:
            on_each([lambda i=i: pairs[i][0].allreduce(view, xs[i]) for i in (0, 1)])
        finally:
            release.set()
        assert all((x == 3).all() for x in xs)  # on the staging fallback, right
        assert [m.statistics().fallbacks for m, _ in pairs] == [1, 1]


class GlooOrderGroup:
    """A process group that finishes a collective in gloo's order (torch's
    ``ProcessGroupGloo::AsyncWork::finishWorkGloo``): in a worker thread the result is put in
    place and the work's future completes (its callbacks run), and only a moment later is
    the work marked completed (``finish()``); here that moment is ``LAG``, long enough for a
    caller that polls instead of waiting to spin thousands of times."""

    LAG = 0.1

    def __init__(self) -> None:
        self.works: list[_GlooOrderWork] = []

    def allreduce(self, tensors: Any, opts: Any = None) -> _GlooOrderWork:
        self.works.append(_GlooOrderWork(tensors[0], self.LAG))
        return self.works[-1]

    def abort(self) -> None:
        pass


class _GlooOrderWork:
    def __init__(self, t: Any, lag: float) -> None:
        self.polls = 0
        self.waited = False
        self._future = torch.futures.Future()
        self._completed = threading.Event()

        def finish() -> None:
            time.sleep(0.01)  # the collective's own time: the caller pauses first
            t.mul_(2)  # the result of two members with equal inputs
            self._future.set_result([t])
            time.sleep(lag)
            self._completed.set()

        threading.Thread(target=finish, daemon=True).start()

    def get_future(self) -> Any:
        return self._future

    def is_completed(self) -> bool:
        self.polls += 1
        return self._completed.is_set()

    def wait(self, timeout: timedelta | None = None) -> bool:
        self.waited = True
        if not self._completed.wait(timeout.total_seconds() if timeout else 30):
            raise RuntimeError("Operation timed out!")
        return True


def test_a_gloo_completion_is_waited_for_not_polled() -> None:
    """Woken by the future, the manager waits (GIL released) for the work to be marked
    completed; it used to poll ``is_completed`` in a loop whose pauses the woken event ended
    at once, holding the GIL that gloo's thread needs before it marks the work completed
    (a spin of up to 5 ms per call on real gloo, ``ftmesh bench allreduce --torch-pg``)."""
    with tcp_members(2) as (dps, view):
        groups: list[GlooOrderGroup] = []

        def make(store: Any, rank: int, size: int, timeout: timedelta) -> GlooOrderGroup:
            groups.append(GlooOrderGroup())
            return groups[-1]

        pairs = [
            manager(d, TorchPGFactory(plane_sessions(d), "gloo", make_group=make)) for d in dps
        ]
        xs = [np.full(4, 3.0, np.float32) for _ in range(2)]
        on_each([lambda i=i: pairs[i][0].allreduce(view, xs[i]) for i in (0, 1)])
        assert all((x == 6).all() for x in xs)
        for g in groups:
            work = g.works[-1]  # [0] is the factory's probe
            assert len(g.works) == 2 and work.waited and work._completed.is_set()
            assert work.polls <= 4, work.polls  # the spin polled thousands of times in LAG


def _raised(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as exc:
        return exc


# -- real processes -------------------------------------------------------------------------------


def _lines(p: subprocess.Popen[str], until: str, timeout: float = 60) -> list[dict[str, Any]]:
    """Read ``p``'s JSON lines until one whose ``event`` is ``until`` (bounded)."""
    out: list[dict[str, Any]] = []
    result: list[BaseException] = []

    def read() -> None:
        assert p.stdout is not None
        for raw in p.stdout:
            if raw.startswith("{"):
                out.append(json.loads(raw))
                if out[-1]["event"] in (until, "error"):
                    return
        result.append(EOFError(f"worker exited without {until}"))

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive() or result:
        raise AssertionError(f"no {until!r} from worker in {timeout}s: {out} {result}")
    assert out[-1]["event"] == until, out
    return out


def test_three_processes_freeze_kill_and_rebuild(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(tmp_path), f"w{i}"],
            stdout=subprocess.PIPE,
            stdin=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(3)
    ]
    try:
        first = [_lines(p, "phase1") for p in procs]
        digests = [[e["sha"] for e in out if e["event"] == "step"] for out in first]
        assert len(digests[0]) == 3 and digests[0] == digests[1] == digests[2]
        victim = next(i for i, out in enumerate(first) if out[-1]["victim"])
        survivors = [i for i in range(3) if i != victim]
        os.kill(procs[victim].pid, signal.SIGSTOP)  # frozen: only membership can tell
        aborted = [_lines(procs[i], "aborted") for i in survivors]
        for out in aborted:  # the suspicion ended gloo's wait (its own timeout is 120 s)
            assert out[-1]["error"] in ("RingPeerLostError", "ViewSupersededError"), out
            assert out[-1]["seconds"] < 60, out
        os.kill(procs[victim].pid, signal.SIGKILL)
        done = [_lines(procs[i], "done") for i in survivors]
        after = [[e["sha"] for e in out if e["event"] == "step"] for out in done]
        assert len(after[0]) == 2 and after[0] == after[1]
        assert all(out[-1]["size"] == 2 and out[-1]["setups"] == 2 for out in done)
        for i in survivors:
            assert procs[i].wait(30) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)


@pytest.mark.timeout(240)
def test_the_allreduce_bench_prices_the_process_group_path() -> None:
    """``ftmesh bench allreduce --torch-pg``: gloo through the session's process-group path
    (the mesh's store, per-epoch groups) beside gloo called directly, in the same processes;
    both correct (``--check``) and the ratio reported (its speed is the bench's to print)."""
    res = subprocess.run(
        [sys.executable, "-m", "ftmesh.bench.allreduce", "--procs", "2", "--sizes", "64K",
         "--iters", "2", "--warmup", "1", "--impls", "gloo", "--torch-pg", "--check", "--json"],
        capture_output=True, text=True, timeout=200,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["torch_pg"] is True
    (cell,) = out["cells"]
    assert cell["check"] == {"gloo": True, "gloo_pg": True}
    busbw = {k: v["median"] for k, v in cell["busbw"].items()}
    assert set(busbw) == {"gloo", "gloo_pg"} and min(busbw.values()) > 0
    assert cell["pg_vs_gloo"] == pytest.approx(busbw["gloo_pg"] / busbw["gloo"])
