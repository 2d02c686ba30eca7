"""Streaming data end to end: ``ftmesh launch -n 3`` runs ``tests/scripts/stream_worker.py``
(two epochs of a ``ShardedStream`` of 12 shards) with a SIGKILL and a join; from what each
worker recorded (its draws per attempt, written before its gradients were reduced, and the
steps it committed with their view and members), every sample id of the stream was trained
in exactly one committed step in each epoch, across all members, the killed one included,
and an attempt in which members had drawn samples failed (the kill) and was retried."""

from __future__ import annotations

import json
import os
import sys
from collections import defaultdict
from pathlib import Path

import pytest
from tests_support import ROOT, launch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

SCRIPT = ROOT / "tests" / "scripts" / "stream_worker.py"
sys.path.insert(0, str(SCRIPT.parent))
from stream_worker import EPOCHS, LENGTHS  # noqa: E402


def test_every_sample_is_trained_once_through_a_kill_and_a_join(tmp_path: Path) -> None:
    records = tmp_path / "records"
    records.mkdir()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(ROOT / "tests" / "hooks"), str(ROOT), os.environ.get("PYTHONPATH", "")]
        ),
        "FTMESH_TEST_TRACE": "1",
        "STREAM_DRAW_DELAY": "0.05",  # (the pace, inside each step: see stream_worker)
        "FTMESH_TEST_HOLD": "12:3",  # the joiner (started at step 9) arrives mid-run
        "OMP_NUM_THREADS": "1",
        "STREAM_RECORD_DIR": str(records),
    }
    args = ["-n", "3", "--seed", "2", "--kill-at", "8", "--join-at", "9", str(SCRIPT)]
    res = launch(tmp_path / "mesh", *args, timeout=150, env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert res.stdout.count("kill -9") == 1, res.stdout[-3000:]

    draws: dict[tuple[int, str, str], list[int]] = {}
    commits: dict[int, set[tuple[str, tuple[str, ...], int]]] = defaultdict(set)
    done: dict[str, dict[str, object]] = {}
    for path in sorted(records.glob("*.jsonl")):
        node = path.stem
        for line in path.read_text().splitlines():
            r = json.loads(line)
            if "draw" in r:
                key = (r["draw"], r["view"], node)
                # a retry on the same view draws the same samples
                assert draws.setdefault(key, r["ids"]) == r["ids"], key
            elif "commit" in r:
                commits[r["commit"]].add((r["view"], tuple(r["workers"]), r["epoch"]))
            else:
                done[node] = r
    nodes = {p.stem for p in records.glob("*.jsonl")}
    assert len(nodes) == 4  # three at the start, one joiner

    trained: dict[int, list[int]] = defaultdict(list)
    for index in range(max(commits) + 1):
        assert len(commits[index]) == 1, (index, commits[index])  # one committed attempt
        ((view, workers, epoch),) = commits[index]
        for w in workers:
            trained[epoch] += draws.get((index, view, w), [])
    every = sorted(s * 1000 + i for s, n in enumerate(LENGTHS) for i in range(n))
    assert sorted(trained) == list(range(EPOCHS))
    for epoch in range(EPOCHS):
        ids = trained[epoch]
        assert len(ids) == len(set(ids)), f"epoch {epoch}: a sample trained twice"
        assert sorted(ids) == every, f"epoch {epoch}: samples missing"
    # the kill failed an attempt in which members had drawn samples: re-read by the retry
    views = {index: next(iter(found))[0] for index, found in commits.items()}
    assert [key for key in draws if views.get(key[0]) != key[1]], "no attempt failed"
    # the killed worker trained in committed steps before it died, the joiner after it came
    (killed,) = nodes - set(done)
    first = set(next(iter(commits[0]))[1])
    (joiner,) = nodes - first
    computed = {w for found in commits.values() for _, workers, _ in found for w in workers}
    assert killed in computed and joiner in computed
    # three finished (two survivors and the joiner), on one state, the stream in epoch 2
    assert len(done) == 3, done
    assert len({str(d["digest"]) for d in done.values()}) == 1, done
    assert {d["epoch"] for d in done.values()} == {EPOCHS}
    assert {d["done"] for d in done.values()} == {max(commits) + 1}
