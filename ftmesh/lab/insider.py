"""Fault injection inside a member process: a member that is misconfigured or compromised
while holding the mesh secret (lab and tests only; ``ftmesh.lab.train_worker --fault``).

Theory of operation: the member runs the real code; :func:`install` patches the one place
where the fault lives, and the fault is on while an :class:`threading.Event` is set (the
worker sets it at start or on SIGUSR1 and clears it on SIGUSR2), so one run can measure the
mesh before, during and after the fault:

=================  ===============================================================================
``bad-data-addr``  publish a closed port as our data-plane address (a wrong ``--advertise``, or
                   a firewall in front of the port): ring neighbours cannot connect to us, while
                   gossip works; cleared, the real address is published again
``bad-frames``     every ``DATA`` frame we send announces 4,294,967,040 bytes (the length field
                   of a corrupt or hostile sender): our right neighbour's reads fail
                   verification; ignored on an encrypted ring (where frames are sealed)
``flip-state``     our state server flips one byte in every chunk it serves (the manifest and its
                   leaf hashes stay honest): a fetcher's hash check fails on every range from us
``clock-step``     our wall clock jumps ``CLOCK_STEP`` seconds ahead (``time.time`` of the whole
                   process: what the replay check of a mesh with a secret reads, log stamps too);
                   cleared, it jumps back (a host whose clock was stepped, then corrected)
``header-nan``     our round tag in the step header is NaN (what we add and what we say we
                   added): before #26 every attempt of everyone failed, silently
``header-speeds``  we claim a speed of 3e38 for ourselves and write ``-SPEED_LIE`` into every
                   other member's speed slot (before #26: a crash at the next sync, honest
                   members evicted as stragglers)
``header-check``   our first state-check value is one more than our state's (before #26: every
                   member exited with ``StateDivergedError`` at the next check step)
``nan-grads``      our gradients are NaN (a bad batch, an fp16 overflow): before #26 every model
                   became NaN, silently
=================  ===============================================================================

Nothing here runs unless a worker asks for it; the library has no such switch.
"""

from __future__ import annotations

import math
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from ..collective import wire
from ..collective.engine import Pipeline
from ..errors import LocalUsageError
from ..mesh.blocking import SyncMesh
from ..mesh.meta import DATA_KEY
from ..state import transfer
from ..state.transfer import StateServer

FAULTS = (
    "bad-data-addr",
    "bad-frames",
    "flip-state",
    "clock-step",
    "header-nan",
    "header-speeds",
    "header-check",
    "nan-grads",
)

SPEED_LIE = 1e6
"""What ``header-speeds`` subtracts from every other member's speed slot."""

CLOCK_STEP = 90.0
"""Seconds the ``clock-step`` fault moves the wall clock: three times the default
``replay_window``."""

BOGUS_LENGTH = 0xFFFFFF00
"""What a corrupt ``DATA`` frame announces (4,294,967,040 bytes)."""


def closed_port(host: str) -> int:
    """A TCP port on ``host`` that nothing listens on (bound, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def install(kind: str, mesh: SyncMesh, active: threading.Event) -> Callable[[], str]:
    """Install fault ``kind``; returns what to call whenever ``active`` changed (for faults
    that must act on the change, not on the next frame or chunk); it says what it did."""
    if kind == "bad-frames":
        _corrupt_frames(active)
        return lambda: ""
    if kind == "flip-state":
        _flip_state(active)
        return lambda: ""
    if kind == "bad-data-addr":
        return _bad_data_addr(mesh, active)
    if kind == "clock-step":
        _step_clock(active)
        return lambda: f"wall clock {CLOCK_STEP if active.is_set() else 0.0:+.0f}s"
    if kind in ("header-nan", "header-speeds", "header-check", "nan-grads"):
        _patch_header(kind, active)
        return lambda: ""
    raise LocalUsageError(f"unknown fault {kind!r}; choose from {FAULTS}")


def _corrupt_frames(active: threading.Event) -> None:
    honest = Pipeline._next_frame

    def next_frame(self: Pipeline) -> list[memoryview] | None:
        frame = honest(self)
        if frame is None or not active.is_set() or self.ring.crypto is not None:
            return frame
        if len(frame) == 2 and frame[0].nbytes == wire.FRAME.size:
            kind, _length = wire.FRAME.unpack(frame[0])
            if kind == wire.DATA:
                return [memoryview(wire.FRAME.pack(wire.DATA, BOGUS_LENGTH)), frame[1]]
        return frame

    Pipeline._next_frame = next_frame  # type: ignore[method-assign]


def _flip_state(active: threading.Event) -> None:
    honest = StateServer._send_chunk

    async def send_chunk(self: StateServer, sock: Any, snap: Any, index: int) -> None:
        if not active.is_set():
            await honest(self, sock, snap, index)
            return
        for mv in snap.chunk_views(index):
            flipped = bytearray(mv)
            if flipped:
                flipped[len(flipped) // 2] ^= 0x5A
            await transfer._send_all(sock, flipped)
            self.bytes_sent += len(flipped)

    StateServer._send_chunk = send_chunk  # type: ignore[method-assign]


def _bad_data_addr(mesh: SyncMesh, active: threading.Event) -> Callable[[], str]:
    node = mesh.mesh.node
    real = str(mesh.call_sync(node.me).meta[DATA_KEY])
    host = real.rpartition(":")[0]
    wrong = f"{host}:{closed_port(host)}"

    def apply() -> str:
        addr = wrong if active.is_set() else real

        def update() -> None:
            meta = node.me().meta
            if meta.get(DATA_KEY) != addr:
                node.update_meta({**meta, DATA_KEY: addr})

        mesh.call_sync(update)
        return f"data address {addr}"

    return apply


def _patch_header(kind: str, active: threading.Event) -> None:
    """The step header faults of issue #26: what this member adds to the gradient
    allreduce's header (and so, its gathered row too) is wrong while ``active``."""
    from ..torch import trainer
    from ..torch.state import TrainingState
    from ..training import protocol
    from ..training.step import StepMachine

    if kind == "header-nan":
        honest_tag = protocol.round_tag

        def tag(step: int) -> float:
            return math.nan if active.is_set() else honest_tag(step)

        setattr(trainer, "round_tag", tag)  # noqa: B010 - (the name the trainer calls)
    elif kind == "header-speeds":
        honest_slots = StepMachine.speed_slots

        def slots(self: StepMachine, action: Any, share: int, seconds: float) -> Any:
            out = honest_slots(self, action, share, seconds)
            if active.is_set() and len(out):
                rank = action.view.rank_of(self.me)
                out[: action.view.size] = -SPEED_LIE
                out[rank] = 3e38
            return out

        StepMachine.speed_slots = slots  # type: ignore[method-assign]
    elif kind == "header-check":
        honest_checks = TrainingState.check_values

        def checks(self: TrainingState) -> list[int]:
            values = honest_checks(self)
            if active.is_set() and values:
                values[0] += 1
            return values

        TrainingState.check_values = checks  # type: ignore[method-assign]
    else:  # nan-grads
        honest_check = trainer.ElasticTrainer._check_own

        def poisoned(self: trainer.ElasticTrainer, buf: Any) -> None:
            if active.is_set():
                self.buckets.gradients(buf)[:] = math.nan
            honest_check(self, buf)

        trainer.ElasticTrainer._check_own = poisoned  # type: ignore[method-assign]


def _step_clock(active: threading.Event) -> None:
    real, real_ns = time.time, time.time_ns
    step_ns = int(CLOCK_STEP * 1e9)

    def stepped() -> float:
        return real() + CLOCK_STEP if active.is_set() else real()

    def stepped_ns() -> int:
        return real_ns() + step_ns if active.is_set() else real_ns()

    time.time = stepped
    time.time_ns = stepped_ns
