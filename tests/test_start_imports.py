"""A member's start-up loads only what it runs (issue #30: a joiner's process start -> first
step): no wall-clock assert, the modules themselves.

* A plain trainer (``ElasticTrainer`` on an ``ElasticSampler``, ``local`` discovery, no
  secret, no GPU), connected and trained for a few steps in a fresh interpreter, has not
  loaded zeroconf, ifaddr nor ``discovery.mdns`` (``mdns`` discovery only), the GPU path
  (``mesh.gpu``, ``collective.epochs``), cryptography, nor the modules of the features it
  was not given (``ShardedStream``, DiLoCo, ``recovery="keep"``, ``shard_optimizer``,
  checkpoints), nor the lab, the bench or the command line. The same interpreter then reads
  the lazy names (``ftmesh.torch.ShardedStream``, ``ftmesh.discovery.MdnsDiscovery``) and
  finds them loaded: the faces still work.
* ``python -m ftmesh worker ...`` (every process of ``ftmesh launch``) parses its command line
  without importing the other subcommands' modules (the lab, the launcher and its live view,
  checkpoint export), and its parser gives the same namespace as the whole parser.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from ftmesh.cli.main import build_parser, command_of, worker_parser

ROOT = Path(__file__).resolve().parent.parent

NOT_AT_START = (
    "zeroconf",
    "ifaddr",
    "cryptography",
    "cupy",
    "ftmesh.discovery.mdns",
    "ftmesh.mesh.gpu",
    "ftmesh.collective.epochs",
    "ftmesh.collective.tcp_backend",
    "ftmesh.collective.torch_pg",
    "ftmesh.torch.stream",
    "ftmesh.torch.diloco",
    "ftmesh.torch.keep",
    "ftmesh.torch.zero",
    "ftmesh.state.checkpoint",
    "ftmesh.state.export",
    "ftmesh.metrics",
    "ftmesh.lab",
    "ftmesh.cli",
    "ftmesh.sim",
    "ftmesh.lightning",
)
"""Modules (and packages) a plain trainer's member does not need before its first step."""


def _loaded(modules: list[str], prefixes: tuple[str, ...]) -> list[str]:
    return sorted(m for m in modules if any(m == p or m.startswith(p + ".") for p in prefixes))


# Runs in a fresh interpreter: connects (local discovery), trains a few steps alone, prints
# the modules loaded by then, then those after reading the lazy names.
TRAIN = r"""
import json, sys
import numpy as np
import torch
import torch.nn.functional as F
import ftmesh
from ftmesh.torch import ElasticSampler, ElasticTrainer

torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(64, 4), torch.randint(0, 2, (64,))
sampler = ElasticSampler(64, 8, seed=0)

def loss_fn(idx):
    i = torch.from_numpy(idx)
    return F.cross_entropy(model(x[i]), y[i])

with ftmesh.connect() as mesh:
    trainer = ElasticTrainer(mesh, model, opt, sampler, min_peers=1)
    steps = [trainer.step(loss_fn).step for _ in range(3)]
    started = sorted(sys.modules)
import ftmesh.torch, ftmesh.discovery
assert ftmesh.torch.ShardedStream.__module__ == "ftmesh.torch.stream"
assert ftmesh.discovery.MdnsDiscovery.__module__ == "ftmesh.discovery.mdns"
print(json.dumps({"steps": steps, "started": started, "after": sorted(sys.modules)}))
"""


@pytest.mark.slow
def test_a_plain_trainer_trains_without_loading_what_it_does_not_use(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "FTMESH_MESH": f"start-imports-{uuid.uuid4().hex[:8]}",
        "FTMESH_DISCOVERY": "local",
        "FTMESH_REGISTRY_DIR": str(tmp_path),
        "FTMESH_PRESET": "local",
        "OMP_NUM_THREADS": "1",
    }
    for name in [n for n in env if n.startswith("FTMESH_SECRET")]:
        del env[name]  # no secret: cryptography stays out
    res = subprocess.run(
        [sys.executable, "-c", TRAIN],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
        env=env,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["steps"] == [1, 2, 3]
    started = out["started"]
    # the probe did run the paths that matter
    for needed in ("ftmesh.torch.trainer", "ftmesh.discovery.local", "ftmesh.mesh.blocking"):
        assert needed in started
    assert _loaded(started, NOT_AT_START) == []
    # the lazy names still resolve, loading their modules then
    after = out["after"]
    for lazy in ("ftmesh.torch.stream", "ftmesh.discovery.mdns", "zeroconf"):
        assert lazy in after, lazy


WORKER_ARGV = ["-vv", "worker", "--discovery", "local", "--mesh", "m", "train.py", "--lr", "1"]

PARSE = r"""
import json, sys
from ftmesh.cli.main import worker_parser, command_of
assert command_of(sys.argv[1:]) == "worker"
args = worker_parser().parse_args(sys.argv[1:])
print(json.dumps({"args": vars(args), "modules": sorted(sys.modules)}))
"""


def test_the_worker_command_parses_without_the_other_commands() -> None:
    res = subprocess.run(
        [sys.executable, "-c", PARSE, *WORKER_ARGV],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout)
    others = (
        "ftmesh.lab",
        "ftmesh.cli.launch_cmd",
        "ftmesh.cli.lab_cmd",
        "ftmesh.cli.checkpoint_cmd",
        "ftmesh.cli.live_view",
        "ftmesh.state.export",
        "ftmesh.discovery.mdns",
        "zeroconf",
    )
    assert _loaded(out["modules"], others) == []
    assert out["args"]["target"] == ["train.py", "--lr", "1"]
    assert out["args"]["verbose"] == 2


@pytest.mark.parametrize(
    "argv",
    [
        WORKER_ARGV,
        ["worker", "-m", "pkg.train", "--epochs", "2"],
        ["--verbose", "worker", "--preset", "local", "--start-peers", "3", "t.py"],
        ["worker", "--final-report", "/tmp/r.json", "t.py"],
    ],
)
def test_the_worker_parser_reads_a_command_line_as_the_whole_parser_does(
    argv: list[str],
) -> None:
    assert command_of(argv) == "worker"
    assert vars(worker_parser().parse_args(argv)) == vars(build_parser().parse_args(argv))


def test_a_bad_worker_flag_is_refused_alike(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["worker", "--no-such-flag", "t.py"]
    errors = []
    for parser in (worker_parser(), build_parser()):
        with pytest.raises(SystemExit) as exc:
            parser.parse_args(argv)
        assert exc.value.code == 2
        errors.append(capsys.readouterr().err.splitlines()[-1])
    assert errors[0] == errors[1]
    assert "--no-such-flag" in errors[0]


@pytest.mark.parametrize(
    ("argv", "command"),
    [
        (["worker", "t.py"], "worker"),
        (["-v", "worker"], "worker"),
        (["-vvv", "--verbose", "launch", "-n", "2"], "launch"),
        (["--version"], None),
        (["-h", "worker"], None),
        (["-x", "worker"], None),
        ([], None),
        (["status", "worker"], "status"),
    ],
)
def test_command_of_names_the_subcommand(argv: list[str], command: str | None) -> None:
    assert command_of(argv) == command
