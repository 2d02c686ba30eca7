"""Publishing that this member is busy between steps (the user's time, #25).

Theory of operation. The time between two steps belongs to the user: evaluating, saving,
logging. Meanwhile the others' next collective waits for this member's first frame, up to
``CollectiveConfig.start_wait`` (``ftmesh.collective.engine``, which logs whom it waits for).
So that ``ftmesh status --watch`` and ``ftmesh launch``'s view show why the mesh stands
still, :class:`BetweenSteps`, a daemon thread started at the first step, publishes this
member's progress with the fault text ``between steps 35s (after step 12)`` once the user's
code between steps has run for ``after`` seconds, and again every ``every`` seconds while it
lasts; the next committed step's progress replaces it. While steps run the thread sleeps on a
condition: the training thread pays one lock and one notify per step.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

BETWEEN_AFTER_S = 5.0
"""Seconds of user code between steps before it is published (shorter pauses are normal)."""
BETWEEN_EVERY_S = 15.0
"""Seconds between two publications of the same pause (each is a metadata change that every
member gossips)."""


def between_text(seconds: float, step: int) -> str:
    """The fault text a member busy between steps publishes."""
    return f"between steps {seconds:.0f}s (after step {step})"


class BetweenSteps:
    """See the module docstring. ``publish(seconds, step)`` runs in this class's thread and
    must not block (``SyncMesh.report_progress`` does not)."""

    def __init__(
        self,
        publish: Callable[[float, int], None],
        after: float = BETWEEN_AFTER_S,
        every: float = BETWEEN_EVERY_S,
    ) -> None:
        self._publish = publish
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
            self._since = None

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
