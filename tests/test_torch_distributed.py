"""The ``torch.distributed`` face (``ftmesh.torch.distributed``): in one process on
one-member sessions (what the calls do inside and outside a step, across a view change, and
with a failing session), then on 3 real processes of a real mesh with a kill
(tests/scripts/torch_dist_worker.py): a metric synced through ``dist.all_reduce`` and an eval
``all_gather_object`` give the same numbers on every member.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tests_support import launch

from ftmesh.collective import CollectiveResult, Peer, RingPeerLostError, RingView

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
from ftmesh.torch import distributed as fdist  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("scripts") / "torch_dist_worker.py"


class SoloSession:
    """The session of a one-member view (collectives are the identity); ``fail`` makes every
    collective raise, as a ring that lost a member."""

    def __init__(self, node_id: str, fail: bool = False) -> None:
        self._view = RingView.of([Peer(node_id, "127.0.0.1", 1)])
        self._fail = fail
        self.calls: list[str] = []

    @property
    def view(self) -> RingView:
        return self._view

    @property
    def node_id(self) -> str:
        return self._view.node_ids[0]

    def _run(self, kind: str) -> None:
        self.calls.append(kind)
        if self._fail:
            raise RingPeerLostError("lost", peer="x", epoch=self._view.epoch)

    def allreduce(self, x: Any, op: str = "sum") -> CollectiveResult[Any]:
        self._run(f"allreduce/{op}")
        return CollectiveResult(self._view.epoch, self._view.node_ids, x)

    def allgather(self, x: Any) -> CollectiveResult[Any]:
        self._run("allgather")
        return CollectiveResult(self._view.epoch, self._view.node_ids, x[None].clone())

    def broadcast(self, x: Any, root: str) -> CollectiveResult[Any]:
        self._run(f"broadcast/{root}")
        return CollectiveResult(self._view.epoch, self._view.node_ids, x)

    def barrier(self) -> CollectiveResult[None]:
        self._run("barrier")
        return CollectiveResult(self._view.epoch, self._view.node_ids, None)


@pytest.fixture
def released() -> Iterator[None]:
    yield
    fdist.release()


def test_inside_a_step_torch_calls_run_on_the_session(released: None) -> None:
    s = SoloSession("a")
    with fdist.bound(s):
        assert dist.is_initialized() and dist.get_rank() == 0 and dist.get_world_size() == 1
        assert dist.get_backend() == "ftmesh"
        t = torch.ones(3)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out = [None]
        dist.all_gather_object(out, {"acc": 0.5})
        assert out == [{"acc": 0.5}]
        objs: list[Any] = [[1, "two"]]
        dist.broadcast_object_list(objs, src=0)
        assert objs == [[1, "two"]]
        dist.barrier()
        gathered = [torch.zeros(2)]
        dist.all_gather(gathered, torch.tensor([1.0, 2.0]))
        assert torch.equal(gathered[0], torch.tensor([1.0, 2.0]))
        with pytest.raises(ValueError, match="reduces sum/avg/min/max"):
            dist.all_reduce(t, op=dist.ReduceOp.PRODUCT)
    assert s.calls[0] == "allreduce/max" and "barrier" in s.calls and "allgather" in s.calls
    assert any(c.startswith("broadcast/") for c in s.calls)


def test_outside_a_step_calls_fail_at_once_and_the_group_follows_the_view(
    released: None,
) -> None:
    with fdist.bound(SoloSession("a")):
        old = dist.group.WORLD
    assert dist.is_initialized()  # between steps: still initialised, but no collective
    with pytest.raises(fdist.OutsideStepError):
        dist.all_reduce(torch.ones(1))
    with pytest.raises(fdist.OutsideStepError):
        dist.barrier()
    b = SoloSession("b")  # another view: the default group is made anew for it
    with fdist.bound(b):
        assert dist.group.WORLD is not old
        dist.all_reduce(torch.ones(1))
        # a group kept from the view left: torch refuses it (destroyed), and so does the
        # group itself if called directly
        with pytest.raises(ValueError, match="not initialized"):
            dist.all_reduce(torch.ones(1), group=old)
        with pytest.raises(fdist.StaleGroupError):
            old.allreduce([torch.ones(1)], dist.AllreduceOptions())
        with pytest.raises(ValueError, match="already bound"), fdist.bound(b):
            pass
    assert b.calls == ["allreduce/sum"]


def test_a_session_failure_raises_its_typed_error_out_of_dist(released: None) -> None:
    with fdist.bound(SoloSession("a", fail=True)):
        with pytest.raises(RingPeerLostError):
            dist.all_reduce(torch.ones(2))
        with pytest.raises(RingPeerLostError):
            dist.all_gather_object([None], 1)


def _read(p: subprocess.Popen[str], until: str, timeout: float = 90) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    eof: list[str] = []

    def read() -> None:
        assert p.stdout is not None
        for raw in p.stdout:
            if raw.startswith("{"):
                out.append(json.loads(raw))
                if out[-1]["event"] == until:
                    return
        eof.append("eof")

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive() and not eof, f"no {until!r} in {timeout}s: {out}"
    return out


def test_metric_sync_and_eval_gather_on_three_processes_with_a_kill(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(tmp_path)],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(3)
    ]
    try:
        first = [_read(p, "phase1")[-1] for p in procs]
        assert {f["world"] for f in first} == {3} and {f["rank"] for f in first} == {0, 1, 2}
        for key in ("metric", "evals", "bcast"):
            assert len({json.dumps(f[key]) for f in first}) == 1, [f[key] for f in first]
        assert all(f["outside"] == "OutsideStepError" for f in first)
        victim = next(i for i, f in enumerate(first) if f["rank"] == 2)
        os.kill(procs[victim].pid, signal.SIGKILL)
        survivors = [i for i in range(3) if i != victim]
        outs = [_read(procs[i], "done") for i in survivors]
        for out in outs:  # the step's all_reduce waiting for the killed member: typed error
            failed = [e for e in out if e["event"] == "failed"]
            assert failed and failed[0]["error"] in ("RingPeerLostError", "ViewSupersededError")
        done = [out[-1] for out in outs]
        assert {d["world"] for d in done} == {2} and {d["rank"] for d in done} == {0, 1}
        for key in ("metric", "evals"):
            assert done[0][key] == done[1][key]
        metric = np.array(done[0]["metric"])
        assert metric[1] == 2 * 100  # both survivors' sample counts, nobody else's
        for i in survivors:
            assert procs[i].wait(30) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)


def test_the_trainer_binds_torch_distributed_inside_each_step(tmp_path: Path) -> None:
    """``ElasticTrainer`` (``TrainerConfig.torch_distributed``, on by default): a script whose
    step body syncs a metric with ``dist.all_reduce`` and gathers an evaluation with
    ``dist.all_gather_object``, unchanged, on 3 workers with a kill -- every committed step
    saw the whole global batch, with the view's world size, the same on every worker."""
    res = launch(tmp_path, "-n", "3", "--kill-at", "8", str(ROOT / "tests/scripts/dist_in_step.py"))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    by_step: dict[int, list[dict[str, Any]]] = {}
    for log in sorted(tmp_path.glob("w*.log")):
        for line in log.read_text().splitlines():
            if line.startswith("DIST "):
                rec = json.loads(line[len("DIST ") :])
                by_step.setdefault(rec["step"], []).append(rec)
    assert len(by_step) == 60 and all(len(v) >= 2 for v in by_step.values()), by_step.keys()
    worlds = set()
    for step, recs in by_step.items():
        for rec in recs:
            assert rec["initialized"] and rec["metric"] == 24.0, (step, rec)
            assert rec["world"] == len(rec["gathered"]), (step, rec)
            assert sum(g["seen"] for g in rec["gathered"]) == 24, (step, rec)
            assert sorted(g["rank"] for g in rec["gathered"]) == list(range(rec["world"]))
            worlds.add(rec["world"])
        assert len({json.dumps(r["gathered"], sort_keys=True) for r in recs}) == 1, recs
    assert worlds == {2, 3}  # before and after the kill
