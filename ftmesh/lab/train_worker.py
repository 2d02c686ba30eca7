"""One training member of a chaos soak: ``python -m ftmesh.lab.train_worker`` inside a lab host.

Theory of operation: the worker joins the mesh like ``ftmesh node`` does (mDNS on the host's
LAN address, the given membership preset) and prints the same JSON membership events on stdout
(``self`` first, then one line per event, see :mod:`ftmesh.cli.node_cmd`), so the chaos
runner's view checks read it exactly like a membership-only member. Meanwhile it trains a
small MLP on a synthetic classification task with :class:`ftmesh.torch.ElasticTrainer`, for
ever, and after every committed step prints one record::

    {"event": "commit", "node": ID, "step": S, "digest": D, "parent_step": S - 1,
     "parent": P, "epoch": E, "members": [...], "synced": bool, "fetched": BYTES,
     "attempts": N, "loss": L, "adopted": bool, "time": T}

``step`` is the committed step count after the step, ``digest`` the model and optimizer state
hash at that point (``ElasticTrainer.digest()``: tens of microseconds for this model),
``epoch`` and ``members`` the view the step ran on. ``parent`` is the digest of the state the
step was computed from: the last state the trainer fetched during the step (recorded by
wrapping ``SyncMesh.fetch_state``), or else the state the worker held after its previous
commit (at start: its own initial weights, step 0). Parents let the runner follow the line
of states the mesh keeps. An *adopted* step (``ElasticTrainer`` took a step the others
committed, in a sync: this member failed at its end, or just joined) was not computed here:
its parent is the fetched state itself (``parent_step == step``, ``parent == digest``) and its
loss is null. ``node`` is the worker's own id, which the runner's
view reader skips as an event about itself.

The task is deterministic from ``--seed`` (every member builds the same data and model), so
any two members that commit a step on the same view must print the same digest. SIGTERM or
SIGINT ends the loop after the step in flight, prints the node's counters (a ``stats``
record, as ``ftmesh node`` does) and leaves the mesh gracefully, exit status 0; if the step
in flight does not return within ``STOP_GRACE`` seconds the worker leaves anyway. A killed
worker is replaced by a fresh process (a new node id) that joins and fetches the state.

``--fault KIND`` (``ftmesh.lab.insider``) makes the worker a misconfigured or compromised
member for tests: the fault is on from the start with ``--fault-on-start``, else from SIGUSR1,
and off again on SIGUSR2 (each change prints ``{"event": "fault", "on": bool}``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..logs import event_record
from ..membership.config import MembershipConfig
from ..mesh.blocking import SyncMesh
from ..mesh.core import MeshConfig
from ..net.node import Node, NodeConfig
from ..security import MeshAuth, load_secrets
from ..state import Snapshot, TransferStats
from ..torch import ElasticSampler, ElasticTrainer
from . import insider

STOP_GRACE = 2.0
"""Seconds the step in flight may take after SIGTERM before the worker leaves anyway (the lab
gives a member 5 s to exit before it kills it)."""

SAMPLES = 4096
FEATURES = 20
CLASSES = 8


class Out:
    """Serialised stdout: one ``write`` per JSON line, from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def emit(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, separators=(",", ":")) + "\n"
        with self._lock:
            sys.stdout.write(line)
            sys.stdout.flush()


def make_task(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and labels of a synthetic task: Gaussian points labelled by a random 2-layer
    teacher network, so a student MLP can learn it but not at once."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(SAMPLES, FEATURES)).astype(np.float32)
    w1 = rng.normal(size=(FEATURES, 16)).astype(np.float32)
    w2 = rng.normal(size=(16, CLASSES)).astype(np.float32)
    y = np.argmax(np.tanh(x @ w1) @ w2, axis=1)
    return torch.from_numpy(x), torch.from_numpy(y).long()


def make_model(seed: int, hidden: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(FEATURES, hidden), nn.ReLU(), nn.Linear(hidden, CLASSES))


def warm_up(x: torch.Tensor, y: torch.Tensor, hidden: int, lr: float) -> None:
    """One step on a throwaway model: pays torch's one-time costs (the first optimizer
    imports ``torch._dynamo``, over a second of CPU holding the GIL on a busy machine) before
    the worker joins the mesh, where such a stall makes its membership miss probes."""
    model = make_model(0, hidden)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    F.cross_entropy(model(x[:8]), y[:8]).backward()  # type: ignore[no-untyped-call]
    optimizer.step()
    optimizer.zero_grad()


class RecordingMesh(SyncMesh):
    """A :class:`SyncMesh` that remembers the states the trainer fetched, so that each commit
    can name the state it was computed from (its parent)."""

    def __init__(self) -> None:
        super().__init__()
        self.fetched: list[tuple[int, str]] = []
        """(step, digest) of every state fetched, in order."""

    def fetch_state(
        self,
        holders: Sequence[str],
        step: int,
        digest: str,
        stats: TransferStats | None = None,
        buffer: np.ndarray[Any, np.dtype[np.uint8]] | None = None,
    ) -> Snapshot:
        snap = super().fetch_state(holders, step, digest, stats, buffer)
        self.fetched.append((step, digest))
        return snap


async def _print_events(node: Node, out: Out) -> None:
    async for ev in node.events(replay=True):
        kind = "self" if ev.member.node == node.node_id else ev.kind
        out.emit(event_record(kind, ev.member))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    p.add_argument("--mesh", default="chaos")
    p.add_argument(
        "--discovery",
        choices=["mdns", "local"],
        default="mdns",
        help="mdns (lab hosts, the default) or local (same-host tests, with --registry-dir)",
    )
    p.add_argument("--interface", default="127.0.0.1", help="address to bind and announce")
    p.add_argument("--registry-dir", default="", help="local discovery's registry directory")
    p.add_argument("--preset", choices=["local", "lan", "wan"], default="local")
    p.add_argument("--name", default="")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument(
        "--step-delay",
        type=float,
        default=0.05,
        help="seconds to sleep after each step: keeps N members within a small machine's CPUs",
    )
    p.add_argument("--log-level", default="INFO", help="level of the ftmesh.torch log (stderr)")
    p.add_argument("--secret-file", default=None, help="mesh secret(s), one per line")
    p.add_argument("--fault", choices=insider.FAULTS, help="be a faulty member (tests)")
    p.add_argument("--fault-on-start", action="store_true", help="the fault is on from the start")
    p.add_argument("--compression", choices=["int8"], default=None, help="gradient compression")
    p.add_argument(
        "--gpu-standin",
        action="store_true",
        help="test setting: the gradient buckets take the GPU path, on torch's gloo process "
        "group built per view on the ring store (CI's stand-in for NCCL)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING,
        stream=sys.stderr,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    logging.getLogger("ftmesh.torch").setLevel(args.log_level)
    torch.set_num_threads(1)
    out = Out()
    stop = threading.Event()

    def on_signal(_sig: int, _frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    # Everything slow happens before we join: a member that holds the GIL for a second right
    # after joining (torch's first optimizer imports torch._dynamo) misses its probes.
    x, y = make_task(args.seed)
    warm_up(x, y, args.hidden, args.lr)
    model = make_model(args.seed, args.hidden)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    sampler = ElasticSampler(len(x), args.global_batch, seed=args.seed)

    node_cfg = NodeConfig(
        mesh=args.mesh,
        name=args.name,
        bind=args.interface,
        discovery=args.discovery,
        interface=args.interface if args.discovery == "mdns" else "",
        registry_dir=args.registry_dir,
        membership=MembershipConfig.preset(args.preset),
        auth=load_secrets(args.secret_file, False) if args.secret_file else MeshAuth.none(),
    )
    # Not in the ring until the trainer's first step (the trainer says "joining" too).
    mesh = cast(RecordingMesh, RecordingMesh.start(MeshConfig(node=node_cfg, role="joining")))
    node = mesh.mesh.node
    out.emit(event_record("self", mesh.call_sync(node.me)))
    printer = threading.Thread(
        target=lambda: _quietly(mesh.call, _print_events, node, out), daemon=True
    )
    printer.start()

    leaving = threading.Lock()
    left = threading.Event()

    def leave() -> None:
        """Print the node's counters and leave the mesh: once, from whichever thread comes
        first; a second caller waits for the first to finish."""
        with leaving:
            if left.is_set():
                return
            with contextlib.suppress(Exception):
                counters = mesh.call_sync(node.statistics)
                out.emit({"event": "stats", "node": node.node_id, "counters": counters,
                          "time": round(time.time(), 6)})  # fmt: skip
            mesh.close(join_timeout=STOP_GRACE)
            left.set()

    def watchdog() -> None:
        stop.wait()
        if finished.wait(STOP_GRACE):
            return
        leave()  # the step in flight did not return: leave anyway
        sys.stdout.flush()
        os._exit(0)

    finished = threading.Event()
    threading.Thread(target=watchdog, daemon=True).start()
    if args.fault:
        _install_fault(args, mesh, out)

    if args.gpu_standin:
        _enable_gpu_standin(mesh)
    trainer = ElasticTrainer(mesh, model, optimizer, sampler, compression=args.compression)

    def loss_fn(idx: np.ndarray) -> torch.Tensor:
        i = torch.from_numpy(idx)
        return F.cross_entropy(model(x[i]), y[i])

    held = (0, trainer.digest())  # the state we hold: our own initial weights at step 0
    try:
        while not stop.is_set():
            fetches = len(mesh.fetched)
            r = trainer.step(loss_fn)
            # Computed from the last state fetched during the step (a sync adopted it), or else
            # from the state we held.
            parent = mesh.fetched[-1] if len(mesh.fetched) > fetches else held
            held = (r.step, trainer.digest())
            out.emit(
                {
                    "event": "commit",
                    "node": node.node_id,
                    "step": r.step,
                    "digest": held[1],
                    "parent_step": parent[0],
                    "parent": parent[1],
                    "epoch": r.epoch,
                    "members": list(r.members),
                    "synced": r.synced,
                    "fetched": r.sync_bytes,
                    "attempts": r.attempts,
                    "loss": None if r.adopted else round(r.loss, 5),
                    "adopted": r.adopted,
                    "time": round(time.time(), 6),
                    **_gpu_record(mesh, trainer),
                }
            )
            if args.step_delay:
                stop.wait(args.step_delay)
    except Exception:
        if not stop.is_set():
            raise  # a real failure: the runner reports the exit as a crash
        # Stopping: the watchdog closed the mesh under the step in flight.
    finished.set()
    leave()
    return 0


def _enable_gpu_standin(mesh: SyncMesh) -> None:
    """``--gpu-standin``: CPU tensors count as device buffers and every member claims a GPU
    and one NCCL version, so each view is set up on the torch process-group backend, built
    with gloo instead of NCCL: the GPU path's code (ring store, per-epoch groups, aborts,
    deadlines, the trainer's device buckets) runs on a CPU machine."""
    from ..collective.backend import DeviceInfo
    from ..collective.epochs import EpochConfig
    from ..collective.session import nested_sessions
    from ..collective.torch_pg import TorchPGFactory

    config = EpochConfig(init_timeout=30.0, op_timeout=60.0)
    waits = config.op_timeout + config.start_wait  # (the group's own timeout: see EpochConfig)
    sessions = nested_sessions(mesh.session)  # (the rendezvous runs inside a collective)
    factory = TorchPGFactory(sessions, "gloo", init_timeout=20.0, op_timeout=waits)
    mesh.enable_gpu(
        factory=factory,
        devices=DeviceInfo(cuda=1, nccl=1),
        config=config,
        is_device=lambda x: isinstance(x, torch.Tensor),
    )


def _gpu_record(mesh: SyncMesh, trainer: ElasticTrainer) -> dict[str, Any]:
    """The GPU path's counters for a commit record (nothing without one)."""
    if mesh.gpu is None:
        return {}
    s = mesh.gpu.manager.statistics()
    return {"gpu": {"device_buckets": trainer.buckets.on_device, "collectives": s.collectives,
                    "nccl_views": s.nccl_views, "fallbacks": s.fallbacks}}  # fmt: skip


def _install_fault(args: argparse.Namespace, mesh: RecordingMesh, out: Out) -> None:
    """``--fault``: on from the start or from SIGUSR1, off on SIGUSR2 (a thread applies each
    change: signal handlers must not call into the mesh)."""
    active = threading.Event()
    if args.fault_on_start:
        active.set()
    changed = insider.install(args.fault, mesh, active)
    wake = threading.Event()

    def on_signal(sig: int, _frame: object) -> None:
        (active.set if sig == signal.SIGUSR1 else active.clear)()
        wake.set()

    def apply() -> None:
        detail = ""
        with contextlib.suppress(Exception):  # the mesh may be closing
            detail = changed()
        out.emit({"event": "fault", "kind": args.fault, "on": active.is_set(),
                  "detail": detail, "time": round(time.time(), 6)})  # fmt: skip

    def applier() -> None:
        while True:
            wake.wait()
            wake.clear()
            apply()

    apply()
    signal.signal(signal.SIGUSR1, on_signal)
    signal.signal(signal.SIGUSR2, on_signal)
    threading.Thread(target=applier, daemon=True).start()


def _quietly(fn: Any, *args: Any) -> None:
    with contextlib.suppress(BaseException):  # the mesh closed under the printer
        fn(*args)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    code = main()
    # Skip the interpreter's teardown: on a loaded host torch's takes seconds, past the
    # lab's SIGTERM grace, and the mesh has been left already.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
