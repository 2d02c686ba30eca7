"""Blocking facade over :class:`ftmesh.mesh.core.Mesh` for training loops not written in trio.

Theory of operation: :meth:`SyncMesh.start` runs ``open_mesh`` inside ``trio.run`` on a private
daemon thread and waits until the member has joined. Each blocking call is handed to that
thread with ``trio.from_thread.run`` and waits for its result; exceptions travel back
unchanged. Collectives on a given view run on its ``ViewSession`` (``session(view)``,
``ftmesh.collective.session``), which skips trio once the view's ring is open
(``Mesh.ring_in_use``): it drives the ring's sockets straight from the caller's thread, or,
when submitted, from one job thread that runs them in submission order.
``close()`` (or leaving the ``with`` block) leaves the mesh gracefully and joins the thread,
bounded by a timeout.

Errors: an error that keeps the mesh from starting is raised by :meth:`SyncMesh.start` (and
``connect()``) itself when it is an ``FtmeshError`` (say a ``ConfigError`` naming the port
that is taken), not wrapped in the exception group trio collected it in. An error that ends a
running mesh is kept, and every later call raises ``MeshClosedError`` saying it, with it as
the ``__cause__``.

Planned departures: ``request_leave()`` only raises a flag (safe from signal handlers and any
thread); whoever drives the training loop reads ``leave_requested()`` at its step boundaries
and leaves (``ElasticTrainer`` does, see ``ftmesh.torch.trainer``). :func:`connect`, called
from the main thread, installs SIGTERM/SIGINT handlers that request it
(:func:`handle_leave_signals`, chained to the program's own; ``handle_signals=False`` leaves
them alone): a worker that is PID 1 of a container, where signals without a handler are
ignored, leaves as well as any other; a second signal leaves at once, unwinding normally.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import trio

from ..collective import CollectiveResult, RingView
from ..collective.jobs import JobThread
from ..collective.reach import Exclusion
from ..collective.session import GpuPath, Host, ViewSession, is_device_buffer
from ..collective.transport import Ring
from ..errors import ConfigError, FtmeshError, LocalUsageError, MeshClosedError
from ..membership.messages import MemberSnapshot, Meta
from ..settings import Settings
from ..state import Lookup, Snapshot, TransferStats
from ..training.start import StartConfig
from .core import Mesh, MeshConfig, open_mesh
from .meta import Progress

if TYPE_CHECKING:  # the GPU path, imported by enable_gpu: a CPU member never loads it
    from ..collective.backend import DeviceInfo
    from ..collective.epochs import CommFactory, EpochConfig

T = TypeVar("T")


def root_cause(exc: BaseException) -> BaseException:
    """The error an exception group stands for: its first ``FtmeshError``, else its first
    leaf that is not a cancellation (trio groups the errors of a nursery's tasks)."""
    if not isinstance(exc, BaseExceptionGroup):
        return exc
    leaves = [root_cause(e) for e in exc.exceptions]
    for leaf in leaves:
        if isinstance(leaf, FtmeshError):
            return leaf
    return next((e for e in leaves if not isinstance(e, trio.Cancelled)), leaves[0])


class SyncMesh:
    """Blocking twin of :class:`Mesh`. Create with :meth:`start` or :func:`ftmesh.connect`."""

    start_config: StartConfig = StartConfig()
    """How a trainer on this mesh starts (``start_peers`` ...) when it is not told; set by
    ``connect()`` from its arguments and the environment."""

    def __init__(self) -> None:
        self._mesh: Mesh | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._jobs = JobThread("ftmesh-collectives")
        self._host: Host | None = None
        self._gpu: GpuPath | None = None
        self._leave_flag = False
        self._waking_progress = False  # a wake-up of the progress publisher is on its way
        self._leave_event = threading.Event()  # set from the trio thread (signal safety)
        self._restore_signals: Callable[[], None] | None = None

    @classmethod
    def start(cls, config: MeshConfig | None = None, start_timeout: float = 30.0) -> SyncMesh:
        self = cls()

        async def main() -> None:
            try:
                async with open_mesh(config) as mesh:
                    self._mesh = mesh
                    self._token = trio.lowlevel.current_trio_token()
                    self._stop = trio.Event()
                    self._ready.set()
                    await self._stop.wait()
            except BaseException as exc:
                self._error = exc
                raise
            finally:
                self._ready.set()

        def thread_main() -> None:
            with contextlib.suppress(BaseException):  # reported through self._error
                trio.run(main)

        self._thread = threading.Thread(target=thread_main, name="ftmesh-mesh", daemon=True)
        self._thread.start()
        if not self._ready.wait(start_timeout):
            raise MeshClosedError(f"mesh did not start within {start_timeout}s")
        if self._error is not None or self._mesh is None:
            cause = None if self._error is None else root_cause(self._error)
            if isinstance(cause, FtmeshError):
                raise cause
            raise MeshClosedError(f"mesh failed to start: {cause!r}") from cause
        return self

    def _closed(self) -> MeshClosedError:
        """The error for a call on a mesh that is not running, with what ended it."""
        if self._error is None:
            return MeshClosedError("the mesh is closed")
        cause = root_cause(self._error)
        err = MeshClosedError(f"the mesh stopped: {type(cause).__name__}: {cause}")
        err.__cause__ = cause
        return err

    @property
    def mesh(self) -> Mesh:
        if (
            self._error is not None
            or self._mesh is None
            or self._stop is None
            or self._stop.is_set()
        ):
            raise self._closed()
        return self._mesh

    @property
    def node_id(self) -> str:
        return self.mesh.node_id

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``await fn(*args)`` in the mesh's trio thread and return its result."""
        self.mesh  # noqa: B018 - raises if closed
        try:
            return trio.from_thread.run(fn, *args, trio_token=self._token)
        except (trio.RunFinishedError, trio.Cancelled):  # closed meanwhile, maybe by an error
            closed = self._closed()
            raise closed from closed.__cause__

    def submit(self, fn: Callable[..., Awaitable[T]], *args: Any) -> Future[T]:
        """Queue ``await fn(*args)`` in the mesh's trio thread without waiting; the returned
        future completes with its result or exception. Submitted calls (these and
        ``ViewSession.submit``) run one at a time, in submission order: members must issue their
        collectives in the same order."""
        self.mesh  # noqa: B018 - raises if closed
        return self._jobs.submit(self.call, fn, *args)

    def session(self, view: RingView | None = None) -> ViewSession:
        """The collectives of ``view`` (default: the current view), as a ``ViewSession``:
        blocking calls and ``submit``, on the backend the view and each buffer call for. The
        one way to run a collective on exactly a given view from a thread."""
        if view is None:
            view = self.view()
            if view is None or self.node_id not in view:
                raise ConfigError(f"{self.node_id} is not a training member of the mesh")
        return ViewSession(view, self._session_host(), self._gpu)

    def _session_host(self) -> Host:
        if self._host is None:
            mesh = self.mesh

            def open_ring(view: RingView) -> Ring:
                return self.call(mesh.open_ring, view)

            def peer_lost(peer: str) -> None:
                self.call_sync(mesh.node.report_unreachable, peer)

            self._host = Host(mesh.data_plane, self._jobs, mesh.ring_in_use, open_ring, peer_lost)
        return self._host

    @property
    def gpu(self) -> GpuPath | None:
        """The GPU path of this member's sessions, once ``enable_gpu`` gave it one."""
        return self._gpu

    def enable_gpu(
        self,
        *,
        factory: CommFactory | None = None,
        devices: DeviceInfo | None = None,
        config: EpochConfig | None = None,
        is_device: Callable[[Any], bool] = is_device_buffer,
    ) -> GpuPath:
        """Give this member's sessions a GPU path: advertise ``devices`` (default: probed),
        build one communicator per view epoch on ``factory`` (default: torch's
        ``ProcessGroupNCCL``, ``mesh.gpu.torch_factory``; a view whose members cannot all
        run it stages), chosen per view by its root from every member's devices, and follow
        membership (a member suspected or gone aborts the GPU collectives that wait for it)."""
        if self._gpu is not None:
            raise LocalUsageError("the GPU path is enabled already")
        from .gpu import enable_gpu

        self._gpu = enable_gpu(self, factory, devices, config, is_device)
        return self._gpu

    def call_sync(self, fn: Callable[..., T], *args: Any) -> T:
        """Run the non-blocking ``fn(*args)`` in the mesh's trio thread."""
        self.mesh  # noqa: B018 - raises if closed
        try:
            return trio.from_thread.run_sync(fn, *args, trio_token=self._token)
        except trio.RunFinishedError:
            closed = self._closed()
            raise closed from closed.__cause__

    def view(self) -> RingView | None:
        return self.call_sync(self.mesh.view)

    def exclusions(self) -> dict[str, Exclusion]:
        """The training members the ring leaves out now (``Mesh.exclusions``)."""
        return self.call_sync(self.mesh.exclusions)

    def members(self) -> list[MemberSnapshot]:
        return self.call_sync(self.mesh.node.members)

    def wait_view(
        self, *, min_members: int = 1, settle: float = 0.0, timeout: float = 60.0
    ) -> RingView:
        """See :meth:`Mesh.wait_view`. Without ``settle``, a view that collectives already run
        on (``Mesh.view_in_use``) is returned straight away, from this thread."""
        view = self.mesh.view_in_use() if settle == 0 else None
        if view is not None and view.size >= min_members and self.node_id in view:
            return view

        async def wait() -> RingView:
            return await self.mesh.wait_view(
                min_members=min_members, settle=settle, timeout=timeout
            )

        return self.call(wait)

    def set_role(self, role: str) -> None:
        self.call_sync(self.mesh.set_role, role)

    @property
    def role(self) -> str:
        return self.call_sync(lambda: self.mesh.role)

    def report_offence(self, node: str, detail: str) -> None:
        """Member ``node`` sent numbers that fail the step header's checks: one strike towards
        leaving it out (``ftmesh.collective.reach``, like a frame that fails verification).
        Never blocks (any thread)."""
        self.mesh.reach.bad_header(node, detail)

    def report_progress(self, progress: Progress) -> None:
        """Publish our training progress (see :meth:`Mesh.report_progress`), e.g. after each
        committed step. Never blocks: it hands ``progress`` to the mesh's thread, from any
        thread; publishing is rate limited there (``MeshConfig.progress_interval``), and so
        are the wake-ups of that thread (:meth:`Mesh.keep_progress`)."""
        mesh = self.mesh
        assert self._token is not None  # (set with _mesh)
        if not mesh.keep_progress(progress) or self._waking_progress:
            return
        self._waking_progress = True

        def wake() -> None:  # (the mesh's thread)
            mesh.wake_progress()
            self._waking_progress = False

        try:
            self._token.run_sync_soon(wake)
        except trio.RunFinishedError:
            closed = self._closed()
            raise closed from closed.__cause__

    def wait_quiet(
        self,
        settle: float,
        timeout: float = 60.0,
        until: Callable[[list[MemberSnapshot]], bool] | None = None,
    ) -> None:
        """See :meth:`Mesh.wait_quiet` (``until`` is called in the mesh's thread)."""
        self.call(self.mesh.wait_quiet, settle, timeout, until)

    def allreduce(self, x: T, op: str = "sum", compression: Any = None) -> CollectiveResult[T]:
        """See :meth:`Mesh.allreduce`; ``compression``: ``"int8"`` or an ``Int8Compression``
        (``DataPlane.allreduce``)."""
        return self._jobs.run(self.call, self.mesh.allreduce, x, op, compression)

    def reduce_scatter(self, x: T, op: str = "sum") -> CollectiveResult[T]:
        return self._jobs.run(self.call, self.mesh.reduce_scatter, x, op)

    def allgather(self, x: T) -> CollectiveResult[T]:
        return self._jobs.run(self.call, self.mesh.allgather, x)

    def broadcast(self, x: T, root: str) -> CollectiveResult[T]:
        return self._jobs.run(self.call, self.mesh.broadcast, x, root)

    def barrier(self) -> CollectiveResult[None]:
        return self._jobs.run(self.call, self.mesh.barrier)

    def serve_state(self, source: Lookup) -> tuple[str, int]:
        """See :meth:`Mesh.serve_state`; ``source`` is called from the mesh's thread."""
        return self.call(self.mesh.serve_state, source)

    def fetch_state(
        self,
        holders: Sequence[str],
        step: int,
        digest: str,
        stats: TransferStats | None = None,
        buffer: np.ndarray[Any, np.dtype[np.uint8]] | None = None,
    ) -> Snapshot:
        """See :meth:`Mesh.fetch_state`."""
        return self.call(self.mesh.fetch_state, holders, step, digest, stats, buffer)

    def advertise_state(self, nbytes: int) -> None:
        """See :meth:`Mesh.advertise_state`."""
        self.call_sync(self.mesh.advertise_state, nbytes)

    def advertised_state_bytes(self) -> int:
        """See :meth:`Mesh.advertised_state_bytes`."""
        return self.call_sync(self.mesh.advertised_state_bytes)

    def register_statistics(self, name: str, source: Callable[[], object]) -> None:
        """Have the metrics exporter read ``source()`` (a snapshot such as
        ``ftmesh.stats.TrainerStatistics``) at scrape time, in the mesh's thread."""
        self.call_sync(self.mesh.node.statistics_sources.__setitem__, name, source)

    def drop_view(self, view: RingView) -> None:
        """Reconnect ``view``'s ring before its next collective; see ``DataPlane.drop_view``."""
        self.call_sync(self.mesh.data_plane.drop_view, view.epoch)

    def wait_view_change(self, epoch: str, timeout: float) -> RingView | None:
        """Block until the view's epoch differs from ``epoch`` (or ``timeout`` seconds);
        returns the view then."""

        async def wait() -> RingView | None:
            with trio.move_on_after(timeout):
                while (v := self.mesh.view()) is None or v.epoch == epoch:
                    await self.mesh.view_changed()
            return self.mesh.view()

        return self.call(wait)

    def request_leave(self) -> None:
        """Ask this member to leave the mesh at its next step boundary (see the module
        docstring). Thread-safe, and safe to call from a signal handler: it sets a flag and
        hands the rest to the mesh's trio thread."""
        self._leave_flag = True
        if self._token is not None:
            with contextlib.suppress(trio.RunFinishedError):
                self._token.run_sync_soon(self._leave_event.set)

    def leave_requested(self) -> bool:
        """Whether ``request_leave()`` was called (or a leave signal came)."""
        return self._leave_flag

    def wait_leave_requested(self, timeout: float | None = None) -> bool:
        """Block until a leave is requested (True) or ``timeout`` seconds pass (False): for
        a process that has nothing left to do but must stay up until it is told to go."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._leave_flag:
            left = FLAG_POLL_S if deadline is None else deadline - time.monotonic()
            if left <= 0:
                return False
            # (The flag alone, once the trio thread that sets the event has ended.)
            self._leave_event.wait(min(left, FLAG_POLL_S))
        return True

    def close(self, join_timeout: float = 10.0) -> None:
        self._jobs.close(0)  # refuse new collectives; closing the mesh ends running ones
        if self._stop is not None and self._token is not None and not self._stop.is_set():
            with contextlib.suppress(trio.RunFinishedError):
                trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
        if self._thread is not None:
            self._thread.join(join_timeout)
        self._jobs.close(join_timeout)
        if self._gpu is not None:
            self._gpu.manager.close()
        restore, self._restore_signals = self._restore_signals, None
        if restore is not None:
            restore()

    def __enter__(self) -> SyncMesh:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


LEAVE_SIGNALS = (signal.SIGTERM, signal.SIGINT)
REPEAT_AFTER_S = 1.0
"""A second stop signal counts as *again* (leave now) only this long after the first: one stop
often arrives twice within milliseconds (``timeout`` signals its command and then the
command's process group; systemd, Docker and shells signal whole groups too), and a stop
delivered twice must not skip the planned departure. ``ftmesh launch`` uses the same rule."""
FLAG_POLL_S = 0.25
"""How often ``wait_leave_requested`` looks at the flag when the trio thread cannot wake it."""


def handle_leave_signals(mesh: SyncMesh) -> bool:
    """Make SIGTERM and SIGINT ask ``mesh`` to leave (``request_leave``), then call the handler
    that was there before if it is the program's own (a callable other than Python's
    ``KeyboardInterrupt`` default): a host's SLURM requeue or cleanup handler still runs. A
    second one (``REPEAT_AFTER_S`` or more after the first; one sooner is the same stop
    delivered twice, and ignored) leaves through normal unwinding, at once:
    ``KeyboardInterrupt`` for SIGINT,
    ``SystemExit(128 + signal number)`` for SIGTERM, raised in the main thread, so the
    program's ``finally`` and ``with`` blocks run. ``mesh.close()`` puts the previous handlers
    back. Only from the main thread (Python delivers signals there): returns whether the
    handlers were installed."""
    if threading.current_thread() is not threading.main_thread():
        return False
    previous = {sig: signal.getsignal(sig) for sig in LEAVE_SIGNALS}
    first: list[float] = []  # when the first stop signal came

    def on_signal(signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if mesh.leave_requested():
            if first and time.monotonic() - first[0] < REPEAT_AFTER_S:
                return  # the same stop, delivered twice
            os.write(2, f"ftmesh: {name} again: leaving now\n".encode())
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise SystemExit(128 + signum)
        first.append(time.monotonic())
        mesh.request_leave()
        note = f"ftmesh: {name}: leaving the mesh at the next step ({name} again: leave now)\n"
        os.write(2, note.encode())
        chained = previous[signal.Signals(signum)]
        if callable(chained) and chained is not signal.default_int_handler:
            chained(signum, frame)

    for sig in LEAVE_SIGNALS:
        signal.signal(sig, on_signal)

    def restore() -> None:
        if threading.current_thread() is threading.main_thread():
            for sig, handler in previous.items():
                if signal.getsignal(sig) is on_signal:
                    signal.signal(sig, handler)

    mesh._restore_signals = restore
    return True


def connect(
    *,
    mesh: str | None = None,
    discovery: str | None = None,
    join: Sequence[str] | None = None,
    interface: str | None = None,
    bind: str | None = None,
    advertise: str | None = None,
    port: int | None = None,
    data_port: int | None = None,
    state_port: int | None = None,
    site: str | None = None,
    preset: str | None = None,
    secret_file: str | None = None,
    encrypt: bool | None = None,
    registry_dir: str | None = None,
    name: str | None = None,
    meta: Meta | None = None,
    start_peers: int | None = None,
    start_timeout: float | None = None,
    metrics_port: int | None = None,
    log_level: str | None = None,
    log_format: str | None = None,
    role: str = "train",
    open_timeout: float = 30.0,
    environ: Mapping[str, str] | None = None,
    handle_signals: bool = True,
) -> SyncMesh:
    """Join a training mesh from a plain (non-trio) program; the usual entry point of a
    training script started by ``ftmesh launch`` or ``ftmesh worker``.

    The arguments are the settings of ``ftmesh.settings.Settings`` (the same names as the
    flags of ``ftmesh worker``). Each one left as ``None`` comes from the environment those
    commands set (``FTMESH_MESH``, ``FTMESH_PORT``, ...; ``environ``, default
    ``os.environ``), then from the defaults: mesh ``default``, ``local`` discovery (``seeds``
    when seeds are given), the ``lan`` preset. Explicit arguments always win, and an empty
    string is a value, not "unset". ``start_peers`` and ``start_timeout`` are kept on the
    returned mesh (``SyncMesh.start_config``) for the ``ElasticTrainer`` made on it.
    ``metrics_port`` serves Prometheus metrics (``ftmesh.metrics``); ``log_level`` and
    ``log_format``, when given (or set in the environment by ``ftmesh worker``/``launch``),
    set up ftmesh's log (``ftmesh.logs``). ``open_timeout``: seconds to wait for the mesh to
    start.

    Raises the ``FtmeshError`` that keeps the mesh from starting (a ``ConfigError`` naming
    the setting at fault and the fix).

    Called from the main thread with ``handle_signals`` (the default), it also makes SIGTERM
    and SIGINT a planned departure (:func:`handle_leave_signals`, undone by ``close()``),
    calling the program's own handlers after it. ``handle_signals=False`` leaves every signal
    handler alone, for a host that owns them (Lightning, Ray, a notebook): call
    ``mesh.request_leave()`` from its handler for a planned departure.
    """
    settings = Settings.from_env(os.environ if environ is None else environ).replace(
        mesh=mesh,
        discovery=discovery,
        join=join,
        interface=interface,
        bind=bind,
        advertise=advertise,
        port=port,
        data_port=data_port,
        state_port=state_port,
        site=site,
        preset=preset,
        secret_file=secret_file,
        encrypt=encrypt,
        registry_dir=registry_dir,
        name=name,
        meta=meta,
        start_peers=start_peers,
        start_timeout=start_timeout,
        metrics_port=metrics_port,
        log_level=log_level,
        log_format=log_format,
    )
    if settings.log_level is not None or settings.log_format is not None:
        settings.configure_logging()
    start = settings.start_config()
    synced = SyncMesh.start(settings.mesh_config(role), start_timeout=open_timeout)
    synced.start_config = start
    if handle_signals:
        handle_leave_signals(synced)
    return synced
