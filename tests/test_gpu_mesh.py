"""The GPU path of ``ViewSession`` (``SyncMesh.enable_gpu``) on real meshes in one process
(SWIM over loopback, same-host discovery, the data-plane ring as the control channel), with
the injected backend of
``gpu_fakes`` standing in for NCCL: the root's choice from every member's advertised devices
(a mixed mesh stages, and its results are right), the set-up record over the mesh's ring, and
membership -- a member leaving -- aborting a GPU collective that waits for it."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import pytest
from gpu_fakes import FakeFactory
from test_sync_mesh import common_view, in_threads
from tests_support import local_mesh_config

from ftmesh.collective.aborts import AbortKind
from ftmesh.collective.backend import Backend, DeviceInfo
from ftmesh.collective.epochs import EpochConfig
from ftmesh.collective.errors import RingPeerLostError
from ftmesh.collective.session import GpuPath
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
