"""Uneven members on lab hosts (#15): three machines (network namespaces on a bridge) each
run ``ftmesh worker --start-peers 3 examples/train_digits.py``; one host is made slow for a
window of steps, then set free. In both tests every step's shares add up to the global batch,
every sample trains once per epoch (``--log-indices``) and all members agree on the digests.

* Stragglers (``--straggler-factor``): a host under a cgroup CPU quota
  (``VirtualLan.set_cpu``; the kernel's counters show that it bit) sits out as a hot spare
  (share 0, every step still committed) and computes again after the throttle.
* Fail-slow (the defaults): a member frozen 0.4 s every second (SIGSTOP pulses,
  ``VirtualLan.set_fail_slow``) steps out of the ring, the others train on, and it joins
  again and fetches the state.

The per-step shares are printed (``-s``), one column per host, so a failure can be read.

These are the one lab run of a throttled member and the one multi-process run of a fail-slow
step-out. The rules' other properties are decided by the sans-IO machines, in seeded worlds
and real trainers, not again here (issue 27; two lab runs that repeated them are gone):
speed shares following a throttle,
``test_training_shares.py::test_a_throttled_members_share_falls_and_rises_back`` and
``test_shares_training.py::test_digits_with_speed_shares``; a fail-slow member back after the
others finished stops instead of training alone,
``test_start_gate.py::test_a_late_joiner_finds_the_training_over`` (its return goes through
the start gate:
``test_training_failslow.py::test_a_member_that_keeps_freezing_steps_out_and_comes_back``).
"""

from __future__ import annotations

import itertools
import os
import shutil
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from tests_support import (
    EXAMPLE,
    FTMESH,
    Machine,
    check_consistency,
    cpu_cgroups_available,
    wait_until,
)

from ftmesh.lab import VirtualLan, slowness

pytestmark = [
    pytest.mark.slow,
    pytest.mark.netns,
    pytest.mark.timing,  # cgroup CPU throttles and fail-slow pulses decide who trains
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("ip") is None or not cpu_cgroups_available(),
        reason="needs root (network namespaces, cgroup CPU quotas) and the cgroup cpu "
        "controller; CI runs as root",
    ),
]

HOSTS = 3
SLOW = 2
"""The host that gets throttled."""
GLOBAL_BATCH = 256
"""Large enough for compute to dominate the digits step's fixed cost: at the example's 32 a
member's measured speed follows its share (the fixed cost per step), and an unthrottled
member's share drifts to 2-5 of 32 by itself (seen on this 2-core host), which no throttle
window can be told apart from."""
WARM = 10
"""Steps trained before the throttle."""


def _run(tmp_path: Path, lan: VirtualLan, epochs: int, *script_args: str) -> list[Machine]:
    argv = [FTMESH, "worker", "--start-peers", str(HOSTS), EXAMPLE, "--epochs", str(epochs)]
    argv += ["--step-delay", "0", "--log-indices", "--global-batch", str(GLOBAL_BATCH)]
    argv += script_args
    return [Machine(lan, h, argv, tmp_path / f"h{h}.log") for h in range(HOSTS)]


def _steps(m: Machine) -> dict[int, dict[str, Any]]:
    return {int(r["step"]): r for r in m.records if "done" not in r}


def _shares(ms: list[Machine]) -> dict[int, list[int]]:
    """step -> each host's share (-1: that host did not report the step)."""
    per = [_steps(m) for m in ms]
    steps = sorted(set().union(*per))
    return {s: [int(p[s]["share"]) if s in p else -1 for p in per] for s in steps}


def _check_exactly_once(ms: list[Machine], total: int, epochs: int) -> None:
    """Every step's indices (all members together) are the global batch, each sample once per
    epoch: counts add up and nothing repeats."""
    per_epoch = total // epochs
    seen: dict[int, list[int]] = defaultdict(list)
    for m in ms:
        for s, r in _steps(m).items():
            assert len(r["indices"]) == r["share"], r
            seen[(s - 1) // per_epoch].extend(r["indices"])
    for epoch, idx in seen.items():
        assert len(idx) == per_epoch * GLOBAL_BATCH, (epoch, len(idx))
        assert len(set(idx)) == len(idx), f"epoch {epoch}: a sample trained twice"


def _finish(ms: list[Machine], timeout: float) -> dict[str, list[dict[str, object]]]:
    """Wait for the run to end; every worker exits 0. Returns their records by host."""
    for m in ms:
        out = m.finish(timeout=timeout)
        assert m.proc.returncode == 0, out[-3000:]
    return {f"h{h}": list(m.records) for h, m in enumerate(ms)}


def _kill(ms: list[Machine]) -> None:
    for m in ms:
        if m.proc.poll() is None:
            m.proc.kill()


def _check_run(
    ms: list[Machine],
    records: dict[str, list[dict[str, object]]],
    epochs: int,
    fired: dict[str, float],
    marks: dict[int, str],
) -> dict[int, list[int]]:
    """What both tests check of a finished run; prints the shares by step (``marks`` next to
    theirs) and returns them from the first step every member computed."""
    shares = _shares(ms)
    print("step  " + " ".join(f"h{h:<2}" for h in range(HOSTS)))
    for s, row in shares.items():
        mark = f"  <- {marks[s]}" if s in marks else ""
        print(f"{s:4d}  " + " ".join(f"{v:3d}" for v in row) + mark)
    print("cgroup:", fired)
    total = int(ms[0].records[0]["total"])
    check_consistency(records, total, GLOBAL_BATCH)  # digests agree, no step lost or repeated
    # Every member computes in every step from the first all of them computed in (before the
    # slow window: a host whose start is slow on a loaded host may let the first steps run
    # without it, as the start gate's bounded wait allows; and a member's first step, the
    # one it enters the ring at by a sync, is adopted: share 0).
    full = [s for s, row in shares.items() if min(row) > 0]
    assert full and full[0] < min(marks), f"not all of them trained before step {min(marks)}"
    assert all(-1 not in row for s, row in shares.items() if s >= full[0]), "a member missed steps"
    assert all(sum(max(v, 0) for v in row) == GLOBAL_BATCH for row in shares.values()), (
        "a step lost samples"
    )
    _check_exactly_once(ms, total, epochs)
    assert fired["throttled"] > 0 and fired["throttled_s"] > 0, f"the quota never bit: {fired}"
    return {s: row for s, row in shares.items() if s >= full[0]}


NOT_FAILSLOW = ("--failslow-freezes", "0")
"""A member throttled this hard can also look fail-slow: its freeze watch thread, starved of
CPU (and of the GIL, held by a throttled thread), wakes over 0.2 s late, and 3 such steps
send it out of the ring for 30 s (seen in one lab run: it came back after the others had
finished and trained the rest of the run alone). These tests are about its speed."""


EVICT_SHARE = 0.03
"""The straggler's quota (CPUs) on a quiet host: about twenty times slower than the others
(three workers on 2 cores get about 0.6 CPU each). On a busy host the others get less, so the
quota is a twentieth of what the straggler's host used, unthrottled, in this run
(``_evict_share``), down to the lab's smallest: a fixed 0.03 was only about three times
slower at a load average of 20 (seen in a parallel suite run: the straggler never sat out
within 120 s)."""
SLOWDOWN = 20
"""How many times slower than unthrottled the straggler's quota makes it."""
EVICT_ARGS = (
    *("--straggler-factor", "3", "--straggler-steps", "5", "--readmit-steps", "10"),
    *NOT_FAILSLOW,
)
"""Equal shares (the default ``--shares``), so a slow member costs its whole slowness (with
speed shares it would take its floor share); a factor of 3, which the load of a shared
2-core host does not reach but a twelve-fold slowdown does; short streaks, so that the
test's steps see it sit out and come back."""
EVICT_EPOCHS = 28
"""140 steps: the throttle can start as late as step 40 (the test's polls can see step ``WARM``
that late), the rule takes ~7 steps to see it (smoothed speeds, then ``--straggler-steps``),
and then room for a trial sent back (a loaded host), retried ``--readmit-steps`` later."""


def _cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # (gone)
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def _slow_cpu(lan: VirtualLan) -> tuple[float, float]:
    """CPU seconds the straggler's host's processes used so far, and when."""
    return _cpu_seconds(lan.host_pids(SLOW)), time.monotonic()


def _evict_share(lan: VirtualLan, since: tuple[float, float]) -> tuple[float, float]:
    """The straggler's quota: ``EVICT_SHARE``, or ``SLOWDOWN`` times less than the CPUs its
    host's processes used since ``since`` (``_slow_cpu``: the workers' start-up and warm-up
    steps, no extra wait: on a quiet host the run is only seconds long) when that is less (a
    busy host); and that use."""
    cpu, now = _slow_cpu(lan)
    used = (cpu - since[0]) / max(now - since[1], 1e-3)
    return max(slowness.MIN_SHARE, min(EVICT_SHARE, round(used / SLOWDOWN, 2))), used


def test_a_throttled_straggler_sits_out_and_comes_back(tmp_path: Path) -> None:
    """A member at 3 % of a core (less on a busy host: ``EVICT_SHARE``) sits out as a hot
    spare (share 0, still in the ring and committing every step) while throttled, and
    computes again once the throttle is lifted; nothing is lost or trained twice, and
    everyone ends with the same model."""

    def out(m: Machine) -> list[int]:
        return [int(r["step"]) for r in m.records if r.get("share") == 0 and "done" not in r]

    with VirtualLan(hosts=HOSTS) as lan:
        ms = _run(tmp_path, lan, EVICT_EPOCHS, *EVICT_ARGS)
        slow = ms[SLOW]
        try:
            started = _slow_cpu(lan)
            wait_until(lambda: min(m.step() for m in ms) >= WARM, 120, "3 workers training", ms)
            share, used = _evict_share(lan, started)
            lan.set_cpu(SLOW, share)
            throttled_at = slow.step()
            # Lifted before its first trial (--readmit-steps 10), so that the trial is judged
            # on an unthrottled step.
            wait_until(lambda: len(out(slow)) >= 7, 120, "the straggler sitting out", ms)
            fired = lan.cpu_stats(SLOW)
            lan.set_cpu(SLOW, None)
            lifted_at = slow.step()
            records = _finish(ms, timeout=180)
        finally:
            _kill(ms)
    marks = {throttled_at: "throttled", lifted_at: "lifted"}
    print(f"the straggler's host used {used:.2f} CPU unthrottled; quota {share}")
    shares = _check_run(ms, records, EVICT_EPOCHS, fired, marks)
    assert len({str(m.records[-1]["digest"]) for m in ms}) == 1, "final models differ"
    sat_out = [s for s, row in shares.items() if row[SLOW] == 0]
    assert sat_out and throttled_at < sat_out[0] <= lifted_at, sat_out
    others = [s for s, row in shares.items() if 0 in row[:SLOW] + row[SLOW + 1 :]]
    assert not others, f"an unthrottled member sat out at steps {others}"
    back = [s for s in shares if s > max(sat_out) and shares[s][SLOW] > 0]
    print(f"sat out at steps {sat_out}; computing again from step {min(back, default=None)}")
    assert len(back) >= 5, "the straggler was not computing again after the throttle"


def _stepped_out(m: Machine) -> bool:
    return any("is fail-slow and steps out of the ring" in line for line in m.lines)


def _failslow_run(
    tmp_path: Path, epochs: int, pause: str
) -> tuple[list[Machine], dict[str, list[dict[str, object]]]]:
    """Host ``SLOW`` frozen 0.4 s every second (SIGSTOP pulses) from step ``WARM`` until it
    steps out; the pulses stop then, and it comes back ``pause`` seconds later."""
    with VirtualLan(hosts=HOSTS) as lan:
        argv = [FTMESH, "worker", "--start-peers", str(HOSTS), EXAMPLE, "--epochs", str(epochs)]
        argv += ["--global-batch", str(GLOBAL_BATCH), "--digest-every", "1"]
        argv += ["--failslow-pause", pause, "--step-delay", "0.1"]  # (else the defaults)
        ms = [Machine(lan, h, argv, tmp_path / f"h{h}.log") for h in range(HOSTS)]
        try:
            wait_until(lambda: min(m.step() for m in ms) >= WARM, 120, "3 workers training", ms)
            lan.set_fail_slow(SLOW, 0.4, 1.0)
            wait_until(lambda: _stepped_out(ms[SLOW]), 90, "the fail-slow member out", ms)
            fired = lan.fail_slow_stats(SLOW)
            lan.set_fail_slow(SLOW, None)
            records = _finish(ms, timeout=180)
        finally:
            _kill(ms)
    for h, m in enumerate(ms):
        print(f"h{h}:", " ".join(f"{r['step']}:{r['members']}{'S' if r.get('synced') else ''}"
                                 for r in m.records if "done" not in r))  # fmt: skip
    print("pulses:", fired)
    assert fired.get("pulses", 0) > 0 and fired.get("stopped_s", 0) > 0, fired
    return ms, records


# Serial tail: beside two other labs at load 15-18 its three workers were not all training
# after 120 s (twice, 2026-12-06), and its freeze watch reads the host's pace.
@pytest.mark.quiet
def test_a_fail_slow_member_steps_out_and_rejoins(tmp_path: Path) -> None:
    """Frozen again and again, a member steps out of the ring (the others train on as two,
    without waiting for it), then joins again, fetches the state and computes; one model."""
    ms, records = _failslow_run(tmp_path, 24, "4")
    slow = [r for r in ms[SLOW].records if "done" not in r]
    steps = [int(r["step"]) for r in slow]
    gaps = [(a, b) for a, b in itertools.pairwise(steps) if b > a + 1]
    assert gaps, f"the fail-slow member never stepped out: {steps}"
    out_from, back_at = gaps[0]
    back = next(r for r in slow if int(r["step"]) == back_at)
    assert back["synced"] and int(back["fetched"]) > 0, back  # caught up from the others
    assert any(int(r["share"]) > 0 for r in slow if int(r["step"]) > back_at), "never computed"
    others = [r for m in ms[:SLOW] for r in m.records if "done" not in r]
    assert any(out_from < int(r["step"]) < back_at and r["members"] == 2 for r in others)
    total = int(ms[0].records[0]["total"])
    check_consistency(records, total, GLOBAL_BATCH)
    assert len({str(m.records[-1]["digest"]) for m in ms}) == 1, "final models differ"
