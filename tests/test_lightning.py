"""Lightning Fabric on the mesh (``ftmesh.lightning.FtmeshStrategy``): ftmesh imports without
Lightning; what the strategy refuses, in one process, before any mesh; Fabric's single-device
run of ``examples/fabric_digits.py`` is bitwise ``train_digits.py --single``; and under
``ftmesh launch -n 3 --kill-at 20 --join-at 21 examples/fabric_digits.py --step-delay 0.05``
(docs/PORTING.md, as written) the Fabric script commits every step once, with identical
states, a ``fabric.all_reduce`` metric that counts each step's whole global batch, and the
single-process accuracy."""

from __future__ import annotations

import copy
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tests_support import ROOT, References, SingleRun, check_consistency, launch, progress

import ftmesh

torch = pytest.importorskip("torch")
pytest.importorskip("lightning")
from lightning.fabric import Fabric  # noqa: E402
from lightning.fabric.plugins.precision import MixedPrecision  # noqa: E402

from ftmesh.errors import LocalUsageError  # noqa: E402
from ftmesh.lightning import FtmeshStrategy  # noqa: E402
from ftmesh.torch import ElasticSampler  # noqa: E402
from ftmesh.torch.distributed import OutsideStepError  # noqa: E402

FABRIC = str(ROOT / "examples" / "fabric_digits.py")


def test_ftmesh_imports_without_lightning() -> None:
    code = (
        "import sys\n"
        "import ftmesh, ftmesh.torch, ftmesh.lightning\n"
        "assert 'lightning' not in sys.modules, 'imported eagerly'\n"
        "sys.modules['lightning'] = None  # as if not installed\n"
        "try:\n"
        "    ftmesh.lightning.FtmeshStrategy\n"
        "except ModuleNotFoundError as exc:\n"
        "    print(exc)\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert "pip install 'ftmesh[lightning]'" in res.stdout, res.stdout


def _fabric(**kw: object) -> tuple[Fabric, FtmeshStrategy, ElasticSampler]:
    sampler = ElasticSampler(64, 8)
    strategy = FtmeshStrategy(sampler)
    fabric = Fabric(strategy=strategy, accelerator="cpu", **kw)  # type: ignore[arg-type]
    fabric.launch()
    return fabric, strategy, sampler


def test_collectives_outside_a_step_raise_at_once() -> None:
    fabric, _, _ = _fabric()
    net = torch.nn.Linear(2, 1)
    fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    assert (fabric.global_rank, fabric.world_size, fabric.is_global_zero) == (0, 1, True)
    assert fabric.device == torch.device("cpu")
    calls = {
        "all_reduce": lambda: fabric.all_reduce(torch.ones(2)),
        "all_gather": lambda: fabric.all_gather(torch.ones(2)),
        "barrier": fabric.barrier,
        "broadcast": lambda: fabric.broadcast({"x": 1}),
    }
    for name, call in calls.items():
        with pytest.raises(OutsideStepError, match=rf"fabric\.{name}\(\) ran outside a step"):
            call()


def test_what_the_strategy_refuses() -> None:
    fabric, strategy, _ = _fabric()
    with pytest.raises(LocalUsageError, match=r"fabric\.setup\(model, optimizer\)"):
        strategy.trainer  # noqa: B018  (no model yet)
    net = torch.nn.Linear(2, 1)
    o1 = torch.optim.SGD(net.parameters(), lr=0.1)
    o2 = torch.optim.SGD(net.parameters(), lr=0.1)
    with pytest.raises(LocalUsageError, match="one model with one optimizer, got 2"):
        fabric.setup(net, o1, o2)
    model, _ = fabric.setup(net, o1)
    with pytest.raises(LocalUsageError, match="one model"):
        fabric.setup(torch.nn.Linear(2, 1))
    with pytest.raises(LocalUsageError, match="micro_batch"), fabric.no_backward_sync(model):
        pass
    with fabric.no_backward_sync(model, enabled=False):  # a no-op stays allowed
        pass
    with pytest.raises(LocalUsageError, match="checkpoint_dir"):
        fabric.save("unused.ckpt", {"model": model})
    with pytest.raises(LocalUsageError, match="checkpoint_dir"):
        fabric.load("unused.ckpt")
    # the training data is the trainer's; an evaluation loader passes through unchanged
    data = torch.utils.data.TensorDataset(torch.zeros(8, 2))
    train = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
    own = FtmeshStrategy(train)
    f2 = Fabric(strategy=own, accelerator="cpu")
    f2.launch()
    with pytest.raises(LocalUsageError, match=r"step\.batches\(\)"):
        f2.setup_dataloaders(train)
    evaluation = f2.setup_dataloaders(torch.utils.data.DataLoader(data, batch_size=4))
    assert sum(len(b[0]) for b in evaluation) == 8  # whole, no DistributedSampler
    # a gradient scaler (16-mixed) would see gradients the trainer has not reduced
    f3, _, _ = _fabric(plugins=[MixedPrecision("16-mixed", device="cpu")])
    with pytest.raises(LocalUsageError, match="16-mixed"):
        f3.setup(torch.nn.Linear(2, 1), torch.optim.SGD(net.parameters(), lr=0.1))
    f4, _, _ = _fabric(precision="64-true")
    with pytest.raises(LocalUsageError, match="not 64-true"):
        f4.setup(torch.nn.Linear(2, 1), torch.optim.SGD(net.parameters(), lr=0.1))


def test_collectives_inside_a_step_run_on_the_step_members(tmp_path: Path) -> None:
    """A real one-member mesh in this process: inside ``with step:`` every Fabric collective
    runs through the ``ftmesh`` backend on the step's session, ranks are the step's, the step
    commits; after it the same calls raise again. (Three members: the end-to-end test.)"""
    mesh = ftmesh.connect(
        mesh="fabric-solo", registry_dir=str(tmp_path), preset="local", start_peers=1,
        environ={}, handle_signals=False,
    )  # fmt: skip
    sampler = ElasticSampler(16, 4)
    strategy = FtmeshStrategy(sampler, mesh=mesh, start_timeout=5.0, micro_batch=2)
    fabric = Fabric(strategy=strategy, accelerator="cpu")
    fabric.launch()
    torch.manual_seed(0)
    net = torch.nn.Linear(2, 1)
    plain = copy.deepcopy(net)
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    x = torch.randn(16, 2)
    seen: dict[str, object] = {}
    try:
        for step in strategy.steps(2):
            with step:
                for idx in step.indices():  # two micro-batches of 2
                    # through Fabric's wrapper to the trainer's: the sum of the micro-batches
                    # is kept (torch's own would zero the buckets)
                    optimizer.zero_grad(set_to_none=False)
                    fabric.backward(model(x[torch.from_numpy(idx)]).pow(2).mean())
                t = torch.tensor([1.0, 3.0])
                seen["mean"] = fabric.all_reduce(t, reduce_op="mean")
                seen["same"] = seen["mean"] is t  # in place, as Fabric's DDP
                seen["ints"] = fabric.all_reduce(torch.tensor([5]), reduce_op="mean")
                seen["gather"] = fabric.all_gather(torch.tensor([[1.0, 2.0]]))
                seen["cast"] = fabric.broadcast({"lr": 0.1}, src=0)
                fabric.barrier()
                seen["vote"] = strategy.reduce_boolean_decision(True)
                seen["ranks"] = (fabric.global_rank, fabric.world_size, fabric.is_global_zero)
                optimizer.step()
            assert step.report is not None and step.report.samples == 4
        assert strategy.trainer.committed == 2
        optimizer.zero_grad()  # outside a step: torch's own, through the trainer's
        assert all(p.grad is None for p in net.parameters())
        # the same two steps in plain PyTorch, each on its whole global batch
        sgd = torch.optim.SGD(plain.parameters(), lr=0.1)
        for n in range(2):
            sgd.zero_grad()
            plain(x[torch.from_numpy(sampler.global_indices(n))]).pow(2).mean().backward()
            sgd.step()
        for a, b in zip(net.parameters(), plain.parameters(), strict=True):
            torch.testing.assert_close(a, b)
        assert torch.equal(seen["mean"], torch.tensor([1.0, 3.0]))  # type: ignore[arg-type]
        assert seen["same"] is True
        assert torch.equal(seen["ints"], torch.tensor([5]))  # type: ignore[arg-type]
        assert torch.equal(seen["gather"], torch.tensor([[[1.0, 2.0]]]))  # type: ignore[arg-type]
        assert seen["cast"] == {"lr": 0.1} and seen["vote"] is True
        assert seen["ranks"] == (0, 1, True)
        with pytest.raises(OutsideStepError):
            fabric.all_reduce(torch.ones(1))
    finally:
        strategy.teardown()
        mesh.close()


@pytest.mark.parametrize(
    ("precision", "dtype"), [("bf16-mixed", "float32"), ("bf16-true", "bfloat16")]
)
def test_bfloat16_precisions_train(tmp_path: Path, precision: str, dtype: str) -> None:
    mesh = ftmesh.connect(
        mesh="fabric-bf16", registry_dir=str(tmp_path), preset="local", start_peers=1,
        environ={}, handle_signals=False,
    )  # fmt: skip
    strategy = FtmeshStrategy(ElasticSampler(16, 4), mesh=mesh, start_timeout=5.0)
    fabric = Fabric(strategy=strategy, accelerator="cpu", precision=precision)  # type: ignore[arg-type]
    fabric.launch()
    net = torch.nn.Linear(2, 1)
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    before = net.weight.detach().clone()  # (converted by the precision plugin)
    x = torch.randn(16, 2)
    try:
        for step in strategy.steps(2):
            with step:
                for idx in step.indices():
                    fabric.backward(model(x[torch.from_numpy(idx)]).float().pow(2).mean())
                optimizer.step()
        assert strategy.trainer.committed == 2
        assert str(net.weight.dtype) == f"torch.{dtype}"
        assert not torch.equal(net.weight.detach(), before)  # it trained
    finally:
        strategy.teardown()
        mesh.close()


def _digest(text: str) -> str:
    found = re.findall(r"final digest ([0-9a-f]{64})$", text, re.M)
    assert found, text[-2000:]
    return found[-1]


@pytest.mark.slow
def test_fabric_single_device_is_train_digits_single(references: References) -> None:
    """Fabric's path (precision plugin's backward, the optimizer wrapper) is the same math as
    the plain script: the single-process runs end bitwise equal, so the mesh run below is
    compared with the very baseline the other digits tests use."""
    fabric_single = references.run("--single", script=FABRIC, timeout=300)
    plain_single = references.run("--single")
    assert _digest(fabric_single.out) == _digest(plain_single.out)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_fabric_script_trains_through_a_kill_and_a_join(
    tmp_path: Path, single_run: SingleRun
) -> None:
    logs = tmp_path / "mesh"
    # the joiner starts right after the kill; importing Lightning on a loaded host takes it
    # ~10-15 s, while the paced steps (--step-delay) leave it most of the run to land in
    chaos = ["--kill-at", "20", "--join-at", "21"]
    res = launch(logs, "-n", "3", *chaos, FABRIC, "--step-delay", "0.05", timeout=220)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert res.stdout.count("kill -9") == 1, res.stdout[-3000:]
    records = progress(logs)
    assert sorted(records) == ["w0", "w1", "w2", "w3"], sorted(records)  # three and a joiner
    done = {name: r[-1] for name, r in records.items() if r and r[-1].get("done")}
    assert len(done) == 3, "the killed worker is the only one not finishing"
    assert len({str(r["digest"]) for r in done.values()}) == 1, "final states differ"
    total = int(records["w0"][0]["total"])  # type: ignore[call-overload]
    check_consistency(records, total)  # every step once, same digest on every member
    steps = [r for recs in records.values() for r in recs if "done" not in r]
    computed = [r for r in steps if not r["adopted"]]
    # fabric.all_reduce inside the step ran on exactly the step's members: their shares add
    # up to the global batch, whoever was alive
    assert computed and all(r["seen"] == r["samples"] == 32 for r in computed)
    # Fabric's ranks are the ring's of the step
    assert all(r["world"] == r["members"] and 0 <= r["rank"] < r["world"] for r in computed)  # type: ignore[operator]
    assert {r["members"] for r in steps} >= {2, 3}, "the kill or the join never showed"
    joiner = records["w3"]
    # it entered mid-run with the others' state (its first step: adopted by its sync)
    assert 21 < int(joiner[0]["step"]) < total and joiner[0]["synced"]  # type: ignore[call-overload]
    assert any(not r["adopted"] for r in joiner), "the joiner never computed"
    accs = [float(a) for a in re.findall(r"^test accuracy: (0\.\d+)$", res.stdout, re.M)]
    assert accs and len(set(accs)) == 1, accs  # (launch prints the survivors' last lines)
    assert abs(single_run.accuracy() - accs[0]) <= 0.01, (accs, single_run.accuracy())
    assert np.isfinite([float(r["loss"]) for r in computed]).all()  # type: ignore[arg-type]
