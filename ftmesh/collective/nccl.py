"""NCCL communicators behind ``epochs.CommFactory``: nccl4py's non-blocking ones, or CuPy's.

Theory of operation: ``NcclFactory`` makes one ``NcclCommunicator`` per view epoch on top of
a *driver*, the thin layer over a Python binding of NCCL. Both bindings are optional and
imported only here, when a factory is made:

* ``Nccl4pyDriver`` (preferred, ``nccl4py``): non-blocking communicators
  (``NCCLConfig(blocking=False)``), so init and every collective return at once and progress
  is polled with ``get_async_error``; every wait therefore has a deadline and an abort path,
  init included (a blocking init hangs forever when a peer dies during it, NVIDIA/nccl#289).
* ``CupyDriver`` (fallback, ``cupy.cuda.nccl``): blocking communicators only. Collectives
  are still enqueued and then polled (a CUDA event), so they abort like the others; but
  ``ncclCommInitRank`` blocks and yields no handle to abort until it returns. It runs in a
  helper thread; past the deadline the thread is abandoned (counted in ``abandoned_inits``)
  and, should it ever return, it aborts what it made. CuPy's ``NcclError`` table also lacks
  codes 7 and 8, which arrive as ``KeyError`` and are mapped back here.

Buffers are used in place and zero-copy, on the caller's stream: a torch CUDA tensor (its
``data_ptr()`` and ``torch.cuda.current_stream()``) or a CuPy array (``data.ptr`` and CuPy's
current stream). Completion is a CUDA event recorded on that stream after the collective.

Thread safety: a communicator's polls and its abort take one lock, so an abort from the
membership thread never frees a communicator under a running poll; the polls are short.
With the blocking CuPy driver an enqueue is not under the lock (it may block in NCCL, and
an abort from another thread is what unblocks it).

Everything here runs only on a GPU machine; ``tests/gpu/run_device_check.py`` exercises it.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ..errors import FtmeshError, LocalUsageError
from .aborts import CommFailure
from .epochs import GpuCall
from .ops import Kind
from .view import RingView

NCCL_DTYPES = {
    "int8": 0,
    "uint8": 1,
    "int32": 2,
    "uint32": 3,
    "int64": 4,
    "uint64": 5,
    "float16": 6,
    "float32": 7,
    "float64": 8,
    "bfloat16": 9,
}
"""``ncclDataType_t`` of the dtypes NCCL reduces; others (int16) go through staging."""
NCCL_OPS = {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4}
IN_PROGRESS = 7
"""``ncclInProgress``."""
ABORTED = -2
"""Our code for "this communicator was aborted" (no NCCL code means that)."""
GROUP_ABORT_VERSION = 22200
"""NCCL version from which aborts inside ``ncclGroupStart/End`` abort together (assumed:
verify on a GPU); before it communicators are aborted one after the other."""


class NcclUnavailableError(FtmeshError):
    """No NCCL binding (nccl4py or CuPy with NCCL) could be loaded."""


@dataclass(frozen=True)
class DeviceBuffer:
    """A CUDA buffer seen by NCCL: the object, its pointer, size, dtype and stream."""

    obj: Any
    ptr: int
    count: int
    dtype: str
    stream: int
    library: str  # "torch" or "cupy"


def device_buffer(x: Any) -> DeviceBuffer:
    """``x`` (a contiguous torch CUDA tensor or CuPy array) as a ``DeviceBuffer``."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        if not x.is_cuda or not x.is_contiguous():
            raise LocalUsageError("NCCL needs a contiguous CUDA tensor")
        stream = torch.cuda.current_stream(x.device).cuda_stream
        dtype = str(x.dtype).removeprefix("torch.")
        return DeviceBuffer(x, int(x.data_ptr()), int(x.numel()), dtype, int(stream), "torch")
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(x, cupy.ndarray):
        if not x.flags.c_contiguous:
            raise LocalUsageError("NCCL needs a C-contiguous CuPy array")
        stream = cupy.cuda.get_current_stream().ptr
        return DeviceBuffer(x, int(x.data.ptr), int(x.size), x.dtype.name, int(stream), "cupy")
    raise LocalUsageError(f"NCCL needs a torch CUDA tensor or a CuPy array, got {type(x)}")


def nccl_supports(dtype: str, op: str = "sum") -> bool:
    return dtype in NCCL_DTYPES and op in NCCL_OPS


def _event_after(buf: DeviceBuffer) -> Any:
    """A CUDA event recorded on ``buf``'s stream (``query()`` is True once it passed)."""
    if buf.library == "torch":
        torch = sys.modules["torch"]
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(buf.obj.device))
        return ev
    cupy = sys.modules["cupy"]
    ev = cupy.cuda.Event(block=False, disable_timing=True)
    ev.record(cupy.cuda.get_current_stream())
    return _CupyEvent(ev)


class _CupyEvent:
    def __init__(self, ev: Any) -> None:
        self._ev = ev

    def query(self) -> bool:
        return bool(self._ev.done)


class NcclDriver(Protocol):
    nonblocking: bool

    def version(self) -> int: ...
    def unique_id(self) -> bytes: ...
    def init(self, nranks: int, rank: int, uid: bytes) -> Any: ...
    def async_error(self, handle: Any) -> int: ...
    def error_string(self, handle: Any, code: int) -> str: ...
    def collective(self, handle: Any, op: GpuCall, buf: DeviceBuffer) -> None: ...
    def abort_group(self, handles: Sequence[Any]) -> None: ...


class Nccl4pyDriver:
    """nccl4py (``nccl.core``), non-blocking communicators."""

    nonblocking = True

    def __init__(self) -> None:
        import nccl.core as nc  # optional dependency

        self._nc = nc

    def version(self) -> int:
        """The loaded libnccl's version code (``ncclGetVersion``, e.g. 23203)."""
        from nccl.bindings import nccl as raw  # nc.get_version() is a VersionInfo, not this

        return int(raw.get_version())

    def unique_id(self) -> bytes:
        return bytes(self._nc.get_unique_id())

    def init(self, nranks: int, rank: int, uid: bytes) -> Any:
        nc = self._nc
        config = nc.NCCLConfig(blocking=False)
        return nc.Communicator.init(nranks, rank, nc.UniqueId.from_bytes(uid), config=config)

    def async_error(self, handle: Any) -> int:
        return int(handle.get_async_error())

    def error_string(self, handle: Any, code: int) -> str:
        with contextlib.suppress(Exception):
            return str(handle.get_last_error())
        return f"NCCL error {code}"

    def collective(self, handle: Any, op: GpuCall, buf: DeviceBuffer) -> None:
        if op.kind is Kind.ALLREDUCE:
            red = self._nc.NcclRedOp(NCCL_OPS[op.op])
            handle.allreduce(buf.obj, buf.obj, red, stream=buf.stream)
        else:
            handle.broadcast(buf.obj, buf.obj, op.root, stream=buf.stream)

    def abort_group(self, handles: Sequence[Any]) -> None:
        if len(handles) > 1 and self.version() >= GROUP_ABORT_VERSION:
            self._nc.group_start()
            try:
                for h in handles:
                    h.abort()
            finally:
                self._nc.group_end()
        else:
            for h in handles:
                h.abort()


class _PendingInit:
    """A blocking CuPy init running in a helper thread (see the module doc)."""

    def __init__(self, nccl: Any, nranks: int, rank: int, uid: bytes) -> None:
        self.comm: Any = None
        self.error: BaseException | None = None
        self.abandoned = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(
            target=self._run, args=(nccl, nranks, rank, uid), name="ftmesh-nccl-init", daemon=True
        )
        self._thread.start()

    def _run(self, nccl: Any, nranks: int, rank: int, uid: bytes) -> None:
        try:
            comm = nccl.NcclCommunicator(nranks, uid, rank)
        except BaseException as exc:  # reported through async_error
            self.error = exc
            return
        with self._lock:
            if self.abandoned:
                with contextlib.suppress(Exception):
                    comm.abort()
                return
            self.comm = comm

    def abandon(self) -> bool:
        """Give the init up; True if it had finished (``comm`` is then the caller's)."""
        with self._lock:
            self.abandoned = self.comm is None
            return not self.abandoned


class CupyDriver:
    """CuPy's ``cupy.cuda.nccl``: blocking communicators (see the module doc)."""

    nonblocking = False

    def __init__(self) -> None:
        from cupy.cuda import nccl  # optional dependency

        if not getattr(nccl, "available", True):
            raise NcclUnavailableError("CuPy was built without NCCL")
        import cupy

        self._nccl = nccl
        self._bytes_ids = int(cupy.__version__.split(".")[0]) >= 14  # CuPy <= 13: tuples
        self.abandoned_inits = 0

    def version(self) -> int:
        return int(self._nccl.get_version())

    def unique_id(self) -> bytes:
        uid = self._nccl.get_unique_id()
        return uid if isinstance(uid, bytes) else bytes(b & 0xFF for b in uid)

    def init(self, nranks: int, rank: int, uid: bytes) -> Any:
        raw: Any = uid if self._bytes_ids else tuple(b - 256 if b > 127 else b for b in uid)
        return _PendingInit(self._nccl, nranks, rank, raw)

    def async_error(self, handle: Any) -> int:
        if isinstance(handle, _PendingInit):
            if handle.error is not None:
                return _code_of(handle.error)
            return 0 if handle.comm is not None else IN_PROGRESS
        try:
            handle.check_async_error()
        except Exception as exc:  # NcclError, or KeyError for codes CuPy does not list
            return _code_of(exc)
        return 0

    def error_string(self, handle: Any, code: int) -> str:
        if isinstance(handle, _PendingInit) and handle.error is not None:
            return repr(handle.error)
        return f"NCCL error {code}"

    def collective(self, handle: Any, op: GpuCall, buf: DeviceBuffer) -> None:
        dt = NCCL_DTYPES[buf.dtype]
        if op.kind is Kind.ALLREDUCE:
            handle.allReduce(buf.ptr, buf.ptr, buf.count, dt, NCCL_OPS[op.op], buf.stream)
        else:
            handle.bcast(buf.ptr, buf.count, dt, op.root, buf.stream)

    def abort_group(self, handles: Sequence[Any]) -> None:
        comms = []
        for h in handles:
            if isinstance(h, _PendingInit):
                if not h.abandon():
                    self.abandoned_inits += 1
                    continue
                h = h.comm
            comms.append(h)
        grouped = len(comms) > 1 and self.version() >= GROUP_ABORT_VERSION
        if grouped:
            self._nccl.groupStart()
        try:
            for c in comms:
                c.abort()
        finally:
            if grouped:
                self._nccl.groupEnd()


def _code_of(exc: BaseException) -> int:
    if isinstance(exc, KeyError) and exc.args and isinstance(exc.args[0], int):
        return int(exc.args[0])
    status = getattr(exc, "status", None)
    return int(status) if isinstance(status, int) else 3  # ncclInternalError


class NcclCommunicator:
    """``epochs.Communicator`` on a driver handle (see the module doc)."""

    def __init__(self, driver: NcclDriver, handle: Any) -> None:
        self._driver = driver
        self.handle = handle
        self._lock = threading.Lock()
        self._aborted = False
        self._event: Any = None
        self._enqueued = False

    def _check(self) -> int:
        if self._aborted:
            raise CommFailure(ABORTED, "communicator aborted")
        code = self._driver.async_error(self.handle)
        if code not in (0, IN_PROGRESS):
            raise CommFailure(code, self._driver.error_string(self.handle, code))
        return code

    def ready(self) -> bool:
        with self._lock:
            if self._check() != 0:
                return False
            if isinstance(self.handle, _PendingInit):
                self.handle = self.handle.comm
            return True

    def start(self, op: GpuCall) -> None:
        buf = device_buffer(op.buffer)
        if not nccl_supports(buf.dtype, op.op):
            raise LocalUsageError(f"NCCL cannot {op.op} {buf.dtype}: use staging")
        lock = self._lock if self._driver.nonblocking else contextlib.nullcontext()
        with lock:
            if self._aborted:
                raise CommFailure(ABORTED, "communicator aborted")
            self._driver.collective(self.handle, op, buf)
            self._event = _event_after(buf)

    def done(self) -> bool:
        with self._lock:
            if self._check() == IN_PROGRESS:
                return False  # non-blocking enqueue still in progress
            return self._event is None or bool(self._event.query())

    def abort_handles(self) -> Any:
        """Mark aborted and return the handle to abort (None if already aborted)."""
        if self._aborted:
            return None
        self._aborted = True
        return self.handle


class NcclFactory:
    """``epochs.CommFactory`` for NCCL (the driver: nccl4py if importable, else CuPy)."""

    name = "nccl"

    def __init__(self, driver: NcclDriver | None = None) -> None:
        self.driver = driver or load_driver()

    def unique_id(self) -> bytes:
        return self.driver.unique_id()

    def create(self, view: RingView, node_id: str, uid: bytes) -> NcclCommunicator:
        handle = self.driver.init(view.size, view.rank_of(node_id), uid)
        return NcclCommunicator(self.driver, handle)

    def abort_group(self, comms: Sequence[Any]) -> None:
        mine = [c for c in comms if isinstance(c, NcclCommunicator)]
        with contextlib.ExitStack() as stack:
            for c in sorted(mine, key=id):  # one lock order: no deadlock between aborters
                stack.enter_context(c._lock)
            handles = [h for h in (c.abort_handles() for c in mine) if h is not None]
            if handles:
                self.driver.abort_group(handles)


def load_driver(prefer: str = "") -> NcclDriver:
    """nccl4py's driver if it imports, else CuPy's; ``prefer`` (``nccl4py``/``cupy``) forces
    one. Raises ``NcclUnavailableError`` naming what failed."""
    errors = []
    order = [prefer] if prefer else ["nccl4py", "cupy"]
    for name in order:
        try:
            return Nccl4pyDriver() if name == "nccl4py" else CupyDriver()
        except (ImportError, OSError, NcclUnavailableError) as exc:
            errors.append(f"{name}: {exc}")
    raise NcclUnavailableError("no NCCL binding: " + "; ".join(errors))
