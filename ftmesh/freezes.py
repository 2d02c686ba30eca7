"""Noticing that this whole process stood still: fail-slow members (#15 item 4).

Theory of operation. A fail-slow member is not slow all the time: it freezes now and then
for hundreds of milliseconds (a host that stalls, a process stopped and continued, a VM's
steal time, swapping). Its compute speed barely shows it, but every freeze that lands in a
collective stops the ring for everyone. :class:`FreezeWatch` is a daemon thread that wakes
every ``tick`` seconds and records a *freeze* whenever it woke more than ``threshold`` late:
while the process is stopped no thread runs, so the first tick after it continues sees the
gap (time.monotonic keeps counting). The step machine gets the freeze seconds of each step
(``Computed.frozen``) and decides what to do (``ftmesh.training.step``: a member that froze
in ``failslow_freezes`` of its last ``straggler_steps`` steps steps out of the ring for
``failslow_pause`` seconds). A Python thread that holds the GIL for longer than
``threshold`` (a long pure-Python pause such as a large garbage collection) counts too: it
stalls the member's collectives just the same.
"""

from __future__ import annotations

import threading
import time
from collections import deque

TICK_S = 0.01
"""How often the watch wakes; freezes shorter than the threshold go unnoticed."""
KEPT = 256
"""Freezes remembered (the oldest are forgotten)."""


class FreezeWatch:
    """See the module docstring. ``start()`` it once; :meth:`frozen_since` is thread-safe."""

    def __init__(self, threshold: float, tick: float = TICK_S) -> None:
        self.threshold = threshold
        self.tick = tick
        self._freezes: deque[tuple[float, float]] = deque(maxlen=KEPT)
        """(end, seconds) of each freeze, on the ``time.monotonic`` clock."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.total_seconds = 0.0
        self.count = 0

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
                self._freezes.append((now, late))
                self.count += 1
                self.total_seconds += late
            last = now

    def frozen_since(self, since: float) -> float:
        """Seconds this process stood still in freezes that ended after ``since``
        (``time.monotonic``)."""
        return sum(s for end, s in list(self._freezes) if end > since)
