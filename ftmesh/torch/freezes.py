"""Noticing that this whole process stood still: fail-slow members (#15 item 4).

Theory of operation. A fail-slow member is not slow all the time: it freezes now and then
for hundreds of milliseconds (a host that stalls, a process stopped and continued, a VM's
steal time, swapping). Its compute speed barely shows it, but every freeze that lands in a
collective stops the ring for everyone. :class:`FreezeWatch` is a daemon thread that wakes
every ``tick`` seconds and records a *freeze* whenever it woke more than ``threshold`` late:
while the process is stopped no thread runs, so the first tick after it continues sees the
gap (time.monotonic keeps counting). The step machine gets the freeze seconds since the
last committed step (``Computed.frozen``: a freeze between two steps, or one noticed only
after the step ended, counts for the next one) and decides what to do
(``ftmesh.training.pace``: a member that froze in ``failslow_freezes`` of its last
``straggler_steps`` steps steps out of the ring for ``failslow_pause`` seconds). A Python
thread that holds the GIL for longer than ``threshold`` (a long pure-Python pause such as a
large garbage collection) counts too: it stalls the member's collectives just the same.
"""

from __future__ import annotations

import threading
import time

TICK_S = 0.05
"""How often the watch wakes (a tick needs the GIL: at 10 ms it cost a small step up to
10 %); freezes shorter than the threshold go unnoticed."""


class FreezeWatch:
    """See the module docstring. ``start()`` it once; one caller takes the freezes
    (:meth:`take`)."""

    def __init__(self, threshold: float, tick: float = TICK_S) -> None:
        self.threshold = threshold
        self.tick = tick
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.total_seconds = 0.0
        """Seconds stood still in all (written by the watch thread only)."""
        self.count = 0
        """Freezes noticed."""
        self._taken = 0.0

    def start(self) -> FreezeWatch:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="ftmesh-freezes", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(self.tick):
            now = time.monotonic()
            late = now - last - self.tick
            if late > self.threshold:
                self.count += 1
                self.total_seconds += late
            last = now

    def take(self) -> float:
        """Seconds stood still since the last call (every freeze counts once, wherever it
        fell: in a step, between two steps, or just before the call, when this thread had
        yet to notice it)."""
        total = self.total_seconds
        taken, self._taken = total - self._taken, total
        return taken
