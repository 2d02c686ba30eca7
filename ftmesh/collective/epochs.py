"""One GPU communicator per view epoch: set up, deadlines and aborts.

Theory of operation. A GPU collective runs on a communicator (NCCL's) that belongs to one view
epoch. ``EpochManager`` holds the communicator of the view in use on one member and drives
its life; the library behind it is a ``CommFactory`` (NCCL through torch's
``ProcessGroupNCCL``, ``ftmesh.collective.torch_pg``; the TCP ring in tests, or an injected
one that hangs or fails on cue), so every path below is tested without a GPU.

1. *Set up, no coordinator.* The first member of the view in ring order (its root) decides
   the backend of the view (``choose``: NCCL when every member can, see
   ``ftmesh.collective.backend``) and, for NCCL, makes the unique id. It broadcasts one
   fixed-size record -- magic, version, backend, a serial, the view epoch, the id -- over the
   mesh's authenticated control channel (the view's TCP ring, ``ControlChannel``), so the id
   reaches exactly the view's members, in order with their other collectives, and a record of
   another view is refused (the epoch in it must be the receiver's). No store, no special
   node: the root is a function of the view.
2. *Init with a deadline.* Every member starts a non-blocking init and polls it until it is
   ready, it fails, ``init_timeout`` passes, or an abort arrives. Then all members agree
   over the control channel (one allreduce of "ready" and a digest of the record, so a
   member holding another id than the others cannot go on either): if any member failed,
   every member
   aborts its communicator and the view runs on host staging instead (counted in
   ``statistics().fallbacks`` and logged) -- a member on NCCL never waits for one that fell
   back.
3. *Collectives with a deadline.* A collective is enqueued on the caller's stream and polled
   until done, until ``op_timeout`` passes (the communicator is aborted and
   ``PeerStalledError`` raised), or until an abort arrives. While a member of the view
   declares itself busy between steps (``busy``: evaluating, saving), the deadline moves on,
   up to ``start_wait`` more, so the user's time between steps fails no attempt.
4. *Aborts.* ``peer_suspected`` (membership's suspicion, from any thread) aborts at once the
   communicator of every view holding that peer, so a collective waiting for a frozen or dead
   peer fails in the next poll (sub-millisecond), not at a timeout, and later collectives on
   that view fail at once until ``clear_abort`` (the suspect refuted). ``view_changed``
   aborts the communicators of every other view before anything is built for the new one
   (and collectives on a view left fail at once, as a superseded view's on the data plane).
   Aborts of several communicators go to the factory as one group (NCCL requires that: an
   abort may synchronise the device, which a collective hung on another communicator
   blocks, pytorch#119797). NCCL's abort itself runs in the manager's own aborting thread:
   the reason is set at once and the waiting collective raises, whatever the abort takes
   (it has hung in the wild, NVIDIA/nccl#863); a new communicator is only built once the
   old ones are gone (``abort_timeout``).

Every abort has the typed reason of every backend (``ftmesh.collective.aborts.Abort``); the
error raised for it is the data plane's (``RingPeerLostError``, ``PeerStalledError``,
``ViewSupersededError``, ...) with the reason as ``.abort``, so the training loop's retry
logic needs no new case.

"sans-IO-ish": the manager owns no thread and never sleeps on its own -- time and waiting
come in through ``clock``/``sleep`` (a fake clock makes the deadline tests instant), I/O
through the factory and the control channel.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from ..errors import ConfigError, FtmeshError, LocalUsageError, MeshClosedError
from .aborts import Abort, AbortKind, CommFailure, abort_of, comm_failed, error_for
from .backend import Backend
from .dataplane import CollectiveResult
from .errors import RingPeerLostError, ViewSupersededError
from .ops import CollectiveOp, Kind
from .view import RingView

log = logging.getLogger(__name__)


_ENDS_SETUP = (AbortKind.PEER_LOST, AbortKind.SUPERSEDED, AbortKind.CLOSED)
"""Aborts that end a view's set-up for this member too (the others fall back alone)."""

GPU_KINDS = (Kind.ALLREDUCE, Kind.BROADCAST)
"""The collectives a GPU communicator runs (the others stage through the TCP ring)."""


@dataclass(frozen=True)
class GpuCall:
    """One collective (``ops.CollectiveOp``) bound to its buffer, in place, as a communicator
    runs it: ``root`` is a rank (broadcast)."""

    kind: Kind
    buffer: Any
    op: str = "sum"
    root: int = 0

    @classmethod
    def of(cls, view: RingView, op: CollectiveOp, buffer: Any) -> GpuCall:
        if op.kind not in GPU_KINDS or op.compression is not None:
            raise LocalUsageError(f"no GPU communicator runs {op}: stage it")
        root = view.rank_of(op.root) if op.kind is Kind.BROADCAST else 0
        return cls(op.kind, buffer, op.op, root)


# -- the seams ----------------------------------------------------------------------------------


class Communicator(Protocol):
    """One member's communicator of one epoch. Nothing here may block for long: ``ready``
    and ``done`` are polls, ``start`` enqueues. They raise ``CommFailure`` on an error."""

    def ready(self) -> bool:
        """Whether the (non-blocking) init has finished."""

    def start(self, op: GpuCall) -> None:
        """Enqueue ``op`` (after ``ready``, one at a time)."""

    def done(self) -> bool:
        """Whether the last started collective has completed."""

    # Optional: ``pause(seconds)`` -- wait up to ``seconds`` between two polls of ``done``,
    # returning early when the collective completes (or is aborted), so a completion is not
    # seen up to ``poll_max`` late. Without it the manager sleeps.


class CommFactory(Protocol):
    """A collective library: makes ids and communicators, aborts them in groups."""

    name: str

    def unique_id(self) -> bytes:
        """A new id (at most ``UID_BYTES``), made by the view's root only."""

    def create(self, view: RingView, node_id: str, uid: bytes) -> Communicator:
        """Start a non-blocking init of ``node_id``'s communicator of ``view``."""

    def abort_group(self, comms: Sequence[Communicator]) -> None:
        """Abort every communicator in ``comms`` together (idempotent per communicator);
        safe from any thread, also while another thread polls one of them."""


class ControlChannel(Protocol):
    """The view's authenticated, ordered channel between its members (the TCP ring)."""

    def broadcast_bytes(self, view: RingView, payload: bytes, root: str) -> bytes:
        """Every member gets ``root``'s ``payload`` (all pass ``SETUP_BYTES`` bytes)."""

    def agree(self, view: RingView, ok: bool, token: bytes) -> bool:
        """True on every member iff every member passed ``ok`` and the same ``token``
        (``TOKEN_BYTES`` bytes)."""


class SoloControl:
    """The control channel of a one-member view (nothing to exchange)."""

    def broadcast_bytes(self, view: RingView, payload: bytes, root: str) -> bytes:
        return payload

    def agree(self, view: RingView, ok: bool, token: bytes) -> bool:
        return ok


# -- the set-up record ----------------------------------------------------------------------------

SETUP_MAGIC = b"FTGP"
SETUP_VERSION = 1
TOKEN_BYTES = 16
UID_BYTES = 128
"""NCCL's ``NCCL_UNIQUE_ID_BYTES``; longer ids are refused."""
_SETUP = struct.Struct("<4sBBHQ16s")
_BACKEND_CODES = {Backend.NCCL: 1, Backend.STAGING: 2}
"""A view's backend in a set-up record (only these two: host buffers never set up)."""
_CODE_BACKENDS = {v: k for k, v in _BACKEND_CODES.items()}
SETUP_BYTES = _SETUP.size + UID_BYTES


@dataclass(frozen=True)
class SetupRecord:
    backend: Backend
    serial: int
    epoch: str
    uid: bytes

    def token(self) -> bytes:
        """What the members compare when they agree: a digest of the whole record."""
        return hashlib.blake2b(self.encode(), digest_size=TOKEN_BYTES).digest()

    def encode(self) -> bytes:
        if len(self.uid) > UID_BYTES or len(self.epoch.encode()) != 16:
            raise ConfigError("a set-up record holds a 16-character epoch and a <=128 byte id")
        head = _SETUP.pack(
            SETUP_MAGIC,
            SETUP_VERSION,
            _BACKEND_CODES[self.backend],
            len(self.uid),
            self.serial,
            self.epoch.encode(),
        )
        return head + self.uid.ljust(UID_BYTES, b"\0")

    @classmethod
    def decode(cls, raw: bytes, epoch: str) -> SetupRecord:
        """Parse and check a record for view ``epoch``; ``CommFailure`` if it is not one."""
        if len(raw) != SETUP_BYTES:
            raise CommFailure(-1, f"set-up record of {len(raw)} bytes")
        magic, version, backend, uid_len, serial, ep = _SETUP.unpack_from(raw)
        if magic != SETUP_MAGIC or version != SETUP_VERSION:
            raise CommFailure(-1, "not a set-up record (magic/version)")
        if backend not in _CODE_BACKENDS or uid_len > UID_BYTES:
            raise CommFailure(-1, f"bad set-up record (backend {backend}, id {uid_len} bytes)")
        if ep != epoch.encode():
            raise CommFailure(-1, f"set-up record of view {ep!r}, expected {epoch}")
        uid = raw[_SETUP.size : _SETUP.size + uid_len]
        return cls(_CODE_BACKENDS[backend], serial, epoch, uid)


# -- the manager ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class EpochConfig:
    init_timeout: float = 30.0
    """Seconds a communicator may take to initialise before the view falls back to staging.
    NCCL's init connects to every peer; a peer that dies during it would otherwise hang the
    others forever (NVIDIA/nccl#289)."""
    op_timeout: float = 30.0
    """Seconds a collective may take before its communicator is aborted. A dead peer is
    normally noticed much sooner, through membership (``peer_suspected``); this bounds
    what membership does not see (a GPU hang, a wedged driver). Size it above the slowest
    legitimate collective."""
    poll_min: float = 20e-6
    poll_max: float = 1e-3
    """Bounds of the pause between two polls of a pending init or collective (seconds; the
    pause doubles from ``poll_min``). The maximum bounds the latency an abort or a completed
    collective waits for; the minimum keeps a short collective from paying a full pause."""
    start_wait: float = 600.0
    """Seconds a collective may wait past ``op_timeout`` while a member of its view declares
    itself busy between steps (evaluating, saving: ``busy``), as the TCP ring's
    ``CollectiveConfig.start_wait``: the user's time between steps fails nobody's attempt.
    Membership still ends the wait at once for a member suspected, dead or gone. A library
    with a timeout of its own (torch's process groups) must allow ``op_timeout +
    start_wait``."""
    abort_timeout: float = 30.0
    """Seconds a new communicator waits for the aborts of the old ones (never build one on a
    GPU where another is still being torn down, pytorch#119797). Aborts run in their own
    thread, so a caller never waits for one otherwise; one that does not finish in time (an
    NCCL bug seen in the wild, NVIDIA/nccl#863) makes the set-up raise ``PeerStalledError``."""
    max_aborted_views: int = 64
    """Views whose abort is remembered (a collective on one fails at once); caps memory."""

    def __post_init__(self) -> None:
        for name in ("init_timeout", "op_timeout", "poll_min", "poll_max", "abort_timeout"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0 seconds")
        if not 0 <= self.start_wait < float("inf"):
            raise ConfigError(f"start_wait must be >= 0 seconds, got {self.start_wait}")
        if self.poll_min > self.poll_max or self.max_aborted_views < 1:
            raise ConfigError("poll_min must be <= poll_max and max_aborted_views >= 1")


@dataclass(frozen=True)
class EpochStats:
    """``EpochManager.statistics()``: counters since start."""

    setups: int = 0
    nccl_views: int = 0
    fallbacks: int = 0
    collectives: int = 0
    aborts: dict[str, int] = field(default_factory=dict)
    last_setup_seconds: float = 0.0
    last_abort_seconds: float = 0.0
    """How long the last abort of communicators took (grouped), in the aborting thread."""


@dataclass
class _Epoch:
    view: RingView
    backend: Backend
    serial: int
    comm: Communicator | None = None
    reason: Abort | None = None
    aborted: bool = False

    def take(self, reason: Abort) -> list[Communicator]:
        """Mark aborted for ``reason`` (the first reason wins); the communicator to abort."""
        if self.reason is None:
            self.reason = reason
        if self.comm is None or self.aborted:
            return []
        self.aborted = True
        return [self.comm]


class _Reaper:
    """The one thread that aborts a manager's communicators, so that neither a collective's
    caller nor membership's thread ever waits for an abort NCCL may take long to finish, or
    never finish (NVIDIA/nccl#863, #1777). Started on demand; it ends after ``IDLE_EXIT``
    seconds without work."""

    IDLE_EXIT = 5.0

    def __init__(self, factory: CommFactory, done: Callable[[str, float], None]) -> None:
        self._factory = factory
        self._done = done
        self._queue: queue.SimpleQueue[tuple[Sequence[Communicator], str]] = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._pending = 0
        self._thread: threading.Thread | None = None

    def submit(self, comms: Sequence[Communicator], key: str) -> None:
        with self._cond:
            self._pending += 1
            self._queue.put((comms, key))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="ftmesh-gpu-abort", daemon=True
                )
                self._thread.start()

    def wait_idle(self, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._pending == 0, timeout)

    def _run(self) -> None:
        while True:
            try:
                comms, key = self._queue.get(timeout=self.IDLE_EXIT)
            except queue.Empty:
                with self._cond:
                    if self._queue.empty():
                        self._thread = None
                        return
                continue
            t0 = time.monotonic()
            try:
                self._factory.abort_group(comms)
            except Exception:  # an abort that fails still counts as done: log it, go on
                log.exception("aborting %d GPU communicator(s) failed", len(comms))
            self._done(key, time.monotonic() - t0)
            with self._cond:
                self._pending -= 1
                self._cond.notify_all()


Chooser = Callable[[RingView], Backend]
Fallback = Callable[[RingView, GpuCall], None]


class EpochManager:
    """The GPU collectives of one member, one communicator per view (see the module doc).

    ``run`` (and ``allreduce``/``broadcast``) take turns: call them from one thread at a
    time, as the data plane's collectives. ``peer_suspected``, ``view_changed``,
    ``clear_abort``, ``close`` and ``statistics`` are safe from any thread."""

    def __init__(
        self,
        node_id: str,
        factory: CommFactory,
        control: ControlChannel,
        *,
        choose: Chooser | None = None,
        fallback: Fallback | None = None,
        config: EpochConfig | None = None,
        busy: Callable[[RingView], list[str]] | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        """``busy(view)``: the other members of ``view`` that declare themselves busy between
        steps now (a collective waits for them up to ``start_wait`` past ``op_timeout``)."""
        self.node_id = node_id
        self.config = config or EpochConfig()
        self._factory = factory
        self._control = control
        self._choose = choose or (lambda _view: Backend.NCCL)
        self._fallback = fallback
        self._busy = busy
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()
        self._run_lock = threading.Lock()
        self._epoch: _Epoch | None = None
        self._aborted: OrderedDict[str, Abort] = OrderedDict()
        self._serial = 0
        self._closed = False
        self._stats = EpochStats()
        self._reaper = _Reaper(factory, self._aborted_one)

    # -- collectives ---------------------------------------------------------------------------
    def allreduce(self, view: RingView, x: Any, op: str = "sum") -> CollectiveResult[Any]:
        return self.run(view, GpuCall(Kind.ALLREDUCE, x, op))

    def broadcast(self, view: RingView, x: Any, root: str) -> CollectiveResult[Any]:
        return self.run(view, GpuCall(Kind.BROADCAST, x, root=view.rank_of(root)))

    def run(self, view: RingView, op: GpuCall) -> CollectiveResult[Any]:
        """Run ``op`` in place on ``view`` (set up first if the view is new), on NCCL or, if
        the view fell back, through ``fallback``. Raises the error of an abort reason."""
        view.rank_of(self.node_id)  # LocalUsageError if we are not a member
        if not self._run_lock.acquire(blocking=False):
            raise ConfigError("GPU collectives of one member must be called one at a time")
        try:
            ep = self._epoch_for(view)
            if ep.backend is Backend.STAGING:
                if self._fallback is None:
                    detail = f"view {view.epoch} fell back to staging and no fallback is set"
                    raise error_for(self._reason(AbortKind.COMM_FAILED, detail), view.epoch)
                self._fallback(view, op)
            else:
                comm = ep.comm
                assert comm is not None
                self._call(ep, lambda: comm.start(op))
                pause = getattr(comm, "pause", None)  # optional: woken when the op is done
                self._wait(ep, op.kind.value, comm.done, self.config.op_timeout, pause, True)
            self._count("collectives")
            return CollectiveResult(view.epoch, view.node_ids, op.buffer)
        finally:
            self._run_lock.release()

    def backend_of(self, view: RingView) -> Backend | None:
        """The backend the view was set up with, if it is the one in use."""
        ep = self._epoch
        return ep.backend if ep is not None and ep.view.epoch == view.epoch else None

    # -- events from other threads -------------------------------------------------------------
    def peer_suspected(self, peer: str, why: str = "") -> None:
        """Membership no longer counts on ``peer``: abort the view holding it, now."""
        if peer == self.node_id:
            return
        with self._lock:
            ep = self._epoch
            if ep is None or peer not in ep.view:
                return
            detail = f"GPU collective on view {ep.view.epoch} aborted: {peer} suspected ({why})"
            reason = self._reason(AbortKind.PEER_LOST, detail, peer)
            self._remember(ep.view.epoch, reason)
            comms = ep.take(reason)
        self._abort(comms, reason)

    def view_changed(self, view: RingView | None) -> None:
        """This member's current view is now ``view``: abort the communicator of any other."""
        with self._lock:
            ep = self._epoch
            if ep is None or (view is not None and ep.view.epoch == view.epoch):
                return
            reason = self._left_for(ep.view, view)
            self._remember(ep.view.epoch, reason)
            comms = ep.take(reason)
        self._abort(comms, reason)

    def aborted(self, epoch: str) -> Abort | None:
        """Why collectives on ``epoch`` fail at once (see ``clear_abort``), if they do."""
        with self._lock:
            return self._aborted.get(epoch)

    def clear_abort(self, epoch: str) -> None:
        """The view ``epoch`` is current again (a suspect refuted): it may be set up anew."""
        with self._lock:
            self._aborted.pop(epoch, None)

    def close(self) -> None:
        """Abort every communicator; later collectives raise ``MeshClosedError``."""
        with self._lock:
            self._closed = True
            ep = self._epoch
            closed = self._reason(AbortKind.CLOSED, "the GPU collectives were closed")
            comms = ep.take(closed) if ep is not None else []
        self._abort(comms, closed)
        self.wait_aborts(self.config.abort_timeout)

    def statistics(self) -> EpochStats:
        with self._lock:
            return replace(self._stats, aborts=dict(self._stats.aborts))

    # -- internals -----------------------------------------------------------------------------
    def _epoch_for(self, view: RingView) -> _Epoch:
        with self._lock:
            if self._closed:
                detail = f"the GPU collectives of view {view.epoch} were closed"
                raise error_for(self._reason(AbortKind.CLOSED, detail), view.epoch)
            reason = self._aborted.get(view.epoch)
            if reason is not None:
                raise error_for(reason, view.epoch)
            ep = self._epoch
            if ep is not None and ep.view.epoch == view.epoch and ep.reason is None:
                return ep
            old = []
            left = self._left_for(ep.view, view) if ep is not None else None
            if ep is not None and left is not None and ep.view.epoch != view.epoch:
                self._remember(ep.view.epoch, left)
            if ep is not None and left is not None:
                old = ep.take(left)
            self._epoch = None
        self._abort(old, left)
        if not self.wait_aborts(self.config.abort_timeout):  # before the new view is built
            raise error_for(self._deadline("abort", self.config.abort_timeout), view.epoch)
        return self._setup(view)

    def _setup(self, view: RingView) -> _Epoch:
        started = self._clock()
        root = view.members[0].node_id
        payload = bytes(SETUP_BYTES)
        if root == self.node_id:
            self._serial += 1
            backend = self._choose(view)
            if backend not in _BACKEND_CODES:
                raise ConfigError(f"a view's GPU backend is NCCL or STAGING, not {backend}")
            uid = self._factory.unique_id() if backend is Backend.NCCL else b""
            payload = SetupRecord(backend, self._serial, view.epoch, uid).encode()
        raw = self._control.broadcast_bytes(view, payload, root)
        try:
            record = SetupRecord.decode(raw, view.epoch)
        except CommFailure as exc:  # another version of ftmesh, or not a record at all
            failed = Abort(AbortKind.COMM_FAILED, "", self.node_id, str(exc))
            raise error_for(failed, view.epoch) from exc
        ep = _Epoch(view, record.backend, record.serial)
        with self._lock:
            self._serial = max(self._serial, record.serial)
            self._epoch = ep
            self._count("setups")
        if record.backend is Backend.STAGING:
            return ep
        ok = False
        try:
            comm = self._factory.create(view, self.node_id, record.uid)
            with self._lock:
                ep.comm = comm
                late = ep.take(ep.reason) if ep.reason is not None else []
            self._abort(late, ep.reason)  # aborted while being created
            self._wait(ep, "init", comm.ready, self.config.init_timeout)
            ok = True
        except (FtmeshError, ImportError, OSError) as exc:
            # A loss, our moving on or closing ends the set-up; a failed or stalled init of
            # our own falls back to staging with the others (the agreement below).
            why = abort_of(exc)
            if why is not None and why.kind in _ENDS_SETUP:
                raise
            if why is None and isinstance(exc, RingPeerLostError | ViewSupersededError):
                raise
            if isinstance(exc, MeshClosedError):
                raise
            log.warning("%s: no NCCL communicator for view %s: %s", self.node_id, view.epoch, exc)
        if self._control.agree(view, ok, record.token()):
            with self._lock:
                self._count("nccl_views")
                self._stats = replace(self._stats, last_setup_seconds=self._clock() - started)
            return ep
        with self._lock:
            comms = ep.take(self._reason(AbortKind.COMM_FAILED, "a member could not set up NCCL"))
            ep.backend, ep.reason, ep.comm = Backend.STAGING, None, None
            self._count("fallbacks")
        self._abort(comms, None)
        log.warning("view %s: a member could not set up NCCL; host staging instead", view.epoch)
        return ep

    def _call(self, ep: _Epoch, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except CommFailure as exc:
            self._fail(ep, comm_failed(exc.code, exc.message, self.node_id))
        return None

    def _wait(
        self,
        ep: _Epoch,
        phase: str,
        cond: Callable[[], bool],
        timeout: float,
        pause_fn: Callable[[float], object] | None = None,
        may_wait_busy: bool = False,
    ) -> None:
        """Poll ``cond`` until it holds, ``ep`` is aborted or ``timeout`` passes; with
        ``may_wait_busy``, the deadline moves on (at most ``start_wait`` in all) while a member
        of the view is busy between steps."""
        now = self._clock()
        deadline, latest = now + timeout, now + timeout + self.config.start_wait
        pause = self.config.poll_min
        waited_for: list[str] = []
        while True:
            if ep.reason is not None:
                raise error_for(ep.reason, ep.view.epoch)
            if self._call(ep, cond):
                return
            now = self._clock()
            if now >= deadline:
                busy = self._busy(ep.view) if may_wait_busy and self._busy is not None else []
                if not busy or now >= latest:
                    self._fail(ep, self._deadline(phase, timeout))
                if busy != waited_for:
                    waited_for = busy
                    log.info(
                        "GPU %s on view %s waits for %s: busy between steps",
                        phase,
                        ep.view.epoch,
                        ", ".join(busy),
                    )
                deadline = min(now + self.config.poll_max * 100, latest)
            (pause_fn or self._sleep)(pause)
            pause = min(pause * 2, self.config.poll_max)

    def _fail(self, ep: _Epoch, reason: Abort) -> None:
        with self._lock:
            comms = ep.take(reason)
        self._abort(comms, reason)
        raise error_for(ep.reason or reason, ep.view.epoch)

    def _abort(self, comms: list[Communicator], reason: Abort | None) -> None:
        """Hand ``comms`` to the aborting thread; returns at once."""
        if comms:
            key = reason.kind.value if reason is not None else "fallback"
            self._reaper.submit(comms, key)

    def _aborted_one(self, key: str, seconds: float) -> None:
        with self._lock:
            aborts = dict(self._stats.aborts)
            aborts[key] = aborts.get(key, 0) + 1
            self._stats = replace(self._stats, aborts=aborts, last_abort_seconds=seconds)

    def wait_aborts(self, timeout: float) -> bool:
        """Wait until every abort handed over so far has finished; False after ``timeout``."""
        return self._reaper.wait_idle(timeout)

    def _reason(self, kind: AbortKind, detail: str, peer: str = "") -> Abort:
        return Abort(kind, peer, self.node_id, detail)

    def _deadline(self, phase: str, seconds: float) -> Abort:
        return self._reason(AbortKind.STALLED, f"GPU {phase} passed its {seconds:g}s deadline")

    def _left_for(self, old: RingView, new: RingView | None) -> Abort:
        detail = f"view {old.epoch} was left for {new.epoch if new is not None else 'no view'}"
        return self._reason(AbortKind.SUPERSEDED, detail)

    def _remember(self, epoch: str, reason: Abort) -> None:
        self._aborted[epoch] = reason
        self._aborted.move_to_end(epoch)
        while len(self._aborted) > self.config.max_aborted_views:
            self._aborted.popitem(last=False)

    def _count(self, name: str) -> None:
        self._stats = replace(self._stats, **{name: getattr(self._stats, name) + 1})
