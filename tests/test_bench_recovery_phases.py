"""The phases of a recovery in ``ftmesh bench recovery`` (``kill_phases``), from the
milestones of the first survivor's timeline: pure arithmetic, no process."""

from __future__ import annotations

import pytest

from ftmesh.bench.recovery import JOIN_PHASES, PHASES, _counts, join_phases, kill_phases


def test_the_phases_follow_the_milestones_and_add_up_to_the_step() -> None:
    milestones: dict[str, float | None] = {
        "first_failure": 0.03,
        "view_without_victim": 0.14,
        "retry_view_ready": 0.15,
        "sync_start": 0.16,
        "step_start": 0.23,
        "commit": 0.30,
        "received": 0.301,
        "attempts": 2.0,
    }
    p = kill_phases(milestones)
    assert list(p) == [name for name, _ in PHASES]
    expected = {
        "detect": 0.03,
        "drop": 0.11,
        "retry_wait": 0.01,
        "sync": 0.08,
        "step": 0.07,
        "report": 0.001,
    }
    assert p == pytest.approx(expected)
    assert sum(v for v in p.values() if v is not None) == pytest.approx(0.301)


def test_a_milestone_that_came_early_or_is_missing() -> None:
    # The view without the victim came before any collective failed: no drop phase after
    # the failure; no failure recorded at all: no detect phase, the drop starts at the kill.
    p = kill_phases({"first_failure": 0.2, "view_without_victim": 0.1, "step_start": 0.25})
    assert p["detect"] == pytest.approx(0.2) and p["drop"] == 0.0
    assert p["retry_wait"] is None and p["sync"] == pytest.approx(0.05)
    assert p["step"] is None
    q = kill_phases({"first_failure": None, "view_without_victim": 0.1, "received": 0.3})
    assert q["detect"] is None and q["drop"] == pytest.approx(0.1)
    assert q["report"] == pytest.approx(0.2)


def test_attempts_are_counted_by_value() -> None:
    assert _counts([2, 1, 2, 3, 2]) == {"1": 1, "2": 3, "3": 1}
    assert _counts([]) == {}


def test_a_joins_phases_add_up_to_its_start_to_step() -> None:
    hello = {"t_start": 10.5, "t_imported": 12.0, "t_connected": 13.25}
    p = join_phases(10.0, hello, 13.5)
    assert list(p) == list(JOIN_PHASES)
    assert p == pytest.approx(
        {"launch_s": 0.5, "imports_s": 1.5, "connect_s": 1.25, "enter_s": 0.25}
    )
    assert sum(p.values()) == pytest.approx(3.5)
    assert join_phases(10.0, None, 13.5) == {}
