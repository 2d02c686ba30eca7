"""Run blocking jobs one at a time, in order, on a private thread or inline in the caller.

Theory of operation: :meth:`JobThread.submit` queues a job and returns a future; one daemon
thread runs the queue in submission order. :meth:`JobThread.run` runs a job in the calling
thread instead, once every job submitted before it has finished: a caller that submits a few
jobs and then needs one more right away (the last gradient bucket of a backward pass) saves
the two thread hand-offs of a queued job. A lock makes sure only one job runs at a time,
whichever thread runs it. The thread starts with the first submitted job.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future, wait
from typing import Any, TypeVar

from ..errors import MeshClosedError

T = TypeVar("T")
_Job = tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]


class JobThread:
    """Ordered job runner; see the module doc."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._running = threading.RLock()
        self._guard = threading.Lock()  # guards _last, _thread, _closed
        self._last: Future[Any] | None = None
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Queue ``fn(*args)``; the future completes with its result or exception."""
        fut: Future[T] = Future()
        with self._guard:
            if self._closed:
                raise MeshClosedError(f"{self._name} is closed")
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name=self._name, daemon=True)
                self._thread.start()
            self._last = fut
            self._queue.put((fut, fn, args))
        return fut

    def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` in this thread after the jobs submitted before it; called from
        the job thread itself (a job, or a future's done-callback), it runs at once."""
        with self._guard:
            if self._closed:
                raise MeshClosedError(f"{self._name} is closed")
            last = self._last
        if last is not None and threading.current_thread() is not self._thread:
            wait([last])  # its result or error belongs to whoever holds its future
        with self._running:
            return fn(*args)

    def _serve(self) -> None:
        while (job := self._queue.get()) is not None:
            fut, fn, args = job
            if not fut.set_running_or_notify_cancel():
                continue
            with self._running:
                try:
                    result, error = fn(*args), None
                except BaseException as exc:  # the future carries it to the caller
                    result, error = None, exc
            # Outside the lock: done-callbacks may run jobs of their own.
            if error is None:
                fut.set_result(result)
            else:
                fut.set_exception(error)

    def close(self, timeout: float = 10.0) -> None:
        """Refuse new jobs, let the queued ones finish (waiting at most ``timeout``: 0 just
        refuses). May be called again."""
        with self._guard:
            if not self._closed:
                self._queue.put(None)
            self._closed = True
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
