"""Between steps is the user's time, and code after a step runs once per committed step.

Three real worker processes (``tests/scripts/between_steps.py``) on a same-host mesh train a
small model with the loop API; after chosen steps they "evaluate" (the training thread sleeps,
the process stays alive): on every member with uneven durations, and on the leader only. One
worker SIGKILLs itself inside a step's body. The evaluations last longer than the data plane's
``io_timeout`` and less than its ``start_wait``: before ``start_wait``, the others' next
collective timed out waiting for the busy member's first frame (``PEER_LOST``), and every
failed attempt ran the code after the ``with`` block again (a second evaluation).

Checked: no attempt fails but the killed one's step; code after the block runs exactly once
per committed step on each member, and so does each evaluation; the survivors end with the
same state, equal to one process training the same steps. ``FTMESH_NIGHTLY=1`` runs it at the
issue's scale: 30 s leader evaluations and uneven ones of 5/15/27 s with the mesh's default
``io_timeout`` (10 s); that run found two waits that did not honour a busy neighbour (both
neighbours busy at once; a new view's ring opening), ``test_collective_start_wait``."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from tests_support import NIGHTLY

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = str(ROOT / "tests" / "scripts" / "between_steps.py")
TOTAL = 16
DIE_IN = 6
"""Worker c kills itself inside this step's body: the step's first attempt fails."""
ALL_EVAL = {3: (2.0, 6.0, 10.0), 11: (2.0, 7.0, 0.0)}
"""Step -> seconds each member evaluates after it (uneven: a waits 8 s for c at step 4)."""
LEADER_EVAL = {9: 7.0, 13: 7.0}
IO_TIMEOUT = 4.0
"""Below every wait an evaluation causes (and above the ~1 s a busy member takes to say so);
``start_wait`` (60 s) is above all of them."""
if NIGHTLY:  # the issue's own scale: 30 s evaluations, the mesh's default io_timeout (2.5 min)
    ALL_EVAL = {3: (5.0, 15.0, 27.0), 11: (2.0, 22.0, 0.0)}
    LEADER_EVAL = {9: 30.0, 13: 30.0}
    IO_TIMEOUT = 10.0
CLOSE = 1e-5
"""Mesh vs one process: equal up to summation order."""

pytestmark = [pytest.mark.timeout(300), pytest.mark.quiet]


def _records(text: str) -> list[dict[str, Any]]:
    out = []
    for line in text.splitlines():
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


def _run(tmp: Path) -> dict[str, tuple[int, list[dict[str, Any]], str]]:
    args = ["--registry", str(tmp / "registry"), "--total", str(TOTAL)]
    args += ["--io-timeout", str(IO_TIMEOUT), "--start-wait", "60", "--die-in", "0"]
    for step, secs in ALL_EVAL.items():
        args += ["--all-eval", f"{step}:" + ",".join(map(str, secs))]
    for step, sec in LEADER_EVAL.items():
        args += ["--leader-eval", f"{step}:{sec}"]
    procs = {}
    for order, name in enumerate("abc"):
        extra = ["--name", name, "--order", str(order)]
        if name == "c":
            extra += ["--die-in", str(DIE_IN)]
        log = open(tmp / f"{name}.log", "w")  # noqa: SIM115 - closed below
        procs[name] = (
            subprocess.Popen(
                [sys.executable, SCRIPT, *args, *extra],
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env=None,
            ),
            log,
        )
    out = {}
    try:
        for name, (proc, _) in procs.items():
            text, _ = proc.communicate(timeout=240)
            out[name] = (proc.returncode, _records(text), (tmp / f"{name}.log").name)
    finally:
        for proc, log in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    return out


def _single() -> list[float]:
    done = subprocess.run(
        [sys.executable, SCRIPT, "--single", "--registry", "-", "--total", str(TOTAL)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    weights: list[float] = _records(done.stdout)[-1]["weights"]
    return weights


def test_evaluations_between_steps_fail_no_attempt_and_run_once(tmp_path: Path) -> None:
    runs = _run(tmp_path)
    logs = {n: (tmp_path / f"{n}.log").read_text()[-3000:] for n in "abc"}
    assert runs["c"][0] == -9, logs["c"]  # it died as planned, in step DIE_IN
    done: dict[str, dict[str, Any]] = {}
    evals: dict[int, list[str]] = {}
    for name in "ab":
        rc, recs, _ = runs[name]
        assert rc == 0, logs[name]
        steps = [r for r in recs if r["event"] == "step"]
        # Code after the block ran once per committed step, and only after a commit.
        assert [r["step"] for r in steps] == list(range(1, TOTAL + 1)), (name, steps)
        assert all(r["committed"] for r in steps), (name, steps)
        # No attempt failed but the first of the killed worker's step.
        retried = {r["step"]: r["attempts"] for r in steps if r["attempts"] != 1}
        assert set(retried) <= {DIE_IN}, (name, retried, logs[name])
        for r in recs:
            if r["event"] == "eval":
                evals.setdefault(r["step"], []).append(name)
        done[name] = recs[-1]
        assert done[name]["event"] == "done" and done[name]["committed"] == TOTAL
    # The wait was visible: a member waiting for a busy one said whom it waited for, by name.
    full = {n: (tmp_path / f"{n}.log").read_text() for n in "ab"}
    waits = r"waiting for [abc] \(\w+\) to start collective #\d+ .*: it is busy between steps"
    assert any(re.search(waits, text) for text in full.values()), logs
    c_evals = [r["step"] for r in runs["c"][1] if r["event"] == "eval"]
    assert c_evals == [3], c_evals  # c evaluated once, then died
    # Each evaluation ran exactly once per evaluated committed step on each member.
    assert sorted(evals[3]) == ["a", "b"] and sorted(evals[11]) == ["a", "b"], evals
    for step in LEADER_EVAL:
        assert len(evals[step]) == 1, (step, evals)
    assert set(evals) == {*ALL_EVAL, *LEADER_EVAL}, evals
    # The survivors agree, and equal one process training the same steps.
    assert done["a"]["digest"] == done["b"]["digest"]
    single = _single()
    assert max(abs(u - v) for u, v in zip(done["a"]["weights"], single, strict=True)) < CLOSE
