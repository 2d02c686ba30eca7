"""The device check of NCCL through torch on the ring store (issue #24): one script, one table.

On a GPU machine (``python tests/gpu/pg_check.py``; ``NCCL_MULTI_RANK_GPU_ENABLE=1`` lets
several processes share the one GPU, as ``run_device_check.py`` does) it starts ``--world``
processes, each a real mesh member on loopback, and checks:

* set-up: torch's ``ProcessGroupNCCL`` built per view epoch on the ring store by the epoch
  manager (``ftmesh.collective.torch_pg``), its time, and a correct allreduce;
* busbw of that session path vs torch's own ``ProcessGroupNCCL`` (on a ``TCPStore``) in the
  same processes, alternating, per size (goal: >= 0.95x at >= 64 MiB);
* ``kill -9`` of the last member while the others loop allreduces: the survivors' error
  (typed) and the time from the kill to their next GPU collective completed on the new view
  (goal: < 1 s).

``--dry-run`` runs the same plumbing on a CPU machine with gloo standing in for NCCL (both
for the session path and for "torch's own"), so only NCCL itself is left for the GPU.
Exit status: 0 if no row failed. ``--json PATH`` also writes the rows.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
MIB = 1 << 20


def emit(event: str, **data: Any) -> None:
    print(json.dumps({"event": event, "t": time.monotonic(), **data}), flush=True)


# -- worker ----------------------------------------------------------------------------------


def worker(a: argparse.Namespace) -> None:
    sys.path.insert(0, str(TESTS))
    import torch
    import torch.distributed as dist
    import trio
    from session_adapter import mesh_session
    from tests_support import local_mesh_config

    from ftmesh.collective.epochs import EpochConfig, EpochManager
    from ftmesh.collective.torch_pg import SessionControl, TorchPGFactory, make_gloo, make_nccl
    from ftmesh.errors import FtmeshError
    from ftmesh.mesh.blocking import SyncMesh
    from ftmesh.mesh.gpu import follow_membership

    gpu = not a.dry_run
    device = "cuda" if gpu else "cpu"
    if gpu:
        torch.cuda.set_device(0)
    with SyncMesh.start(local_mesh_config(Path(a.registry), "pg-check")) as mesh:
        view = mesh.wait_view(min_members=a.world, settle=0.5, timeout=60)
        rank = view.rank_of(mesh.node_id)

        def sessions(v: Any) -> Any:
            return mesh_session(mesh, v)

        factory = TorchPGFactory(
            sessions, "nccl" if gpu else "gloo", init_timeout=60.0, op_timeout=60.0
        )
        mgr = EpochManager(
            mesh.node_id,
            factory,
            SessionControl(sessions),
            config=EpochConfig(init_timeout=90.0, op_timeout=60.0),
        )
        inner = mesh.mesh
        mesh.call_sync(
            trio.lowlevel.spawn_system_task, follow_membership, inner.node, mgr, inner.view
        )

        def sync() -> None:
            if gpu:
                torch.cuda.synchronize()

        t0 = time.monotonic()
        x = torch.full((1024,), float(rank + 1), device=device)
        mgr.allreduce(view, x)
        sync()
        want = a.world * (a.world + 1) / 2
        emit("setup", rank=rank, seconds=time.monotonic() - t0, ok=bool((x == want).all()))

        tcp_store: Any = getattr(dist, "TCPStore")  # noqa: B009
        store = tcp_store("127.0.0.1", a.store_port, a.world, rank == 0, timeout=_td(60))
        own = (make_nccl if gpu else make_gloo)(store, rank, a.world, _td(60))
        for size in a.sizes:
            buf = torch.zeros(size // 4, device=device)
            times: dict[str, list[float]] = {"session": [], "torch": []}
            for it in range(a.iters + 2):
                for name in ("session", "torch") if it % 2 else ("torch", "session"):
                    own.barrier().wait()
                    sync()
                    s0 = time.perf_counter()
                    if name == "session":
                        mgr.allreduce(view, buf)
                    else:
                        own.allreduce([buf]).wait()
                    sync()
                    if it >= 2:
                        times[name].append(time.perf_counter() - s0)
            med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
            emit("busbw", rank=rank, bytes=size, median=med)
        own.abort()  # torch's own group is done: only the session's is left to the kill
        emit("bench_done", rank=rank, victim=rank == a.world - 1, pid=os.getpid())
        if rank == a.world - 1:
            time.sleep(120)  # killed by the parent
            return
        big = torch.ones(64 * MIB // 4, device=device)
        err = ""
        for _ in range(100_000):  # bounded: the kill comes within seconds
            try:
                mgr.allreduce(view, big)
                sync()
            except FtmeshError as exc:
                err = type(exc).__name__
                break
        t_err = time.monotonic()
        y = torch.ones(1024, device=device)
        small = view
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # until the survivors agree on the new view
            small = mesh.wait_view(min_members=1, timeout=60)
            if small.size != a.world - 1:
                time.sleep(0.01)
                continue
            mgr.view_changed(small)
            try:
                y.fill_(1.0)
                mgr.allreduce(small, y)
                sync()
                break
            except FtmeshError:  # the other survivor not on this view yet: try again
                continue
        emit(
            "after_kill",
            rank=rank,
            error=err,
            t_error=t_err,
            t_next=time.monotonic(),
            ok=bool((y == small.size).all()),
        )
        mgr.close()


def _td(seconds: float) -> Any:
    import datetime

    return datetime.timedelta(seconds=seconds)


# -- parent ----------------------------------------------------------------------------------


def run(a: argparse.Namespace) -> int:
    rows: list[dict[str, str]] = []

    def row(check: str, ok: bool | None, value: str, note: str = "") -> None:
        status = "n/a" if ok is None else ("ok" if ok else "FAIL")
        rows.append({"check": check, "status": status, "value": value, "note": note})

    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "PYTHONUNBUFFERED": "1",
        "NCCL_MULTI_RANK_GPU_ENABLE": "1",
        "OMP_NUM_THREADS": "1",
    }
    events: list[dict[str, Any]] = []
    cond = threading.Condition()
    with tempfile.TemporaryDirectory() as reg:
        port = _free_port()
        argv = [sys.executable, __file__, "--worker", "--registry", reg, "--world", str(a.world)]
        argv += ["--store-port", str(port), "--iters", str(a.iters)]
        argv += ["--sizes", ",".join(str(s // MIB) for s in a.sizes)]
        argv += ["--dry-run"] if a.dry_run else []
        procs = [
            subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env)
            for _ in range(a.world)
        ]

        def read(p: subprocess.Popen[str]) -> None:
            assert p.stdout is not None
            for line in p.stdout:
                if line.startswith("{"):
                    with cond:
                        events.append(json.loads(line))
                        cond.notify_all()

        for p in procs:
            threading.Thread(target=read, args=(p,), daemon=True).start()

        killed: set[int] = set()

        def wait_for(event: str, n: int, timeout: float) -> list[dict[str, Any]]:
            with cond:
                cond.wait_for(
                    lambda: (
                        sum(e["event"] == event for e in events) >= n
                        or any(p.poll() not in (None, 0) for p in procs if p.pid not in killed)
                    ),
                    timeout,
                )
                return [e for e in events if e["event"] == event]

        try:
            setup = wait_for("setup", a.world, a.timeout)
            ok = len(setup) == a.world and all(e["ok"] for e in setup)
            secs = max((e["seconds"] for e in setup), default=float("nan"))
            row("PG per view epoch on the ring store: set-up + allreduce", ok, f"{secs:.3f} s")
            done = wait_for("bench_done", a.world, a.timeout)
            for size in a.sizes:
                cells = [e for e in events if e["event"] == "busbw" and e["bytes"] == size]
                if len(cells) < a.world:
                    row(f"busbw {size // MIB} MiB session/torch", False, "no result")
                    continue
                ses = max(c["median"]["session"] for c in cells)
                own = max(c["median"]["torch"] for c in cells)
                bus = 2 * (a.world - 1) / a.world * size / 1e9
                ratio = own / ses
                goal = ratio >= 0.95 if size >= 64 * MIB and not a.dry_run else None
                row(
                    f"busbw {size // MIB} MiB session/torch",
                    goal,
                    f"{ratio:.3f}",
                    f"session {bus / ses:.2f} GB/s, torch {bus / own:.2f} GB/s",
                )
            victim = next((e["pid"] for e in done if e["victim"]), None)
            if victim is None or len(done) < a.world:
                row("kill -9 -> next GPU collective", False, "workers did not finish the bench")
            else:
                time.sleep(0.5)  # the survivors are looping allreduces
                t_kill = time.monotonic()
                killed.add(victim)
                os.kill(victim, signal.SIGKILL)
                after = wait_for("after_kill", a.world - 1, 60)
                if len(after) < a.world - 1:
                    row("kill -9 -> next GPU collective", False, "survivors did not finish")
                else:
                    worst = max(e["t_next"] for e in after) - t_kill
                    errs = ",".join(sorted({e["error"] for e in after}))
                    good = all(e["ok"] and e["error"] for e in after)
                    row(
                        "kill -9 -> survivors' next GPU collective",
                        good and (worst < 1.0 or a.dry_run),
                        f"{worst:.3f} s",
                        f"errors: {errs}",
                    )
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait(10)
    width = max(len(r["check"]) for r in rows) if rows else 10
    for r in rows:
        print(f"{r['check']:<{width}}  {r['status']:>4}  {r['value']:>10}  {r['note']}")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0 if all(r["status"] != "FAIL" for r in rows) else 1


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="gloo on CPU stands in for NCCL")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--sizes", default="64,256", help="MiB, comma-separated")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--timeout", type=float, default=240.0)
    ap.add_argument("--json", default="")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--registry", default="", help=argparse.SUPPRESS)
    ap.add_argument("--store-port", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.sizes = [int(s) * MIB for s in a.sizes.split(",") if s.strip()]
    if a.worker:
        worker(a)
        return 0
    return run(a)


if __name__ == "__main__":
    raise SystemExit(main())
