"""Spares (``ElasticTrainer(max_peers=...)``), real processes on loopback. Hot (default): every
member is in the ring and up to date, only ``max_peers`` compute, and a kill promotes a spare
at once. Cold: members beyond ``max_peers`` wait outside the ring and one steps in when a
training member is killed; with no failure the spare exits cleanly at the end."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests_support import EXAMPLE, accuracy, check_consistency, launch, progress

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]  # each ~20-60 s (2 cores, loaded)


def _steps(records: dict[str, list[dict[str, object]]]) -> dict[str, list[dict[str, object]]]:
    return {name: [r for r in recs if "done" not in r] for name, recs in records.items()}


def test_cold_spare_steps_in_after_a_kill(tmp_path: Path) -> None:
    logs = tmp_path / "mesh"
    res = launch(
        logs,
        "-n",
        "3",
        "--seed",
        "1",
        "--kill-at",
        "30",
        EXAMPLE,
        # Training starts once two members are there (not with whoever started first: on a
        # loaded host the workers' start-up can differ by seconds).
        "--min-peers",
        "2",
        "--max-peers",
        "2",
        "--spares",
        "cold",
        "--epochs",
        "4",
        # No pacing: the kill fires on a step, and the spare steps in whenever it has started
        # (with --min-peers 2 the survivor waits for it).
        "--step-delay",
        "0",
        "--digest-every",
        "1",
        timeout=220,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert res.stdout.count("kill -9") == 1, res.stdout[-3000:]
    records = progress(logs)
    steps = _steps(records)
    total = int(next(r for recs in steps.values() for r in recs)["total"])  # type: ignore[call-overload]
    check_consistency(records, total)
    assert all(int(r["members"]) <= 2 for recs in steps.values() for r in recs)  # type: ignore[call-overload]
    # The trainers' start waits for a view of max_peers, not of all start peers (it waited
    # out the 60 s start timeout, failing 13 attempts of step 1 on the other trainer). A
    # healthy start may still fail a few attempts while the roles spread (the third member
    # stepping back as a spare changes the view): 4 was seen once in CI, so the bound is 5.
    firsts = [int(recs[0]["attempts"]) for recs in steps.values() if recs]  # type: ignore[call-overload]
    assert max(firsts) <= 5, firsts
    firsts = {name: int(recs[0]["step"]) for name, recs in steps.items() if recs}  # type: ignore[call-overload]
    assert len(firsts) == 3, firsts  # the spare trained too, after the kill
    starters = [n for n, s in firsts.items() if s <= 2]
    spares = [n for n, s in firsts.items() if s >= 30]  # its first step: the one it adopted
    assert len(starters) == 2 and len(spares) == 1, firsts
    assert steps[spares[0]][0]["synced"], steps[spares[0]][0]
    assert accuracy(res.stdout) >= 0.9


def test_unneeded_cold_spare_exits_cleanly(tmp_path: Path) -> None:
    logs = tmp_path / "mesh"
    res = launch(
        logs,
        "-n",
        "3",
        EXAMPLE,
        *["--min-peers", "2", "--max-peers", "2", "--spares", "cold"],
        *["--epochs", "1", "--step-delay", "0.02"],
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    steps = _steps(progress(logs))
    trained = [name for name, recs in steps.items() if recs]
    # Two train, one waits and ends cleanly; never more than max_peers.
    assert len(trained) == 2, {n: len(r) for n, r in steps.items()}
    assert all(int(r["members"]) <= 2 for recs in steps.values() for r in recs)  # type: ignore[call-overload]
    for spare in set(steps) - set(trained):
        # It saw the end itself, or launch stopped it (the trainers had exited before the
        # spare read their "done"): a clean exit either way (returncode 0 above).
        said = "the training finished without needing us" in (logs / f"{spare}.log").read_text()
        assert said or f"{spare} arrived after the training ended: stopped" in res.stdout, spare


def test_hot_spare_is_up_to_date_and_takes_over_at_once(tmp_path: Path) -> None:
    logs = tmp_path / "mesh"
    res = launch(
        logs,
        "-n",
        "3",
        "--seed",
        "1",
        # Late enough that a worker slow to start (seconds, on a loaded CI host) is in the
        # ring as the spare before the kill.
        "--kill-at",
        "60",
        EXAMPLE,
        *["--min-peers", "2", "--max-peers", "2", "--epochs", "4"],
        *["--step-delay", "0.05", "--digest-every", "1"],
        timeout=220,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert res.stdout.count("kill -9") == 1, res.stdout[-3000:]
    records = progress(logs)
    steps = _steps(records)
    total = int(next(r for recs in steps.values() for r in recs)["total"])  # type: ignore[call-overload]
    check_consistency(records, total)  # the spare's digests match at every step too
    computing: dict[int, list[int]] = {}
    for recs in steps.values():
        for r in recs:
            computing.setdefault(int(r["step"]), []).append(int(r["share"]))  # type: ignore[call-overload]
    assert all(len([s for s in shares if s]) <= 2 for shares in computing.values())
    # The spare (no share before the kill; it may have joined a little after the start) computes
    # right after the kill, with no state to fetch.
    spare = next(n for n, recs in steps.items() if recs and int(recs[0]["share"]) == 0)  # type: ignore[call-overload]
    assert int(steps[spare][0]["step"]) < 60, "the spare joined after the kill"  # type: ignore[call-overload]
    promoted = [r for r in steps[spare] if int(r["share"])]  # type: ignore[call-overload]
    assert promoted, "the spare never computed"
    assert int(promoted[0]["step"]) <= 70, promoted[0]  # type: ignore[call-overload]
    assert promoted[0]["fetched"] == 0, promoted[0]
    assert accuracy(res.stdout) >= 0.9
