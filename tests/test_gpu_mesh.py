"""The GPU path of ``ViewSession`` (``SyncMesh.enable_gpu``) on real meshes in one process
(SWIM over loopback, same-host discovery, the data-plane ring as the control channel), with
the injected backend of
``gpu_fakes`` standing in for NCCL: the root's choice from every member's advertised devices
(a mixed mesh stages, and its results are right), the set-up record over the mesh's ring, and
membership -- a member leaving -- aborting a GPU collective that waits for it. Then the
default library, torch's process group per view epoch on the ring store: ``ProcessGroupNCCL``
on a machine without it (every member falls back to staging, alike), and gloo standing in
for it while another collective is submitted during the set-up (the store rounds run inside
the session's collective: ``session.NestedSession``)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gpu_fakes import FakeFactory
from test_sync_mesh import common_view, in_threads
from tests_support import local_mesh_config

from ftmesh.collective.aborts import AbortKind
from ftmesh.collective.backend import Backend, DeviceInfo
from ftmesh.collective.epochs import EpochConfig
from ftmesh.collective.errors import RingPeerLostError
from ftmesh.collective.ops import CollectiveOp
from ftmesh.collective.session import GpuPath, nested_sessions
from ftmesh.mesh.blocking import SyncMesh

GPU = DeviceInfo(1, 23203)


def attach(m: SyncMesh, devices: DeviceInfo, factory: FakeFactory) -> GpuPath:
    return m.enable_gpu(
        factory=factory,
        devices=devices,
        config=EpochConfig(op_timeout=120.0),
        is_device=lambda x: True,  # the fake "NCCL" takes host arrays
    )


def test_backend_choice_setup_over_the_mesh_and_membership_aborts(tmp_path: Path) -> None:
    with ExitStack() as stack:
        ms = [
            stack.enter_context(SyncMesh.start(local_mesh_config(tmp_path, "gpu")))
            for _ in range(3)
        ]
        factories = [FakeFactory() for _ in ms]
        gpus = [
            attach(m, GPU if i < 2 else DeviceInfo(0, 0), f)
            for i, (m, f) in enumerate(zip(ms, factories, strict=True))
        ]
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(
            sum(1 for x in m.members() if "devices" in x.meta) < 3 for m in ms
        ):
            time.sleep(0.05)
        view = common_view(ms, 3)

        # one member without a GPU: the root chooses staging, and staging is right
        xs = [np.full(100, i + 1.0, np.float32) for i in range(3)]
        results = in_threads(ms, lambda m: m.session(view).allreduce(xs[ms.index(m)]))
        assert not [r for r in results if isinstance(r, BaseException)], results
        assert all((x == 6).all() for x in xs)
        assert [g.manager.backend_of(view) for g in gpus] == [Backend.STAGING] * 3
        assert not any("create" in e for f in factories for e in f.events)

        # the GPU member without a GPU leaves: the two left set up "NCCL" over the mesh
        ms[2].close()
        pair = common_view(ms[:2], 2)
        results = in_threads(ms[:2], lambda m: m.session(pair).allreduce(np.ones(4, np.float32)))
        assert not [r for r in results if isinstance(r, BaseException)], results
        assert [g.manager.backend_of(pair) for g in gpus[:2]] == [Backend.NCCL] * 2
        assert all(f.events.count(f"create {pair.epoch}") == 1 for f in factories[:2])

        # a collective waits for a member that leaves: membership aborts it, well before
        # op_timeout (120 s)
        factories[0].op_hangs = True
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(ms[0].session(pair).allreduce, np.ones(4, np.float32))
            assert factories[0].started.wait(20)
            ms[1].close()
            with pytest.raises(RingPeerLostError) as info:
                fut.result(timeout=30)
        assert info.value.peer == pair.members[1 - pair.rank_of(ms[0].node_id)].node_id
        assert getattr(info.value.abort, "kind", None) is AbortKind.PEER_LOST
        assert gpus[0].manager.wait_aborts(10) and factories[0].groups[-1] == [pair.epoch]


def two_meshes(stack: ExitStack, tmp_path: Path, name: str) -> list[SyncMesh]:
    return [stack.enter_context(SyncMesh.start(local_mesh_config(tmp_path, name))) for _ in "ab"]


def wait_devices(ms: list[SyncMesh]) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(
        sum(1 for x in m.members() if "devices" in x.meta) < len(ms) for m in ms
    ):
        time.sleep(0.05)


def test_the_default_library_without_nccl_falls_back_to_staging_everywhere(
    tmp_path: Path,
) -> None:
    torch = pytest.importorskip("torch")
    if torch.distributed.is_nccl_available():
        pytest.skip("this torch has NCCL: tests/gpu/ covers that machine")
    with ExitStack() as stack:
        ms = two_meshes(stack, tmp_path, "default")
        cfg = EpochConfig(init_timeout=20.0, op_timeout=60.0)
        # every member claims NCCL; the default factory (torch's ProcessGroupNCCL) then fails
        # to build on this CPU torch, on each member, and the agreement stages the view
        gpus = [m.enable_gpu(devices=GPU, config=cfg, is_device=lambda x: True) for m in ms]
        wait_devices(ms)
        view = common_view(ms, 2)
        xs = [np.full(64, i + 1.0, np.float32) for i in range(2)]
        results = in_threads(ms, lambda m: m.session(view).allreduce(xs[ms.index(m)]))
        assert not [r for r in results if isinstance(r, BaseException)], results
        assert all((x == 3).all() for x in xs)
        assert [g.manager.backend_of(view) for g in gpus] == [Backend.STAGING] * 2
        assert [g.manager.statistics().fallbacks for g in gpus] == [1, 1]


@pytest.mark.leaks_ok(
    "gloo, the stand-in for NCCL here, keeps a group whose collective was aborted in flight,"
    " and its sockets, until its op timeout ends (60 s; measured: all closed by then)"
)
def test_torch_process_group_set_up_inside_a_session_collective_with_one_queued(
    tmp_path: Path,
) -> None:
    pytest.importorskip("torch")
    from ftmesh.collective.torch_pg import TorchPGFactory, make_gloo

    with ExitStack() as stack:
        ms = two_meshes(stack, tmp_path, "pg")
        in_init = [threading.Event() for _ in ms]
        queued = [threading.Event() for _ in ms]

        def gated(i: int) -> Any:
            def make(store: Any, rank: int, size: int, timeout: Any) -> Any:
                in_init[i].set()  # the set-up is running inside member i's allreduce
                assert queued[i].wait(20)  # ... and another collective is queued behind it
                return make_gloo(store, rank, size, timeout)

            return make

        cfg = EpochConfig(init_timeout=30.0, op_timeout=60.0)
        factories = [
            # the factory enable_gpu builds by default, with gloo standing in for NCCL
            TorchPGFactory(
                nested_sessions(m.session), "gloo", init_timeout=25.0, make_group=gated(i)
            )
            for i, m in enumerate(ms)
        ]
        gpus = [
            m.enable_gpu(factory=f, devices=GPU, config=cfg, is_device=lambda x: True)
            for m, f in zip(ms, factories, strict=True)
        ]
        wait_devices(ms)
        view = common_view(ms, 2)
        xs = [np.full(64, i + 1.0, np.float32) for i in range(2)]
        ys = [np.full(8, 10.0 * (i + 1), np.float32) for i in range(2)]
        later: list[Any] = [None, None]

        def queue_one(i: int) -> None:
            assert in_init[i].wait(20)
            later[i] = ms[i].session(view).submit(CollectiveOp.allreduce("sum"), ys[i])
            queued[i].set()

        helpers = [threading.Thread(target=queue_one, args=(i,)) for i in range(2)]
        for h in helpers:
            h.start()
        # run inline in this member's calling thread (not the job thread): the set-up's store
        # rounds and agreement must not queue behind the collective submitted meanwhile
        results = in_threads(ms, lambda m: m.session(view).allreduce(xs[ms.index(m)]))
        for h in helpers:
            h.join(20)
        assert not [r for r in results if isinstance(r, BaseException)], results
        assert all((x == 3).all() for x in xs)
        for fut in later:
            fut.result(timeout=20)
        assert all((y == 30).all() for y in ys)
        assert [g.manager.backend_of(view) for g in gpus] == [Backend.NCCL] * 2  # gloo's
        assert [g.manager.statistics().setups for g in gpus] == [1, 1]
