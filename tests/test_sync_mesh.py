"""``SyncMesh`` collectives on a given view: once the view's ring is open they run in the
caller's thread (or the job thread) without going through trio, and a view change still ends
them at once.

Real meshes in one process, each with its own trio thread: SWIM over loopback UDP with the
``local`` preset, same-host discovery in a per-test registry, real data-plane sockets."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tests_support import local_mesh_config

from ftmesh.collective import RingView, ViewSupersededError
from ftmesh.collective.ops import CollectiveOp
from ftmesh.mesh.blocking import SyncMesh
from ftmesh.mesh.core import MeshConfig

NO_HANG = 20.0
"""Far below io_timeout (60 s): a round that ends within it was ended by the view change."""


def config(registry: Path) -> MeshConfig:
    return local_mesh_config(registry, "sync")


@contextmanager
def meshes(n: int, registry: Path) -> Iterator[tuple[ExitStack, list[SyncMesh]]]:
    with ExitStack() as stack:
        yield stack, [stack.enter_context(SyncMesh.start(config(registry))) for _ in range(n)]


def common_view(ms: list[SyncMesh], size: int) -> RingView:
    deadline = time.monotonic() + NO_HANG
    while time.monotonic() < deadline:
        views = [m.view() for m in ms]
        if len({v.epoch if v else "" for v in views}) == 1 and views[0] and views[0].size == size:
            return views[0]
        time.sleep(0.05)
    raise AssertionError(f"no common view of {size}")


def in_threads(ms: list[SyncMesh], fn: Callable[[SyncMesh], Any]) -> list[Any]:
    out: list[Any] = [None] * len(ms)

    def one(i: int) -> None:
        try:
            out[i] = fn(ms[i])
        except Exception as exc:
            out[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(ms))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(NO_HANG)
    assert not any(t.is_alive() for t in threads), "a collective hung"
    return out


def test_collectives_on_an_open_ring_skip_trio(tmp_path: Path) -> None:
    with meshes(3, tmp_path) as (_, ms):
        view = common_view(ms, 3)
        calls = [0] * len(ms)
        for i, m in enumerate(ms):  # count the trips to trio (to open a ring)
            orig = m.mesh.open_ring

            async def counted(*a: Any, _orig: Any = orig, _i: int = i) -> Any:
                calls[_i] += 1
                return await _orig(*a)

            m.mesh.open_ring = counted  # type: ignore[method-assign]
        first = in_threads(ms, lambda m: m.session(view).allreduce(np.ones(4)).output)
        assert all(np.array_equal(x, np.full(4, 3.0)) for x in first), first
        assert calls == [1, 1, 1]  # the first opens the ring, in trio
        assert all(m.mesh.ring_in_use(view) is not None for m in ms)

        def step(m: SyncMesh) -> list[np.ndarray]:
            rank = view.rank_of(m.node_id)
            bufs = [np.full(1000 * (k + 1), float(rank + k), np.float32) for k in range(3)]
            ring = m.session(view)
            futures = [ring.submit(CollectiveOp.allreduce(), b) for b in bufs[:2]]
            ring.allreduce(bufs[2])  # runs here, after the two submitted
            for f in futures:
                f.result(NO_HANG)
            return bufs

        for bufs in in_threads(ms, step):
            assert not isinstance(bufs, Exception), bufs
            for k, b in enumerate(bufs):
                assert np.array_equal(b, np.full(b.size, float(3 * k + 3), np.float32))
        assert calls == [1, 1, 1]  # none of the later ones did


def test_a_new_member_ends_a_round_running_outside_trio(tmp_path: Path) -> None:
    """Two members wait in a round (in their own threads, on the open ring) that the third
    never enters; a fourth member's arrival ends it at once with ``ViewSupersededError``."""
    with meshes(3, tmp_path) as (stack, ms):
        view = common_view(ms, 3)
        in_threads(ms, lambda m: m.session(view).barrier())
        assert all(m.mesh.ring_in_use(view) is not None for m in ms)
        out: list[Any] = []

        def waiter() -> None:
            def wait(m: SyncMesh) -> Any:
                return m.session(view).allreduce(np.ones(1 << 16, np.float32))

            out.extend(in_threads(ms[:2], wait))

        t = threading.Thread(target=waiter)
        t.start()
        time.sleep(0.5)
        assert not out
        ms.append(stack.enter_context(SyncMesh.start(config(tmp_path))))
        t.join(NO_HANG)
        assert len(out) == 2
        for exc in out:
            assert isinstance(exc, ViewSupersededError), exc
            assert exc.epoch == view.epoch
        new = common_view(ms, 4)
        sums = in_threads(ms, lambda m: m.session(new).allreduce(np.ones(10)).output)
        assert all(np.array_equal(s, np.full(10, 4.0)) for s in sums), sums


def test_an_unknown_reduction_is_refused(tmp_path: Path) -> None:
    with meshes(1, tmp_path) as (_, ms):
        view = common_view(ms, 1)
        with pytest.raises(ValueError, match="unknown reduce op"):
            ms[0].session(view).allreduce(np.ones(1), "bogus")
