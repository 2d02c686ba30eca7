"""torch's process groups per view epoch, built on the ring store: an ``epochs.CommFactory``.

Theory of operation. ``TorchPGFactory`` is the library behind ``EpochManager`` for GPU
buffers: per view epoch it builds torch's ``ProcessGroupNCCL`` -- ftmesh's one NCCL binding
(docs/DESIGN-NOTES.md says why), the default of ``SyncMesh.enable_gpu`` -- (or, as the CI
stand-in and only as a test setting, ``ProcessGroupGloo``) on a ``ring_store.StorePump`` of
that epoch, so the rendezvous needs no TCPStore server and no special node. The manager
drives it:

* ``create`` starts the constructor in a worker thread (it blocks in rendezvous: gloo sets
  its address and gets the others'; NCCL's rank 0 sets the unique id) and returns at once.
  The constructor is followed by a one-element allreduce, so NCCL's lazily created
  communicator exists (its store traffic is over) before this member says it is done.
* ``ready`` (the manager's init poll) runs one store round with the other members (the
  rounds are collectives on the view's ring, in lockstep); it returns True once every member
  is done, and raises ``CommFailure`` on the same round everywhere if one failed (its
  constructor raised, its deadline passed, it sent a bad record).
* ``start`` enqueues the collective on the process group (torch's ``Work``), ``done`` polls
  ``Work.is_completed`` (gloo runs in its own threads, NCCL on the caller's stream), so the
  manager's deadline and abort paths apply to every call; between polls the manager waits in
  ``pause``, which an abort ends early. What ends it at completion depends on the library,
  because a work's future means different things (torch's source, 2.x):

  - gloo (host buffers): the future completes in gloo's worker thread when the result is in
    place, *just before* the work is marked completed (``finishWorkGloo``: the future's
    callbacks run, then ``finish()``). Its callback wakes ``pause``; the next ``done`` sees
    the future done and blocks in ``Work.wait`` (which releases the GIL) for the moment left
    until ``finish()``. It must not go on polling: the woken event would make every later
    ``pause`` return at once, and that spin holds the GIL the gloo thread needs to drop the
    Python callback before it can call ``finish()`` -- the spin then ends only when Python
    forces a GIL switch (5 ms), a cost of up to 5 ms per call (``ftmesh bench allreduce
    --torch-pg`` at 16 MiB: gloo_pg 0.865x gloo while it polled, 0.975x now, medians of ten
    runs; docs/DESIGN-NOTES.md).
  - NCCL (CUDA buffers): the future completes when the collective is *enqueued* (a CUDA
    future, stream-ordered: ``ProcessGroupNCCL::collective`` marks it completed right after
    the launch), so it says nothing about the GPU having finished and no callback is set.
    ``pause`` only yields the GIL (``time.sleep(0)``) between two polls of ``is_completed``
    (a CUDA event query): the completion is seen at once, as before, when the event set at
    enqueue made every pause return at once, but the polling thread no longer holds the GIL
    the mesh's threads need. Not measured on a GPU yet: the device check
    (``tests/gpu/pg_check.py``) compares this path's busbw with torch's own.
* ``abort_group`` closes the store (waking a constructor waiting in ``get``) and calls
  ``ProcessGroup.abort()`` on each group (NCCL: ``ncclCommAbort``), from the manager's
  aborting thread. A collective hung in gloo ends at the group's own timeout (set to the
  manager's ``op_timeout``); the caller never waits for it, the manager already raised.

The namespace of a store is the view epoch plus the root's random set-up id, so keys of an
aborted epoch and of its rebuild can never mix. ``SessionControl`` is the manager's control
channel on the same ``ViewCollectives`` (set-up record as a broadcast, agreement as an
allreduce), so a factory needs nothing but the view's session.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from ..errors import FtmeshError, LocalUsageError
from .aborts import NCCL_REMOTE_ERROR, CommFailure
from .epochs import GpuCall
from .errors import RingPeerLostError
from .ops import Kind
from .ring_store import StorePump, ViewCollectives, ring_store
from .session import SessionRing
from .tcp_backend import TcpControl
from .view import RingView

Sessions = Callable[[RingView], ViewCollectives]
"""The session (collectives) of a view: ``mesh.session(view)`` for a manager driven from
outside any collective, ``session.nested_sessions(mesh.session)`` inside the mesh's GPU path
(whose set-up runs inside a collective: see ``session.NestedSession``)."""
MakeGroup = Callable[[Any, int, int, timedelta], Any]
"""``(store, rank, size, timeout) -> torch ProcessGroup`` (a test may inject one that hangs)."""

ABORTED = -2
INTERNAL = 3
"""``ncclInternalError``: a library error that names no lost peer."""
ROUND_INTERVAL = 0.005
"""Seconds between the starts of two store rounds on a member: the rounds are collectives
on the ring, and a rendezvous needs a handful; pacing them keeps a set-up from spinning the
CPU that membership's probes need (a starved member gets suspected)."""
PAUSE_MIN = 0.05
"""Seconds at least between two polls of a started gloo collective (see ``TorchComm.pause``:
its completion wakes the pause, so the polls only notice the deadline)."""
_LOST_WORDS = ("connection", "closed", "reset", "remote", "peer", "broken pipe", "eof")


def make_gloo(store: Any, rank: int, size: int, timeout: timedelta) -> Any:
    import torch.distributed as dist

    return dist.ProcessGroupGloo(store, rank, size, timeout)


def make_nccl(store: Any, rank: int, size: int, timeout: timedelta) -> Any:
    """torch's ``ProcessGroupNCCL`` with torch's own init mode (blocking unless the user sets
    ``TORCH_NCCL_USE_COMM_NONBLOCKING=1``; see docs/DESIGN-NOTES.md, "One NCCL binding")."""
    import torch.distributed as dist

    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, size, opts)


class SessionControl(TcpControl):
    """``epochs.ControlChannel`` on the views' sessions (``session.SessionRing``, the one
    adapter from sessions to ``tcp_backend.RingOps``). Give it the same ``sessions`` as the
    factory: inside the mesh's GPU path both are ``session.nested_sessions(mesh.session)``."""

    def __init__(self, sessions: Sessions) -> None:
        super().__init__(SessionRing(sessions))


def _failure(exc: BaseException) -> CommFailure:
    """A library or ring error as the manager's ``CommFailure`` (a lost peer: remote)."""
    if isinstance(exc, CommFailure):
        return exc
    text = f"{type(exc).__name__}: {exc}"[:300]
    if isinstance(exc, RingPeerLostError) or any(w in text.lower() for w in _LOST_WORDS):
        return CommFailure(NCCL_REMOTE_ERROR, text)
    return CommFailure(INTERNAL, text)


class TorchComm:
    """One member's torch process group of one view epoch (see the module doc)."""

    def __init__(
        self,
        session: ViewCollectives,
        view: RingView,
        node_id: str,
        uid: bytes,
        *,
        make_group: MakeGroup,
        device: str,
        init_timeout: float,
        op_timeout: float,
    ) -> None:
        self.view = view
        self.rank = view.rank_of(node_id)
        self.pump = StorePump(session, f"{view.epoch}/{uid.hex()}", time.monotonic() + init_timeout)
        self.store = ring_store(self.pump, init_timeout)
        self._make_group = make_group
        self._device = device
        self._op_timeout = op_timeout
        self._lock = threading.Lock()
        self.group: Any = None
        self._aborted = False
        self._work: Any = None
        self._future: Any = None
        """The work's future where its completion means the result is in place (gloo);
        None for NCCL, whose future completes at enqueue (see the module doc)."""
        self._finish: Callable[[], None] | None = None
        self._next_round = 0.0
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._build, name="ftmesh-pg-init", daemon=True)
        self._thread.start()

    def _build(self) -> None:
        try:
            import torch

            group = self._make_group(
                self.store, self.rank, self.view.size, timedelta(seconds=self._op_timeout)
            )
            with self._lock:
                aborted = self._aborted
                self.group = group
            if aborted:  # aborted while the constructor ran: nobody else will abort it
                group.abort()
                raise CommFailure(ABORTED, "aborted during init")
            probe = torch.ones(1, device=self._device)
            group.allreduce([probe]).wait()
            self.pump.mark_done()
        except BaseException as exc:  # reported to every member by the next round
            self.pump.mark_failed(f"{type(exc).__name__}: {exc}")

    # -- the manager's polls -------------------------------------------------------------------
    def ready(self) -> bool:
        self._check()
        now = time.monotonic()
        if now < self._next_round:
            return False
        self._next_round = now + ROUND_INTERVAL
        try:
            over = self.pump.round()
        except FtmeshError as exc:  # the ring failed under the round (a member lost)
            raise _failure(exc) from exc
        if not over:
            return False
        if self.pump.failure is not None:
            f = self.pump.failure
            raise CommFailure(INTERNAL, f"process group set-up failed on {f.member}: {f.detail}")
        return True

    def start(self, op: GpuCall) -> None:
        import torch.distributed as dist

        t = _tensor(op.buffer)
        with self._lock:
            self._check()
            self._finish = None
            self._future = None
            self._wake = wake = threading.Event()
            try:
                if op.kind is Kind.ALLREDUCE:
                    opts = dist.AllreduceOptions()
                    opts.reduceOp = _reduce_op(op.op, t)
                    self._work = self.group.allreduce([t], opts)
                    if op.op == "avg" and not _native_avg(self._device):
                        n = self.view.size
                        self._finish = lambda: t.div_(n)
                else:
                    bopts = dist.BroadcastOptions()
                    bopts.rootRank = op.root
                    self._work = self.group.broadcast([t], bopts)
                if not _future_at_enqueue(self._device):
                    self._future = self._work.get_future()
                    self._future.add_done_callback(lambda _f: wake.set())
            except Exception as exc:
                raise _failure(exc) from exc

    def pause(self, seconds: float) -> None:
        """The manager's pause between polls. On gloo it ends at the collective's completion
        (its future's callback) or an abort (``abort`` sets the event too), so neither is
        seen a poll late; hence it may be long (``PAUSE_MIN``): the polls are only left to
        notice the deadline, and each wake-up competes with the library's threads for the
        CPU. On NCCL nothing signals the completion: it only yields the GIL, so the next
        poll comes at once (see the module doc)."""
        if self._future is None:
            time.sleep(0)
        else:
            self._wake.wait(max(seconds, PAUSE_MIN))

    def done(self) -> bool:
        self._check()
        work, fut = self._work, self._future
        try:
            if not work.is_completed():
                if fut is None or not fut.done():
                    return False
                # gloo: the result is in place and the worker thread marks the work
                # completed right after the future's callbacks; wait for that (GIL
                # released) rather than poll (see the module doc). Bounded all the same.
                work.wait(timedelta(seconds=self._op_timeout))
            else:
                work.wait()
        except Exception as exc:
            raise _failure(exc) from exc
        if self._finish is not None:
            self._finish()
        return True

    def abort(self) -> None:
        with self._lock:
            if self._aborted:
                return
            self._aborted = True
            group = self.group
        self._wake.set()
        self.pump.close("epoch aborted")
        if group is not None:
            group.abort()

    def _check(self) -> None:
        if self._aborted:
            raise CommFailure(ABORTED, "process group aborted")


def _tensor(x: Any) -> Any:
    """``x`` as a torch tensor sharing its memory (NumPy in tests, CuPy through DLPack)."""
    import numpy as np
    import torch

    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, np.ndarray):
        return torch.from_numpy(x)
    return torch.utils.dlpack.from_dlpack(x)


def _future_at_enqueue(device: str) -> bool:
    """Whether the library completes a work's future when the collective is enqueued (NCCL's
    CUDA futures) rather than when its result is in place (gloo)."""
    return device.startswith("cuda")


def _native_avg(device: str) -> bool:
    return device.startswith("cuda")  # NCCL has ncclAvg; gloo has no AVG


def _reduce_op(op: str, t: Any) -> Any:
    import torch.distributed as dist

    ops = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
    if op == "avg":
        if t.is_floating_point():
            return dist.ReduceOp.AVG if t.is_cuda else dist.ReduceOp.SUM
        raise LocalUsageError("avg needs a floating-point buffer")
    if op not in ops:
        raise LocalUsageError(f"unknown reduction {op!r} (sum, avg, min, max)")
    return ops[op]


class TorchPGFactory:
    """``epochs.CommFactory`` building torch's process group per view epoch on the ring
    store. ``backend="nccl"`` is the GPU path; ``"gloo"`` stands in for it in CI (a test
    setting: host buffers take the TCP ring in production)."""

    def __init__(
        self,
        sessions: Sessions,
        backend: str = "nccl",
        *,
        init_timeout: float = 25.0,
        op_timeout: float = 30.0,
        make_group: MakeGroup | None = None,
    ) -> None:
        if backend not in ("nccl", "gloo"):
            raise LocalUsageError(f"torch process group backend {backend!r}: nccl or gloo")
        self.name = f"torch-{backend}"
        self._sessions = sessions
        self._make_group = make_group or (make_nccl if backend == "nccl" else make_gloo)
        self._device = "cuda" if backend == "nccl" else "cpu"
        self.init_timeout = init_timeout
        """Seconds for the rendezvous rounds; keep it below ``EpochConfig.init_timeout`` so
        the rounds end (alike everywhere) before the manager's own deadline."""
        self.op_timeout = op_timeout
        self.aborted: list[list[str]] = []
        """Epochs of each ``abort_group`` call, in order (what the tests read)."""

    def unique_id(self) -> bytes:
        return os.urandom(16)

    def create(self, view: RingView, node_id: str, uid: bytes) -> TorchComm:
        return TorchComm(
            self._sessions(view),
            view,
            node_id,
            uid,
            make_group=self._make_group,
            device=self._device,
            init_timeout=self.init_timeout,
            op_timeout=self.op_timeout,
        )

    def abort_group(self, comms: Sequence[Any]) -> None:
        self.aborted.append([c.view.epoch for c in comms])
        for c in comms:
            c.abort()
