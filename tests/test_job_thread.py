"""``JobThread``: submitted jobs run one at a time in submission order on one thread; ``run``
runs in the caller's thread after them; errors travel in the futures."""

from __future__ import annotations

import threading
import time

import pytest

from ftmesh.collective.jobs import JobThread
from ftmesh.errors import MeshClosedError


def test_jobs_run_in_order_one_at_a_time_and_run_waits_for_them() -> None:
    jobs = JobThread("test-jobs")
    log: list[tuple[str, int]] = []
    busy = threading.Lock()

    def job(i: int) -> int:
        assert busy.acquire(blocking=False), "two jobs ran at once"
        try:
            time.sleep(0.01 * (5 - i))  # early jobs are slow: order must not depend on speed
            log.append((threading.current_thread().name, i))
            return i * i
        finally:
            busy.release()

    futures = [jobs.submit(job, i) for i in range(5)]
    assert jobs.run(job, 5) == 25
    assert [f.done() for f in futures] == [True] * 5
    assert [f.result() for f in futures] == [0, 1, 4, 9, 16]
    assert [i for _, i in log] == list(range(6))
    assert {name for name, i in log if i < 5} == {"test-jobs"}
    assert log[-1][0] == threading.current_thread().name
    jobs.close()


def test_errors_travel_to_the_caller_and_later_jobs_still_run() -> None:
    jobs = JobThread("test-jobs")

    def fail() -> None:
        raise ValueError("boom")

    bad = jobs.submit(fail)
    good = jobs.submit(lambda: "ok")
    with pytest.raises(ValueError, match="boom"):
        bad.result(5)
    assert good.result(5) == "ok"
    with pytest.raises(ValueError, match="boom"):
        jobs.run(fail)
    assert jobs.run(lambda: 3) == 3
    jobs.close()


def test_a_closed_job_thread_refuses_jobs_after_finishing_the_queued_ones() -> None:
    jobs = JobThread("test-jobs")
    slow = jobs.submit(time.sleep, 0.05)
    jobs.close()
    assert slow.done() and slow.exception() is None
    with pytest.raises(MeshClosedError):
        jobs.submit(lambda: None)
    with pytest.raises(MeshClosedError):
        jobs.run(lambda: None)


def test_a_done_callback_may_run_a_job_and_a_cancelled_job_is_skipped() -> None:
    jobs = JobThread("test-jobs")
    gate = threading.Event()
    blocker = jobs.submit(gate.wait, 5)
    cancelled = jobs.submit(lambda: "never")
    assert cancelled.cancel()
    inner: list[int] = []
    blocker.add_done_callback(lambda _f: inner.append(jobs.run(lambda: 7)))
    gate.set()
    assert jobs.run(lambda: 1) == 1  # does not raise for the cancelled job before it
    assert blocker.result(5) is True
    assert inner == [7]
    jobs.close()
