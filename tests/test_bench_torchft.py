"""The torchft comparison of ``ftmesh bench recovery`` (issue #30): with a python that cannot
import torchft the bench says so in one line, leaves the torchft fields and ratios null and
exits 0; with torchft in its own venv (``FTMESH_TORCHFT_PYTHON``), a tiny torchft phase runs
real replicas and a lighthouse on loopback and the ratios are the medians' quotients."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys
from typing import Any

import pytest

from ftmesh.bench.recovery import (
    JOIN_PHASES,
    TORCHFT_PYTHON_ENV,
    _stats,
    _torchft_empty,
    _torchft_summary,
    torchft_python,
)

TORCHFT_FIELDS = (
    "torchft_settings",
    "torchft_kill_to_step_s",
    "torchft_kill_attempts",
    "torchft_join_start_to_step_s",
    "torchft_join_phases_s",
    "torchft_join_model_s",
    "torchft_joins_detail",
    "vs_torchft_kill",
    "vs_torchft_join",
)


def _run_bench(*args: str, timeout: float) -> tuple[subprocess.CompletedProcess[str], Any]:
    env = {k: v for k, v in os.environ.items() if k != TORCHFT_PYTHON_ENV}
    res = subprocess.run(
        [sys.executable, "-m", "ftmesh.bench.recovery", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    lines = res.stdout.strip().splitlines()
    assert lines, res.stderr[-3000:]
    return res, json.loads(lines[-1])


def test_a_python_without_torchft_is_named_with_the_reason() -> None:
    assert importlib.util.find_spec("torchft") is None, "this venv must lack torchft"
    py, why = torchft_python(argparse.Namespace(torchft_python=sys.executable))
    assert py is None
    assert sys.executable in why and "cannot import torchft" in why
    assert "torchft" in why.split("(")[-1]  # the import's own last line: ModuleNotFoundError
    py, why = torchft_python(argparse.Namespace(torchft_python="/nonexistent/python3"))
    assert py is None and "cannot be run" in why


def test_the_summary_of_a_skipped_phase_is_all_null() -> None:
    kill = _stats([0.2, 0.3])
    out = _torchft_summary(_torchft_empty(), kill, 7.5, "no torchft here")
    assert out["torchft_skipped"] == "no torchft here"
    for field in TORCHFT_FIELDS:
        assert out[field] is None, field


def test_the_ratios_are_ftmesh_over_torchft() -> None:
    tf = _torchft_empty()
    tf["kills"] = [0.4, 0.8, 0.6]
    tf["joins"] = [{"start_to_step_s": 8.0, **dict.fromkeys(JOIN_PHASES, 2.0)}]
    out = _torchft_summary(tf, _stats([0.15, 0.3, 0.2]), 6.0, "")
    assert out["torchft_skipped"] is None
    assert out["torchft_kill_to_step_s"]["median"] == pytest.approx(0.6)
    assert out["vs_torchft_kill"] == pytest.approx(0.2 / 0.6)
    assert out["vs_torchft_join"] == pytest.approx(6.0 / 8.0)
    assert out["torchft_join_phases_s"] == dict.fromkeys(JOIN_PHASES, 2.0)
    assert out["torchft_settings"]["lighthouse"]["join_timeout_ms"] == 100


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_bench_without_torchft_says_so_and_exits_0() -> None:
    assert importlib.util.find_spec("torchft") is None, "this venv must lack torchft"
    res, r = _run_bench(
        "--procs",
        "2",
        "--kills",
        "0",
        "--leaves",
        "0",
        "--stops",
        "0",
        "--torchrun-kills",
        "0",
        "--torchft-kills",
        "2",
        "--torchft-python",
        sys.executable,
        "--state-mb",
        "1",
        "--join-sizes",
        "",
        timeout=240,
    )
    assert res.returncode == 0, (r.get("failures"), res.stderr[-2000:])
    said = [line for line in res.stderr.splitlines() if "torchft" in line]
    assert len(said) == 1 and said[0].startswith("torchft is not installed:"), said
    assert "Traceback" not in res.stderr
    assert "cannot import torchft" in r["torchft_skipped"]
    for field in TORCHFT_FIELDS:
        assert r[field] is None, field
    assert "kill_at_most_half_torchft" not in r["goals"]


def _positive(x: object) -> bool:
    return isinstance(x, int | float) and math.isfinite(x) and x > 0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_tiny_torchft_phase_beside_ftmesh() -> None:
    py = os.environ.get(TORCHFT_PYTHON_ENV)
    if not py:
        pytest.skip("needs torchft in a separate venv: set FTMESH_TORCHFT_PYTHON")
    res, r = _run_bench(
        "--procs",
        "2",
        "--kills",
        "1",
        "--leaves",
        "0",
        "--stops",
        "0",
        "--policy-kills",
        "0",
        "--torchrun-kills",
        "0",
        "--torchft-kills",
        "2",
        "--torchft-python",
        py,
        "--state-mb",
        "1",
        "--join-sizes",
        "",
        timeout=540,
    )
    assert res.returncode == 0, (r.get("failures"), res.stderr[-3000:])
    assert r["failures"] == []
    assert r["torchft_skipped"] is None
    tk = r["torchft_kill_to_step_s"]
    assert tk["n"] == 2 and 0 < tk["median"] < 60
    # One kill before the ftmesh phases and one after, each on a fresh torchft job.
    assert sum("torchft: 2 replicas training" in line for line in res.stderr.splitlines()) == 2
    assert r["vs_torchft_kill"] == pytest.approx(r["kill_to_step_s"]["median"] / tk["median"])
    joins = r["torchft_joins_detail"]
    assert len(joins) == 2
    for join in joins:
        assert join["healed"], join  # it fetched the state from a peer
        # It resumed from the survivors' state (their step count), not from step 0.
        assert join["first_step"] > 2 and join["first_step"] >= join["survivors_step"] - 1, join
        assert all(_positive(join[k]) for k in JOIN_PHASES), join
        assert sum(join[k] for k in JOIN_PHASES) == pytest.approx(join["start_to_step_s"])
    tj = r["torchft_join_start_to_step_s"]
    assert _positive(tj)
    assert r["vs_torchft_join"] == pytest.approx(r["join_start_to_step_s"] / tj)
    assert {"kill_at_most_half_torchft", "join_at_most_torchft"} <= set(r["goals"])
    assert r["torchft_settings"]["manager"]["use_async_quorum"] is False
