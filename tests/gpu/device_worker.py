"""One member of the device check's multi-process phases (started by run_device_check.py).

Each worker joins a real mesh (SWIM over loopback, same-host discovery in ``--registry``),
enables its sessions' GPU path (``SyncMesh.enable_gpu``: its default on the GPU, torch's
``ProcessGroupNCCL`` per view epoch; in ``--backend tcp`` the TCP ring stands in for it, host
buffers, so the plumbing runs on a CPU machine) and runs, in order:

1. ``correct``: an allreduce per dtype on random data (never zeros); the parent checks every
   member's digest is the same and the values match the float64 sum of all inputs;
2. ``busbw``: ftmesh's path vs ``torch.distributed`` (NCCL; gloo on CPU) in this same process,
   interleaved, at each ``--sizes`` MiB;
3. ``staging``: GPU tensors through host memory over the TCP ring (the staged path);
4. ``kill``: allreduces in a loop; the parent kills the last rank with SIGKILL; survivors
   report when their collective failed and when their next one on the new view completed.

Every line it prints for the parent starts with ``DEVCHECK `` and is one JSON object.
5. ``train``: the survivors train a small model together through ``ElasticTrainer``.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ftmesh.collective import CollectiveConfig
from ftmesh.collective.backend import DeviceInfo, local_devices
from ftmesh.collective.epochs import EpochConfig
from ftmesh.collective.ops import CollectiveOp
from ftmesh.collective.session import GpuPath, SessionRing, nested_sessions
from ftmesh.errors import CollectiveError, PeerLostError
from ftmesh.membership.config import MembershipConfig
from ftmesh.mesh.blocking import SyncMesh
from ftmesh.mesh.core import MeshConfig
from ftmesh.net.node import NodeConfig

MIB = 1 << 20


def emit(event: str, **data: Any) -> None:
    sys.stdout.write("DEVCHECK " + json.dumps({"event": event, **data}) + "\n")
    sys.stdout.flush()


def mesh_config(registry: str) -> MeshConfig:
    return MeshConfig(
        node=NodeConfig(
            mesh="devcheck",
            discovery="local",
            registry_dir=registry,
            membership=MembershipConfig.preset("local"),
        ),
        collective=CollectiveConfig(io_timeout=30.0, view_timeout=5.0),
    )


class Buffers:
    """Allocation and timing on the worker's device (CUDA through torch, or host)."""

    def __init__(self, gpu: bool) -> None:
        import torch

        self.torch = torch
        self.gpu = gpu
        self.device = torch.device("cuda", 0) if gpu else torch.device("cpu")

    def random(self, seed: int, n: int, dtype: str) -> Any:
        torch = self.torch
        g = torch.Generator().manual_seed(seed)
        if dtype.startswith("int"):
            t = torch.randint(1, 100, (n,), generator=g, dtype=getattr(torch, dtype))
        else:
            t = (torch.rand(n, generator=g, dtype=torch.float64) + 0.5).to(getattr(torch, dtype))
        t = t.to(self.device)
        return t if self.gpu else t.numpy() if dtype != "bfloat16" else t

    def sync(self) -> None:
        if self.gpu:
            self.torch.cuda.synchronize()

    def host64(self, x: Any) -> np.ndarray:
        torch = self.torch
        t = x if isinstance(x, torch.Tensor) else torch.from_numpy(np.asarray(x))
        return t.detach().to("cpu", torch.float64).numpy()

    def digest(self, x: Any) -> str:
        torch = self.torch
        t = x if isinstance(x, torch.Tensor) else torch.from_numpy(np.asarray(x))
        raw = t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
        return hashlib.blake2b(raw, digest_size=8).hexdigest()


STAND_IN = {"nccl": "tcp-for-nccl"}
"""What the view's backend is called when the TCP ring stands in for NCCL (--backend tcp)."""


def backend_name(gpu: GpuPath, view: Any, stand_in: bool) -> str:
    chosen = gpu.manager.backend_of(view)
    name = chosen.value if chosen is not None else "none"
    return STAND_IN.get(name, name) if stand_in else name


def timed(fn: Any, bufs: Buffers, iters: int) -> float:
    """Median seconds of one call of ``fn`` (synchronised)."""
    times = []
    for _ in range(iters):
        bufs.sync()
        t0 = time.perf_counter()
        fn()
        bufs.sync()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


RETRYABLE = (PeerLostError, CollectiveError)


def robust(mesh: SyncMesh, world: int, fn: Any, what: str) -> Any:
    """``fn(view)`` on the full view, retried while membership still holds every member: on
    a loaded machine SWIM may suspect a member falsely (which aborts the GPU collectives of
    its views at once, as it should), and the suspect refutes."""
    deadline = time.monotonic() + 60
    while True:
        view = mesh.wait_view(min_members=world, timeout=60)
        try:
            return fn(view)
        except RETRYABLE as exc:
            emit("retry", what=what, error=f"{type(exc).__name__}: {exc}"[:200])
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def run_collectives(args: argparse.Namespace) -> None:
    gpu_mode = args.backend == "nccl"
    bufs = Buffers(gpu_mode)
    if gpu_mode:
        bufs.torch.cuda.set_device(0)
    with SyncMesh.start(mesh_config(args.registry)) as mesh:
        if gpu_mode:
            factory = None
            devices = local_devices()
            is_device = None
        else:
            from ftmesh.collective.tcp_backend import TcpFactory

            dp = mesh.mesh.data_plane

            def abort(epoch: str) -> None:
                mesh.call_sync(dp.abort_view, epoch, "", "GPU epoch aborted")

            factory = TcpFactory(SessionRing(nested_sessions(mesh.session)), abort)
            devices = DeviceInfo(1, 1)  # the TCP ring stands in for NCCL
            is_device = lambda _x: True  # noqa: E731
        cfg = EpochConfig(init_timeout=args.init_timeout, op_timeout=args.op_timeout)
        kw: dict[str, Any] = {"factory": factory, "devices": devices, "config": cfg}
        if is_device is not None:
            kw["is_device"] = is_device
        gpu = mesh.enable_gpu(**kw)
        view = mesh.wait_view(min_members=args.world, settle=1.0, timeout=60)
        rank = view.rank_of(mesh.node_id)
        emit("view", rank=rank, size=view.size, devices=devices.to_meta(), pid=os.getpid())

        # 1. correctness, one allreduce per dtype
        for dtype in args.dtypes.split(","):
            n = 1 << 16
            x = bufs.random(1000 * (rank + 1), n, dtype)
            want = sum(bufs.host64(bufs.random(1000 * (r + 1), n, dtype)) for r in range(view.size))
            t0 = time.perf_counter()
            try:
                x0 = x.clone() if hasattr(x, "clone") else x.copy()

                def once(v: Any, x: Any = x, x0: Any = x0) -> None:
                    x[...] = x0  # an aborted in-place collective may have written part of x
                    mesh.session(v).allreduce(x)
                    bufs.sync()

                robust(mesh, args.world, once, f"correct {dtype}")
                got = bufs.host64(x)
                err = float(np.max(np.abs(got - want) / np.abs(want)))
                emit(
                    "correct",
                    dtype=dtype,
                    backend=backend_name(gpu, view, not gpu_mode),
                    rel_err=err,
                    digest=bufs.digest(x),
                    seconds=time.perf_counter() - t0,
                )
            except Exception as exc:
                emit("correct", dtype=dtype, error=f"{type(exc).__name__}: {exc}"[:300])
        emit("stats", **{k: v for k, v in vars(gpu.manager.statistics()).items()})

        # 2. busbw: ftmesh vs torch.distributed in the same processes, interleaved
        import torch.distributed as dist

        backend = "nccl" if gpu_mode else "gloo"
        dist.init_process_group(
            backend,
            init_method=f"file://{args.registry}/torch-dist",
            rank=rank,
            world_size=view.size,
            timeout=datetime.timedelta(seconds=60),
        )
        for mib in [int(s) for s in args.sizes.split(",")]:
            n = mib * MIB // 4
            a = bufs.torch.ones(n, dtype=bufs.torch.float32, device=bufs.device)
            host = a if gpu_mode else a.numpy()
            res: dict[str, list[float]] = {"ftmesh": [], "torch": []}
            try:
                robust(mesh, args.world, lambda v, h=host: mesh.session(v).allreduce(h), "warm-up")
                dist.all_reduce(a)
                for _ in range(2):
                    sec = robust(
                        mesh,
                        args.world,
                        lambda v, h=host: timed(
                            lambda: mesh.session(v).allreduce(h), bufs, args.iters
                        ),
                        f"busbw {mib}",
                    )
                    res["ftmesh"].append(sec)
                    res["torch"].append(timed(lambda t=a: dist.all_reduce(t), bufs, args.iters))
                emit(
                    "busbw",
                    mib=mib,
                    ftmesh=min(res["ftmesh"]),
                    torch=min(res["torch"]),
                    size=view.size,
                    backend=backend,
                )
            except Exception as exc:
                emit("busbw", mib=mib, error=f"{type(exc).__name__}: {exc}"[:300])
        dist.destroy_process_group()

        # 3. the staged path: GPU tensors through host memory over the TCP ring
        if gpu_mode:
            n = args.staging_mib * MIB // 4
            t = bufs.torch.ones(n, dtype=bufs.torch.float32, device=bufs.device)
            try:
                staged = functools.partial(mesh.session(view).run_on_ring, CollectiveOp.allreduce())
                staged(t)
                sec = timed(lambda: staged(t), bufs, 3)
                emit("staging", mib=args.staging_mib, seconds=sec, size=view.size)
            except Exception as exc:
                emit("staging", error=f"{type(exc).__name__}: {exc}"[:300])

        # 4. kill -9 of the last rank mid-allreduce: survivors abort and rebuild. Every
        # failure is reported (the parent keeps the first after its kill); a view that comes
        # back whole was a false suspicion, and the loop goes on.
        x = bufs.random(7, args.kill_mib * MIB // 4, "float32")
        emit("kill-ready", rank=rank)
        end = time.monotonic() + args.kill_wait
        lost = False
        while time.monotonic() < end and not lost:
            try:
                mesh.session(view).allreduce(x)
                bufs.sync()
                continue
            except RETRYABLE as exc:
                emit("loop-error", t=time.monotonic(), error=type(exc).__name__, msg=str(exc)[:200])
            settle = time.monotonic() + 5
            while time.monotonic() < settle:
                current = mesh.view()
                if current is not None and current.size < view.size:
                    lost = True
                    break
                if current is not None and current.epoch == view.epoch:
                    break  # whole again: a false suspicion, refuted
                time.sleep(0.002)
        if not lost:
            emit("kill-recovered", error="the view never lost a member")
            return
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            new = mesh.wait_view(min_members=1, timeout=10)
            if new.size != view.size - 1:
                time.sleep(0.002)
                continue
            try:
                mesh.session(new).allreduce(x)
                bufs.sync()
                emit(
                    "kill-recovered",
                    t=time.monotonic(),
                    size=new.size,
                    backend=backend_name(gpu, new, not gpu_mode),
                )
                break
            except RETRYABLE as exc:  # the view moved again, or a neighbour was late
                emit("kill-retry", error=f"{type(exc).__name__}: {exc}"[:200])
        else:
            emit("kill-recovered", error="no collective on the survivors' view in 30 s")
        emit("stats-after-kill", **{k: v for k, v in vars(gpu.manager.statistics()).items()})
        if args.steps:
            train(mesh, args, view.size - 1)  # 5. the survivors train a model together
        done = Path(args.registry) / "done"
        end = time.monotonic() + 60
        while not done.exists() and time.monotonic() < end:  # the others may still recover
            time.sleep(0.05)


def train(mesh: SyncMesh, args: argparse.Namespace, world: int) -> None:
    """A small model trained elastically through ElasticTrainer by the ``world`` members
    left (on CUDA with --backend nccl; gradients go through the mesh's own path)."""
    import torch
    from torch import nn

    from ftmesh.torch import ElasticSampler, ElasticTrainer

    device = torch.device("cuda", 0) if args.backend == "nccl" else torch.device("cpu")
    torch.manual_seed(0)
    x = torch.randn(2048, 16)
    y = (x @ torch.randn(16, 1)).squeeze(1)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sampler = ElasticSampler(len(x), 64, seed=0)

    def loss_fn(idx: np.ndarray) -> torch.Tensor:
        i = torch.from_numpy(idx)
        return nn.functional.mse_loss(model(x[i].to(device)).squeeze(1), y[i].to(device))

    def full_loss() -> float:
        with torch.no_grad():
            return float(loss_fn(np.arange(len(x))))

    try:
        first = full_loss()
        mesh.wait_view(min_members=world, settle=0.5, timeout=60)
        trainer = ElasticTrainer(mesh, model, opt, sampler)
        while trainer.committed < args.steps:
            trainer.step(loss_fn)
        trainer.finish()
        emit(
            "trained",
            steps=trainer.committed,
            first=first,
            last=full_loss(),
            digest=trainer.digest(),
            device=str(next(model.parameters()).device),
        )
    except Exception as exc:
        emit("trained", error=f"{type(exc).__name__}: {exc}"[:300])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--backend", choices=["nccl", "tcp"], default="nccl")
    p.add_argument("--registry", required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--dtypes", default="float32,bfloat16,float16,int32")
    p.add_argument("--sizes", default="64,256")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--staging-mib", type=int, default=64)
    p.add_argument("--kill-mib", type=int, default=16)
    p.add_argument("--kill-wait", type=float, default=60.0)
    p.add_argument("--init-timeout", type=float, default=30.0)
    p.add_argument("--op-timeout", type=float, default=20.0)
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()
    try:
        run_collectives(args)
    except Exception as exc:
        emit("fatal", error=f"{type(exc).__name__}: {exc}"[:500])
        raise


if __name__ == "__main__":
    main()
