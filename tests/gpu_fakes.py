"""An injected GPU collective backend for tests: it hangs or fails where NCCL would (an
init that never becomes ready, a collective that never completes, an error code), and
records what the epoch manager asked of it."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from ftmesh.collective import RingView
from ftmesh.collective.aborts import CommFailure
from ftmesh.collective.backend import Backend
from ftmesh.collective.epochs import SETUP_BYTES, GpuCall, SetupRecord


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, dt: float) -> None:
        self.now += dt


class FakeComm:
    def __init__(self, factory: FakeFactory, view: RingView, uid: bytes) -> None:
        self.factory, self.view, self.uid = factory, view, uid
        self.aborted = False

    def ready(self) -> bool:
        self.factory.events.append("poll-init")
        if self.aborted:
            raise CommFailure(-2, "aborted")
        if self.factory.init_error is not None:
            raise CommFailure(self.factory.init_error, "init failed")
        return not self.factory.init_hangs

    def start(self, op: GpuCall) -> None:
        self.factory.events.append(f"start {op.kind.value}")
        self.factory.started.set()

    def done(self) -> bool:
        if self.aborted:
            raise CommFailure(-2, "aborted")
        if self.factory.op_error is not None:
            raise CommFailure(self.factory.op_error, "collective failed")
        return not self.factory.op_hangs


class FakeFactory:
    """Behaves as told: ``init_hangs``, ``init_error``, ``op_hangs``, ``op_error``."""

    name = "fake"

    def __init__(self) -> None:
        self.init_hangs = False
        self.init_error: int | None = None
        self.op_hangs = False
        self.op_error: int | None = None
        self.events: list[str] = []
        self.groups: list[list[str]] = []
        self.started = threading.Event()
        self.serials: list[int] = []

    def unique_id(self) -> bytes:
        return b"u" * 128

    def create(self, view: RingView, node_id: str, uid: bytes) -> FakeComm:
        self.events.append(f"create {view.epoch}")
        return FakeComm(self, view, uid)

    def abort_group(self, comms: Sequence[Any]) -> None:
        self.groups.append([c.view.epoch for c in comms])
        self.events.append(f"abort {[c.view.epoch for c in comms]}")
        for c in comms:
            c.aborted = True


class FakeControl:
    """The control channel of views whose other members are imaginary: the root's record
    is the caller's own (when it is the root) or one made here."""

    def __init__(self) -> None:
        self.ok_votes: list[bool] = []
        self.others_ok = True

    def broadcast_bytes(self, view: RingView, payload: bytes, root: str) -> bytes:
        if payload != bytes(SETUP_BYTES):
            return payload
        return SetupRecord(Backend.NCCL, 7, view.epoch, b"r" * 128).encode()

    def agree(self, view: RingView, ok: bool, token: bytes) -> bool:
        assert len(token) == 16
        self.ok_votes.append(ok)
        return ok and self.others_ok
