"""``recovery="keep"`` end to end: three worker processes, two of them SIGKILLed mid-step; the
survivors commit each interrupted step with the gradients they had computed for it, and the
lost member's share is skipped and counted, never trained twice or silently lost.

The launcher kills a worker right after it reports step K, during the short pause after
each step (``--step-delay``), so the others' step K+1 fails in its gradient allreduce after
their micro-batches ended: the case ``keep`` is for (the machine's scripted and seeded
tests, ``tests/test_training_step.py``, cover every other moment and the joiner's
fall-back)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest
from tests_support import EXAMPLE, check_consistency, launch, progress

from ftmesh.torch import ElasticSampler

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

TRAIN_SAMPLES = 1437
"""The digits minus their 20% test split (``examples/train_digits.py``: 1,797 - 360)."""
BATCH = 32


KILL_AT = (10, 30)
"""The launcher kills a worker once these steps are committed."""


def test_keep_skips_the_lost_share_and_trains_every_other_sample_once(tmp_path: Path) -> None:
    logs = tmp_path / "mesh"
    res = launch(
        logs,
        "-n",
        "3",
        "--seed",
        "3",
        "--kill-at",
        str(KILL_AT[0]),
        "--kill-at",
        str(KILL_AT[1]),
        EXAMPLE,
        "--epochs",
        "2",
        "--step-delay",
        "0.02",
        "--recovery",
        "keep",
        "--log-indices",
        "--digest-every",
        "1",
        timeout=280,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert res.stdout.count("kill -9") == 2, res.stdout[-3000:]
    records = progress(logs)
    total = int(records["w0"][0]["total"])  # type: ignore[call-overload]
    # identical digests on every member at every committed step, none skipped or repeated
    check_consistency(records, total, batch=BATCH)
    sampler = ElasticSampler(TRAIN_SAMPLES, BATCH, seed=0)
    trained: dict[int, list[int]] = defaultdict(list)
    skipped: dict[int, set[int]] = defaultdict(set)
    computing: dict[int, set[int]] = defaultdict(set)
    reports: dict[int, int] = defaultdict(int)
    adopted: dict[int, int] = defaultdict(int)
    for recs in records.values():
        for r in recs:
            if "done" in r:
                continue
            step = int(r["step"])  # type: ignore[call-overload]
            if int(r["computing"]) == 0:  # type: ignore[call-overload]
                # A step the member took in a sync from one that committed it (its own
                # attempt failed after its row went out, when the victim died): it trained
                # nothing it can report and says nothing of the step's skip.
                assert r["synced"] and not r["indices"], r
                adopted[step] += 1
                continue
            trained[step] += [int(i) for i in r["indices"]]  # type: ignore[attr-defined]
            skipped[step].add(int(r["skipped"]))  # type: ignore[call-overload]
            computing[step].add(int(r["computing"]))  # type: ignore[call-overload]
            reports[step] += 1
    assert all(len(s) == 1 for s in skipped.values()), "members disagree on a step's skip"
    lossy = {step for step, s in skipped.items() if s != {0}}
    assert lossy, "no step committed without the killed member's share"
    assert len(lossy) <= 2, lossy
    epoch_trained: dict[int, list[int]] = defaultdict(list)
    epoch_skipped: dict[int, int] = defaultdict(int)
    epoch_unreported: dict[int, int] = defaultdict(int)
    kill_steps = {k + d for k in KILL_AT for d in (0, 1)}  # (the launcher sees the step late)
    for step in range(1, total + 1):
        (skip,) = skipped[step]
        (workers,) = computing[step]
        mine = trained[step]
        # each sample of the step trained once, by one member, or counted as skipped
        assert len(mine) == len(set(mine)), f"step {step} trained a sample twice"
        assert set(mine) <= set(sampler.global_indices(step - 1).tolist()), step
        # A victim killed right after it committed a step may die before its report of that
        # step is written, and a survivor may adopt it (above): then their shares are trained
        # but unreported (one report missing, and one more per adopter).
        unreported = sampler.batch_size(step - 1) - len(mine) - skip
        if reports[step] == workers:
            assert unreported == 0, (step, len(mine), skip)
        else:
            missing = workers - reports[step]
            assert 1 <= missing <= 1 + adopted[step] and unreported > 0, (step, missing, skip)
            assert step in kill_steps, (step, kill_steps)
        epoch = sampler.epoch_of(step - 1)
        epoch_trained[epoch] += mine
        epoch_skipped[epoch] += skip
        epoch_unreported[epoch] += unreported
    for epoch, samples in epoch_trained.items():
        assert len(samples) == len(set(samples)), f"epoch {epoch} trained a sample twice"
        steps = sampler.steps_per_epoch
        size = sum(sampler.batch_size(epoch * steps + k) for k in range(steps))
        assert len(samples) + epoch_skipped[epoch] + epoch_unreported[epoch] == size, epoch
    assert sum(epoch_skipped.values()) > 0
