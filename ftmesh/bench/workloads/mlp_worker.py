"""One ftmesh training member for ``ftmesh bench recovery``: an MLP on synthetic data with
:class:`ftmesh.torch.ElasticTrainer`, instrumented.

Started with the ``FTMESH_*`` environment of ``ftmesh launch`` (``ftmesh.connect``). It prints
a ``hello`` record (pid, node id, state size), then one record per committed step with the
step's members and a timeline ``ev`` of what the step call spent its time on: every mesh call
the trainer made (``ar`` allreduce, blocking or submitted, ``bc`` broadcast, ``ft`` state
fetch, ``bar`` barrier, ``wv`` wait for a view, ``wvc`` wait for a view change, ``wq`` wait
for quiet), state snapshot / load (``sb``, ``ld``), digests (``dg``) and the forward pass
(``fwd``), each ``{"k", "a" (start), "b" (end), "err"?}`` on the monotonic clock. A
monitor thread adds ``view`` events (``a``: when this member saw a new view, ``ids``: its
members). The instrumentation wraps the mesh and trainer *instances*; it changes nothing in
ftmesh. Runs until killed or ``--max-seconds``.
"""

from __future__ import annotations

import time

T_START = time.monotonic()

import argparse  # noqa: E402
import faulthandler  # noqa: E402
import functools  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import ftmesh  # noqa: E402
from ftmesh.bench.sessions import time_sessions  # noqa: E402
from ftmesh.bench.workloads import (  # noqa: E402
    make_data,
    make_model,
    make_optimizer,
    param_count,
    progress,
)
from ftmesh.collective.ops import CollectiveOp, Kind  # noqa: E402
from ftmesh.torch import ElasticSampler, ElasticTrainer  # noqa: E402

T_IMPORTED = time.monotonic()


class Timeline:
    """Spans recorded by the wrappers, drained into each step's progress record."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[dict[str, Any]] = []

    def add(self, span: dict[str, Any]) -> None:
        with self._lock:
            self._spans.append(span)

    def drain(self) -> list[dict[str, Any]]:
        with self._lock:
            out, self._spans = self._spans, []
        return out

    def wrap(self, kind: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            a = time.monotonic()
            try:
                out = fn(*args, **kwargs)
            except BaseException as exc:
                self.add({"k": kind, "a": a, "b": time.monotonic(), "err": type(exc).__name__})
                raise
            span: dict[str, Any] = {"k": kind, "a": a, "b": time.monotonic()}
            if kind in ("ar", "bc") and len(args) >= 2 and hasattr(args[1], "nbytes"):
                span["n"] = int(args[1].nbytes)
            if kind == "ft" and hasattr(out, "nbytes"):
                span["n"] = int(out.nbytes)
            self.add(span)
            return out

        return timed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--state-mb", type=float, default=16.0)
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--dataset", type=int, default=4096)
    p.add_argument("--step-delay", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-seconds", type=float, default=900.0)
    p.add_argument("--recovery", choices=["redo", "keep"], default="redo")
    args = p.parse_args()
    faulthandler.register(signal.SIGUSR2, all_threads=True)  # the bench's stall report
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    logging.basicConfig(
        level=os.environ.get("FTMESH_LOG", "WARNING"),
        format="%(created).3f %(name)s %(levelname)s %(message)s",
    )

    model = make_model("mlp", args.state_mb, seed=args.seed)
    optimizer = make_optimizer(model)
    x, y = make_data("mlp", args.dataset, seed=args.seed)
    sampler = ElasticSampler(args.dataset, args.global_batch, seed=args.seed)
    t_model = time.monotonic()  # model, optimizer and data built (torch's first operations)
    tl = Timeline()

    def loss_fn(idx: np.ndarray) -> torch.Tensor:
        a = time.monotonic()
        i = torch.from_numpy(idx)
        loss = F.cross_entropy(model(x[i]), y[i])
        tl.add({"k": "fwd", "a": a, "b": time.monotonic()})
        return loss

    deadline = time.monotonic() + args.max_seconds
    with ftmesh.connect() as mesh:
        t_connected = time.monotonic()
        trainer = ElasticTrainer(
            mesh, model, optimizer, sampler, min_peers=1, recovery=args.recovery
        )
        # Wrap the instances the trainer calls (not the classes: nothing else changes).
        monitor_wait = mesh.wait_view_change
        for name, kind in (
            ("fetch_state", "ft"),
            ("wait_view", "wv"),
            ("wait_view_change", "wvc"),
            ("wait_quiet", "wq"),
        ):
            setattr(mesh, name, tl.wrap(kind, getattr(mesh, name)))
        kinds = {Kind.ALLREDUCE: "ar", Kind.BROADCAST: "bc", Kind.BARRIER: "bar"}

        def timed(method: str, fn: Callable[..., Any]) -> Callable[..., Any]:
            def call(op: CollectiveOp, x: Any) -> Any:
                kind = kinds.get(op.kind, op.kind.value)
                if method == "run":
                    return tl.wrap(kind, fn)(op, x)
                t0 = time.monotonic()
                fut = fn(op, x)
                n = int(x.nbytes) if hasattr(x, "nbytes") else 0

                def done(f: Any) -> None:
                    span: dict[str, Any] = {"k": kind, "a": t0, "b": time.monotonic(), "n": n}
                    exc = None if f.cancelled() else f.exception()
                    if f.cancelled() or exc is not None:
                        span["err"] = type(exc).__name__ if exc else "cancelled"
                    tl.add(span)

                fut.add_done_callback(done)
                return fut

            return call

        time_sessions(mesh, timed)
        for name, kind in (
            ("snapshot", "sb"),
            ("load_snapshot", "ld"),
            ("state_bytes", "sb"),
            ("load_state_bytes", "ld"),
            ("digest", "dg"),
        ):
            if hasattr(trainer, name):  # whichever state API the trainer has
                setattr(trainer, name, tl.wrap(kind, getattr(trainer, name)))

        def monitor() -> None:
            epoch = ""
            while time.monotonic() < deadline:
                try:
                    view = monitor_wait(epoch, 1.0)
                except BaseException:  # the mesh is closing (trio.Cancelled included)
                    return
                if view is not None and view.epoch != epoch:
                    epoch = view.epoch
                    now = time.monotonic()
                    tl.add({"k": "view", "a": now, "b": now, "ids": list(view.node_ids)})

        threading.Thread(target=monitor, daemon=True).start()
        progress(
            {
                "hello": True,
                "pid": os.getpid(),
                "node": mesh.node_id,
                "state_bytes_estimate": 8 * param_count(model),  # params + momentum, fp32
                "params": param_count(model),
                "t_start": T_START,
                "t_imported": T_IMPORTED,
                "t_model": t_model,
                "t_connected": t_connected,
            }
        )
        while time.monotonic() < deadline:
            r = trainer.step(loss_fn)
            progress(
                {
                    "step": r.step,
                    "loss": round(r.loss, 4),
                    "members": len(r.members),
                    "ids": list(r.members),
                    "node": mesh.node_id,
                    "attempts": r.attempts,
                    "skipped": r.skipped,
                    "synced": r.synced,
                    "sync_bytes": r.sync_bytes,
                    "sync_seconds": r.sync_seconds,
                    "epoch": r.epoch,
                    "ev": tl.drain(),
                }
            )
            if args.step_delay:
                time.sleep(args.step_delay)
    return 0


if __name__ == "__main__":
    sys.exit(main())
