"""Publishing that this member is busy between steps (the user's time, #25).

Theory of operation. The time between two steps belongs to the user: evaluating, saving,
logging. Meanwhile the others' next collective waits for this member's first frame, up to
``CollectiveConfig.start_wait`` (``ftmesh.collective.engine``, which logs whom it waits for).
So that ``ftmesh status --watch`` and ``ftmesh launch``'s view show why the mesh stands
still, :class:`BetweenSteps`, a daemon thread started at the first step, publishes this
member's progress with the fault text ``between steps 35s (after step 12)`` once the user's
code between steps has run for ``after`` seconds, and again every ``every`` seconds while it
lasts; when the next step begins, the plain progress is published again (``resume``). That
text is also what makes the ring neighbours wait for this member's next collective past their
``io_timeout`` (``Mesh.busy_between_steps``, ``CollectiveConfig.start_wait``): a member that
says nothing (a broken link, a frozen process) is judged by ``io_timeout`` as before. While
steps run the thread sleeps on a condition: the training thread pays one lock and one notify
per step.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ..mesh.meta import BETWEEN_STEPS

BETWEEN_AFTER_S = 1.0
"""Seconds of user code between steps before it is published: well inside the data plane's
``io_timeout`` (10 s in a mesh), which a waiting neighbour allows before it must know; one
more metadata change per longer pause, and one when it ends."""
BETWEEN_EVERY_S = 15.0
"""Seconds between two publications of the same pause (each is a metadata change that every
member gossips)."""


def between_text(seconds: float, step: int) -> str:
    """The fault text a member busy between steps publishes."""
    return f"{BETWEEN_STEPS} {seconds:.0f}s (after step {step})"


class BetweenSteps:
    """See the module docstring. ``publish(seconds, step)`` runs in this class's thread,
    ``resume()`` in the caller of :meth:`leave` after a published pause; neither may block
    (``SyncMesh.report_progress`` does not)."""

    def __init__(
        self,
        publish: Callable[[float, int], None],
        resume: Callable[[], None],
        after: float = BETWEEN_AFTER_S,
        every: float = BETWEEN_EVERY_S,
    ) -> None:
        self._publish = publish
        self._resume = resume
        self._after = after
        self._every = every
        self._cv = threading.Condition()
        self._since: float | None = None
        self._step = 0
        self._published = 0
        self._stopped = False
        self._thread: threading.Thread | None = None
        self.publications = 0
        """Pauses published (each publication counts)."""

    def enter(self, step: int) -> None:
        """The user's time starts, after committed step ``step``."""
        with self._cv:
            if self._thread is None and not self._stopped:
                self._thread = threading.Thread(
                    target=self._run, name="ftmesh-between", daemon=True
                )
                self._thread.start()
            self._since, self._step, self._published = time.monotonic(), step, 0
            self._cv.notify()

    def leave(self) -> None:
        """The next step starts (the trainer's time)."""
        with self._cv:
            published = self._since is not None and self._published > 0
            self._since = None
            if published:
                self._resume()

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout=1.0)

    def _run(self) -> None:
        with self._cv:
            while not self._stopped:
                if self._since is None:
                    self._cv.wait()
                    continue
                due = self._since + self._after + self._published * self._every
                now = time.monotonic()
                if now < due:
                    self._cv.wait(due - now)
                    continue
                self._published += 1
                self.publications += 1
                self._publish(now - self._since, self._step)
