"""DiLoCo rounds on three lab machines with a kill and a join (issue 31): three hosts of a
``VirtualLan`` (network namespaces on one bridge) run the seed-list commands of
docs/guide/running.md with DiLoCo's flag (``ftmesh worker --discovery seeds --port 7946
--start-peers 3 examples/train_digits.py --diloco 4`` on the first, ``--join FIRST:7946``
instead of ``--port`` on the others); the third host's worker is killed with SIGKILL in the
middle of a round, and a new worker on a fourth host joins the two survivors mid-run. The
joiner is started first, cut off by a lab partition (``VirtualLan.partition``) until the
survivors have committed the round after the kill: its start-up (importing torch, up to a
minute on a loaded 2-core host) is then not in the run, and it enters through its seed
within seconds of the heal, with the rounds left to show its state.

What is asserted, from the workers' progress records (``--digest-every 1``: a digest at every
round) and their last lines:

* **Identical global parameters after every round**: every member that reports a round
  reports the same state digest for it (global parameters, the registered inner optimizer's
  part, the outer optimizer's momentum), every round of the run is committed by someone, each
  a round of ``H`` x 32 samples, and no member repeats or skips a round without a sync.
* **The kill lands in a round**: the victim runs without a pause between rounds, so when the
  test sees its record of round ``KILL_AT`` it is already computing round ``KILL_AT + 1``;
  it never commits that round, and the survivors commit it as a round of two members who
  both computed it (``members`` and ``computing`` 2, a whole round of samples). Whether
  their first attempt of it still held the victim depends on how fast its death is seen:
  the data plane reports the closed connections of a killed process at once, usually
  before the survivors, paced, enter the round (one attempt); when it is seen later, the
  attempt fails and they commit on a later one with the outer gradients they had computed
  (``attempts`` >= 2; that retry is proven in process by
  ``tests/test_training_diloco.py::test_a_member_lost_mid_round_is_left_out_of_it``).
* **The outer state restored on the joiner**: its first record is a round it entered with a
  sync (``synced``, ``fetched`` > 0), after the kill, before the end; the digest of its outer
  optimizer's state (the record's ``outer``: the ``outer_optimizer`` part alone) equals the
  survivors' for that round and for every round after, and it is not a fresh optimizer's
  (it changed since round 1, so it holds momentum built over rounds the joiner never saw).
* **The final loss within** ``TOLERANCE`` **of the synchronous run's**: the held-out
  cross-entropy (``--eval-every``'s ``test_loss``), averaged over the last ``LAST_EPOCHS``
  epochs, against the cached single-process run of the same seed and epochs evaluated after
  as many samples (``references``: what a synchronous mesh computes); see ``TOLERANCE`` for
  the figure and why. The finishers end with one model (one digest, one ``test loss``).

Kept short: ``H = 4`` and ``EPOCHS`` epochs (66 rounds); the survivors' pause between rounds
(``PACE``) is there only so that the joiner, found by its seed every 5 s, enters with rounds
left; the test waits on records and log lines, not on time.

Root only (network namespaces)."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from tests_support import EXAMPLE, FTMESH, Machine, References, check_consistency, wait_until

from ftmesh.lab import VirtualLan

pytestmark = [
    pytest.mark.slow,
    pytest.mark.netns,
    pytest.mark.timeout(600),
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("ip") is None,
        reason="needs root (and iproute2) to create network namespaces; CI runs as root",
    ),
]

HOSTS = 3
"""Lab hosts training at any time; a fourth holds the joiner."""
VICTIM = 2
"""The host whose worker is killed."""
JOINER = 3
H = 4
EPOCHS = 6
"""66 rounds of ``H`` x 32 samples (11 per epoch of the 1437 training digits)."""
ROUND = 32 * H
EVALS_PER_EPOCH = 1437 // ROUND
"""Evaluations per epoch at one per round (the 1437 training digits)."""
LAST_EPOCHS = 3
"""The final loss is the mean over the evaluations of this many last epochs."""
KILL_AT = 5
"""The victim is killed as soon as it reports this round (it is then computing the next)."""
PACE = "0.2"
"""``--step-delay`` of the survivors and the joiner: the ~60 rounds after the kill take 12 s
or more, room for the joiner (warm, cut off until then) to find the mesh through its seed
(re-resolved every 5 s), enter and fetch the state. The victim has none."""
TOLERANCE = 0.1
"""How far DiLoCo's final held-out loss may be from the synchronous run's (absolute, in nats,
either way), each the mean over the evaluations of the last ``LAST_EPOCHS`` epochs (one per
``ROUND`` samples). A single evaluation is no measure: at this constant learning rate the
held-out loss of either run moves between 0.12 and 0.40 from one evaluation to the next in
its last three epochs (the synchronous run's last one, 0.117, is a low point of that band).
Measured means at 6 epochs: synchronous 0.244 (still falling: 0.146 at 8 epochs), DiLoCo
0.190 without faults (3 loopback workers), 0.293 with a kill at round 5 and no joiner (2
workers from then on: the mean over fewer outer gradients is noisier), 0.22-0.27 in four
runs of this test (docs/STATUS.md). 0.1 holds all of these and still fails a run that trains
far worse than synchronous steps (a lost or stale outer state, rounds that apply no update:
2.3 untrained)."""


def _args(lan: VirtualLan, host: int) -> list[str]:
    """The command on ``host``: the seed-list commands of docs/guide/running.md (host 0 is
    the seed, on a fixed port), with DiLoCo's flag and the test's pacing."""
    seeds = ["--port", "7946"] if host == 0 else ["--join", f"{lan.host_ip(0)}:7946"]
    if host == JOINER:  # (it waits, cut off, while the others start and train)
        seeds += ["--start-timeout", "600"]
    argv = [FTMESH, "worker", "--discovery", "seeds", *seeds, "--start-peers", str(HOSTS)]
    argv += [EXAMPLE, "--diloco", str(H), "--epochs", str(EPOCHS), "--digest-every", "1"]
    argv += ["--eval-every", "1"]  # (the held-out loss after every round)
    return [*argv, "--step-delay", "0" if host == VICTIM else PACE]


def _records(text: str) -> list[dict[str, Any]]:
    return [
        json.loads(ln[len("FTMESH ") :]) for ln in text.splitlines() if ln.startswith("FTMESH ")
    ]


def _rounds(m: Machine) -> dict[int, dict[str, Any]]:
    return {int(r["step"]): r for r in m.records if "done" not in r}


def _test_loss(text: str) -> float:
    found = re.findall(r"^test loss: (\d+\.\d+)$", text, re.M)
    assert found, text[-2000:]
    return float(found[-1])


def final_loss(records: list[dict[str, Any]]) -> float:
    """The mean held-out loss of a run's evaluations over its last ``LAST_EPOCHS`` epochs (one
    evaluation per ``ROUND`` samples trained: ``EVALS_PER_EPOCH`` per epoch)."""
    evals = [float(r["test_loss"]) for r in records if "test_loss" in r]
    tail = evals[-LAST_EPOCHS * EVALS_PER_EPOCH :]
    assert len(tail) == LAST_EPOCHS * EVALS_PER_EPOCH, records[-3:]
    return sum(tail) / len(tail)


def test_diloco_on_three_lab_hosts_through_a_kill_and_a_join(
    tmp_path: Path, references: References
) -> None:
    with VirtualLan(hosts=HOSTS + 1) as lan:
        lan.partition([list(range(HOSTS)), [JOINER]])
        t0 = time.monotonic()
        # the joiner first: it imports torch and waits at its start gate, cut off (so its
        # start-up, long on a loaded host, is over before the run it joins)
        joiner = Machine(lan, JOINER, _args(lan, JOINER), tmp_path / "joiner.log")
        ms: list[Machine] = []
        try:
            wait_until(lambda: any("waiting to start" in ln for ln in joiner.lines), 180,
                       "the joiner at its start gate", [joiner])  # fmt: skip
            ms = [Machine(lan, h, _args(lan, h), tmp_path / f"h{h}.log") for h in range(HOSTS)]
            victim, survivors_m = ms[VICTIM], ms[:VICTIM]
            wait_until(lambda: victim.step() >= KILL_AT - 1, 180, "3 workers in rounds", ms)
            deadline = time.monotonic() + 60
            while victim.step() < KILL_AT:  # (polled finely: the kill follows the record)
                assert time.monotonic() < deadline, victim.lines[-5:]
                time.sleep(0.005)
            victim.proc.kill()  # kill -9 while it computes round KILL_AT + 1
            killed_after, t_kill = victim.step(), time.monotonic() - t0
            lost = killed_after + 1
            wait_until(lambda: min(m.step() for m in survivors_m) >= lost, 120,
                       "the survivors' round after the kill", ms)  # fmt: skip
            lan.heal()  # the joiner now reaches the seed
            wait_until(lambda: joiner.step() > 0 or joiner.proc.poll() is not None, 120,
                       "the joiner's first round", [*ms, joiner])  # fmt: skip
            t_join = time.monotonic() - t0
            outs = [m.finish(timeout=240) for m in (*survivors_m, joiner)]
            t_end = time.monotonic() - t0
        finally:
            for m in [*ms, joiner]:
                if m.proc.poll() is None:
                    m.proc.kill()
                    m.proc.wait(10)
    finishers = [*ms[:VICTIM], joiner]
    for m, out in zip(finishers, outs, strict=True):
        assert m.proc.returncode == 0, out[-3000:]
    victim = ms[VICTIM]
    survivors = [_rounds(m) for m in ms[:VICTIM]]
    mine = _rounds(joiner)
    total = int(ms[0].records[0]["total"])
    print(f"killed after round {killed_after} at {t_kill:.1f}s; the joiner's first round at "
          f"{t_join:.1f}s, its rounds {min(mine)}..{max(mine)} of {total}; "
          f"end {t_end:.1f}s")  # fmt: skip
    for s in range(killed_after - 1, killed_after + 3):
        print(s, [(r[s]["members"], r[s]["computing"], r[s]["attempts"]) for r in survivors])

    # one mesh of three from the first round, all at every round's digest
    for m in ms:
        first = m.records[0]
        assert first["step"] == 1 and first["members"] == HOSTS, first
    records = {f"h{h}": list(m.records) for h, m in enumerate(ms)}
    records["joiner"] = list(joiner.records)
    check_consistency(records, total, batch=ROUND)  # the same digest on every member, each round
    assert all(r.get("digest") for rs in records.values() for r in rs), "a round without digest"

    # the kill: the victim never committed the round it was computing; the survivors did, two
    assert max(_rounds(victim)) == killed_after < total
    for theirs in survivors:
        rec = theirs[lost]
        assert rec["members"] == 2 and rec["computing"] == 2 and rec["samples"] == ROUND, rec

    # the join: mid-run, with a sync, and the outer state the survivors hold. (A joiner that
    # arrives as the pair commits the lost round takes that round's state in its sync: its
    # first record is then that round, adopted, its loss unknown: seen once in CI.)
    first = mine[min(mine)]
    adopted = first["step"] == lost and math.isnan(float(first["loss"]))
    assert lost < first["step"] < total or adopted, first
    assert first["synced"] and int(first["fetched"]) > 0, first
    for s, rec in mine.items():
        assert rec["outer"] == survivors[0][s]["outer"] == survivors[1][s]["outer"], s
        assert rec["members"] == 3 or s == lost, rec
    assert first["outer"] != survivors[0][1]["outer"], "the outer state never changed"
    assert len({r["outer"] for r in survivors[0].values()}) == len(survivors[0])
    done = [m.records[-1] for m in finishers]
    assert all(d.get("done") for d in done) and len({d["digest"] for d in done}) == 1, done

    # the final loss against the synchronous run of the same seed and epochs, evaluated
    # after as many samples (a round's H x 32: every H synchronous steps)
    assert len({_test_loss(out) for out in outs}) == 1, "the finishers' models differ"
    diloco = final_loss(ms[0].records)
    single = references.run("--single", "--epochs", str(EPOCHS), "--eval-every", str(H))
    sync = final_loss(_records(single.out))
    print(f"held-out loss over the last {LAST_EPOCHS} epochs: DiLoCo {diloco:.4f}, "
          f"synchronous {sync:.4f} (last evaluations {_test_loss(outs[0])} and "
          f"{_test_loss(single.out)})")  # fmt: skip
    assert abs(diloco - sync) <= TOLERANCE, (diloco, sync)
