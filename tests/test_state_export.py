"""``ftmesh checkpoint export``: a checkpoint (model with a bfloat16 layer, SGD momentum, a
scheduler, scalars) exported with ``torch.save`` and as safetensors, read back by torch and by
the safetensors package, loads into fresh objects bit for bit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from tests_support import ROOT

from ftmesh.errors import LocalUsageError
from ftmesh.state import State, save_checkpoint
from ftmesh.state.export import export_checkpoint


def _objects() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.StepLR]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2).to(torch.bfloat16))
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)


@pytest.fixture
def checkpoint(tmp_path: Path) -> tuple[Path, torch.nn.Module, torch.optim.Optimizer]:
    model, opt, sched = _objects()
    x = torch.randn(5, 4)
    model[1](model[0](x).to(torch.bfloat16)).float().sum().backward()  # type: ignore[no-untyped-call]
    opt.step()
    sched.step()
    state = State(model=model, optimizer=opt, scheduler=sched, rng=False)
    state.scalars["best"] = 0.75
    save_checkpoint(tmp_path / "ck", state.commit(step=7))
    return tmp_path / "ck", model, opt


def test_the_command_exports_the_model_for_load_state_dict(
    checkpoint: tuple[Path, torch.nn.Module, torch.optim.Optimizer], tmp_path: Path
) -> None:
    directory, model, _ = checkpoint
    out = tmp_path / "model.pt"
    cmd = [sys.executable, "-m", "ftmesh", "checkpoint", "export", str(directory), str(out)]
    res = subprocess.run([*cmd, "--part", "model"], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    assert "exported step 7 (model: 4 tensors" in res.stdout
    fresh, _, _ = _objects()
    fresh.load_state_dict(torch.load(out))
    for a, b in zip(fresh.state_dict().values(), model.state_dict().values(), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    missing = subprocess.run(
        [*cmd[:-2], str(tmp_path / "nope"), str(out)], capture_output=True, text=True, cwd=ROOT
    )
    assert missing.returncode == 2 and "no such checkpoint" in missing.stderr


def test_a_whole_torch_export_restores_every_part(
    checkpoint: tuple[Path, torch.nn.Module, torch.optim.Optimizer], tmp_path: Path
) -> None:
    directory, _, opt = checkpoint
    done = export_checkpoint(directory, tmp_path / "all.pt")
    assert done.step == 7 and done.parts == ("model", "optimizer", "scalars", "scheduler")
    everything = torch.load(tmp_path / "all.pt")
    assert everything["step"] == 7 and everything["scalars"] == {"best": 0.75}
    m, o, s = _objects()
    m.load_state_dict(everything["model"])
    o.load_state_dict(everything["optimizer"])
    s.load_state_dict(everything["scheduler"])
    assert o.param_groups[0]["lr"] == 0.25 and s.last_epoch == 1
    for p, q in zip(o.state.values(), opt.state.values(), strict=True):
        assert torch.equal(p["momentum_buffer"], q["momentum_buffer"])


def test_safetensors_exports_read_back_with_the_safetensors_package(
    checkpoint: tuple[Path, torch.nn.Module, torch.optim.Optimizer], tmp_path: Path
) -> None:
    directory, model, opt = checkpoint
    export_checkpoint(directory, tmp_path / "model.safetensors", part="model")
    fresh, _, _ = _objects()
    fresh.load_state_dict(load_file(tmp_path / "model.safetensors"))
    assert all(
        torch.equal(a, b)
        for a, b in zip(fresh.state_dict().values(), model.state_dict().values(), strict=True)
    )
    export_checkpoint(directory, tmp_path / "all.safetensors")
    tensors = load_file(tmp_path / "all.safetensors")
    assert tensors["model.1.weight"].dtype == torch.bfloat16
    assert torch.equal(
        tensors["optimizer.state.0.momentum_buffer"], opt.state[model[0].weight]["momentum_buffer"]
    )
    with safe_open(tmp_path / "all.safetensors", "pt") as f:
        meta = f.metadata()
    assert meta["ftmesh_step"] == "7"
    tree = json.loads(meta["ftmesh"])
    assert tree["scalars"] == {"best": 0.75} and tree["optimizer"]["param_groups"][0]["lr"] == 0.25
    with pytest.raises(LocalUsageError, match="has no part 'ema'"):
        export_checkpoint(directory, tmp_path / "x.pt", part="ema")
