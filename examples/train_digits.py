"""Train a small CNN on scikit-learn's handwritten digits, elastically, on an ftmesh mesh.

Real data with no download (the 1,797 8x8 digits ship with scikit-learn); 20% is held out as
the test set. Run it on a local mesh with ``ftmesh launch``:

    ftmesh launch -n 4 --kill-at 20 --join-at 40 examples/train_digits.py

or on several machines with ``ftmesh worker examples/train_digits.py`` on each. With
``--single`` it trains in one process without a mesh (the baseline the tests compare with).
The last lines are ``test loss: N.NNNN`` (the held-out cross-entropy) and ``test accuracy:
0.NNN``. SIGTERM or SIGINT makes a worker leave the mesh after its current step and exit 0
(``ftmesh.Departed``); the others train on.

``--idle-when-done`` is for a StatefulSet (``examples/k8s/``), which restarts a container
that exits: the worker stays up after training until SIGTERM, and a worker whose
``--checkpoint-dir`` already holds the last step (make ``--checkpoint-every`` divide the
run's steps) does not train again but idles the same way. An Indexed Job
(``examples/k8s/ftmesh-job.yaml``) wants the opposite: exit 0 once the run is done, and
``--departed-exit-code`` (e.g. 143) after a planned departure, so that exit 0 means only that.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import logging
import os
import sys
import time
import uuid

import ftmesh
import numpy as np
import torch
import torch.nn.functional as F
from ftmesh.state import State
from ftmesh.torch import DiLoCo, ElasticSampler, ElasticTrainer
from torch import nn


class DigitsNet(nn.Module):
    """Two convolutions, then one hidden layer of 64 units (13.7K parameters); ``hidden=N``:
    of N units instead (2.3M parameters at 16384: a gradient large enough for a slow link to
    matter)."""

    def __init__(self, hidden: int = 0) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 2 * 2, hidden or 64)
        self.fc2 = nn.Linear(hidden or 64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def load_data(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """scikit-learn's 1,797 digits (pixels 0-16 -> 0-1), split at random by ``seed``: 20%
    (360) held out as the test set, 1,437 to train on.

    Read from the file scikit-learn ships (what ``sklearn.datasets.load_digits`` reads)
    without importing scikit-learn: its import (SciPy) costs about 1.2 s of CPU at every
    worker's start, joiners' included."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("train_digits.py needs scikit-learn (its digits): pip install scikit-learn")
    path = os.path.join(spec.submodule_search_locations[0], "datasets", "data", "digits.csv.gz")
    with gzip.open(path, "rt") as f:
        data = np.loadtxt(f, delimiter=",", dtype=np.float32)
    x = (data[:, :-1] / 16.0).reshape(-1, 1, 8, 8)
    y = data[:, -1].astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(y))
    n_test = -(-len(y) // 5)
    test, train = order[:n_test], order[n_test:]
    return (
        torch.from_numpy(x[train]),
        torch.from_numpy(y[train]),
        torch.from_numpy(x[test]),
        torch.from_numpy(y[test]),
    )


def evaluation(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """The test accuracy and the held-out loss (mean cross-entropy, comparable across sync
    modes, unlike a step's training loss: a DiLoCo round reports its inner steps' mean); the
    fields of ``--eval-every``'s progress records."""
    with torch.no_grad():
        out = model(x)
        return {
            "accuracy": float((out.argmax(1) == y).float().mean()),
            "test_loss": round(float(F.cross_entropy(out, y)), 4),
        }


def progress(record: dict[str, object]) -> None:
    """A line ``ftmesh launch`` shows in its live view."""
    # One write call: a log line on stderr (same pipe under ftmesh launch) cannot land
    # between the record and its newline.
    sys.stdout.write("FTMESH " + json.dumps(record) + "\n")
    sys.stdout.flush()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-peers", type=int, default=1)
    p.add_argument(
        "--hidden",
        type=int,
        default=0,
        metavar="N",
        help="a hidden layer of N units instead of 64 (2.3M parameters at 16384: a gradient "
        "large enough for a slow link to matter; 0: the small model)",
    )
    p.add_argument(
        "--diloco",
        type=int,
        default=0,
        metavar="H",
        help="DiLoCo rounds of H local steps (ftmesh.torch.diloco): a step is a round of "
        "H x --global-batch samples, each member runs H steps of its own on its share, then "
        "the outer Nesterov SGD step on the averaged outer gradient (0: synchronous steps)",
    )
    p.add_argument(
        "--fragments",
        type=int,
        default=1,
        metavar="F",
        help="streaming DiLoCo: F fragments of the model, one synced per step, a step of H/F "
        "inner steps and H/F x --global-batch samples (F must divide H)",
    )
    p.add_argument(
        "--overlap",
        action="store_true",
        help="DiLoCo: each step's sync travels while the step's inner steps run (the outer "
        "gradient taken as the step begins, merged one step late; with --fragments F, "
        "streaming DiLoCo's overlap)",
    )
    p.add_argument("--outer-lr", type=float, default=0.7, help="DiLoCo's outer learning rate")
    p.add_argument(
        "--outer-momentum",
        type=float,
        default=0.5,
        help="DiLoCo's outer (Nesterov) momentum; the paper's 0.9 diverges here, with H this "
        "small and the inner SGD's own momentum",
    )
    p.add_argument(
        "--max-peers",
        type=int,
        default=0,
        help="at most this many members compute gradients; the others are spares (0: no limit)",
    )
    p.add_argument(
        "--spares",
        choices=["hot", "cold"],
        default="hot",
        help="hot: spares stay in the ring, up to date; cold: they wait outside it",
    )
    p.add_argument(
        "--recovery",
        choices=["redo", "keep"],
        default="redo",
        help="after the loss of a member mid-step: redo (compute the step again, lossless) or "
        "keep (the survivors send the gradients they computed; the lost share is skipped)",
    )
    p.add_argument(
        "--step-delay",
        type=float,
        default=0.03,
        help="seconds to sleep after each step, so that a demo can be watched and a "
        "joiner's start-up (~5 s) lands mid-run; 0 for full speed",
    )
    p.add_argument(
        "--digest-every",
        type=int,
        default=10,
        help="report the state digest every N steps (tests compare members)",
    )
    p.add_argument(
        "--device",
        default="cpu",
        help="where the model trains: cpu, or cuda (each worker of `ftmesh launch` sees its own "
        "GPU; the gradients then reduce on the GPU through NCCL when every worker has one)",
    )
    p.add_argument("--single", action="store_true", help="train in one process, no mesh")
    p.add_argument(
        "--shard-optimizer",
        action="store_true",
        help="shard the optimizer state over the members (ZeRO-1) with --replicas copies",
    )
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument(
        "--eval-every",
        type=int,
        default=0,
        help="add the test accuracy and loss to the progress record every N steps "
        "(time-to-accuracy)",
    )
    p.add_argument(
        "--compression",
        choices=["none", "int8"],
        default="none",
        help="int8: gradients travel as blockwise int8 with error feedback (slow links)",
    )
    p.add_argument(
        "--shares",
        choices=["equal", "speed"],
        default="equal",
        help="speed: split each step's batch in proportion to the members' measured speed",
    )
    p.add_argument(
        "--straggler-factor",
        type=float,
        default=None,
        help="a worker that makes steps take more than this many times as long as they would "
        "without it, for --straggler-steps steps in a row, sits out as a hot spare and is "
        "retried after --readmit-steps (0: never; default: TrainerConfig's)",
    )
    p.add_argument(
        "--straggler-steps",
        type=int,
        default=None,
        help="slow steps in a row before a straggler sits out (default: TrainerConfig's)",
    )
    p.add_argument(
        "--readmit-steps",
        type=int,
        default=None,
        help="steps a straggler sits out before it computes again on trial "
        "(default: TrainerConfig's)",
    )
    p.add_argument(
        "--failslow-freezes",
        type=int,
        default=None,
        help="a worker that stood still (froze) in this many of its last --straggler-steps "
        "steps steps out of the ring for a while (0: never; default: TrainerConfig's)",
    )
    p.add_argument(
        "--failslow-pause",
        type=float,
        default=None,
        help="seconds a fail-slow worker stays out of the ring (default: TrainerConfig's)",
    )
    p.add_argument(
        "--log-indices",
        action="store_true",
        help="add the sample indices this member trained in each step to its progress "
        "record (tests check that every sample trains once per epoch)",
    )
    p.add_argument("--save-model", default=None, help="write the final weights here (torch.save)")
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument(
        "--departed-exit-code",
        type=int,
        default=0,
        help="exit status after a planned departure (SIGTERM/SIGINT: ftmesh.Departed); "
        "default 0. A Job sets it non-zero: there exit 0 must mean the run is done",
    )
    p.add_argument(
        "--idle-when-done",
        action="store_true",
        help="after training (or if --checkpoint-dir holds the last step already) stay in the "
        "mesh as 'done' until SIGTERM instead of exiting",
    )
    return p


def main() -> int:
    args = build_parser().parse_args()
    try:
        return train(args)
    except ftmesh.Departed as left:
        if not args.departed_exit_code:
            raise  # a SystemExit with status 0
        print(f"{left}: exit {args.departed_exit_code}", flush=True)
        return args.departed_exit_code


def train(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=os.environ.get("FTMESH_LOG", "WARNING"),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )

    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    x_train, y_train, x_test, y_test = (t.to(device) for t in load_data(args.seed))
    model = DigitsNet(args.hidden).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    # --diloco H: one step is a round of H x global_batch samples (the epoch's as many);
    # with --fragments F, of H/F inner steps
    sync = (
        DiLoCo(
            args.diloco,
            outer_lr=args.outer_lr,
            outer_momentum=args.outer_momentum,
            fragments=args.fragments,
            overlap=args.overlap,
        )
        if args.diloco
        else None
    )
    inner = sync.steps_per_sync if sync is not None else 1
    sampler = ElasticSampler(len(x_train), args.global_batch * inner, seed=args.seed)
    total = args.epochs * sampler.steps_per_epoch

    trained: list[np.ndarray] = []  # --log-indices: the micro-batches given to loss_fn

    def loss_fn(idx: np.ndarray) -> torch.Tensor:
        if args.log_indices:
            trained.append(idx)
        i = torch.from_numpy(idx).to(device)
        return F.cross_entropy(model(x_train[i]), y_train[i])

    started = time.monotonic()
    if args.single and args.diloco:
        raise SystemExit("--diloco trains on a mesh (rounds of members): not with --single")
    if args.single:
        for step in range(total):
            optimizer.zero_grad()
            loss_fn(sampler.global_indices(step)).backward()
            optimizer.step()
            if args.eval_every and (step + 1) % args.eval_every == 0:
                progress({"step": step + 1, **evaluation(model, x_test, y_test)})
    else:
        with ftmesh.connect() as mesh:
            trainer = ElasticTrainer(
                mesh,
                model,
                optimizer,
                sampler,
                min_peers=args.min_peers,
                max_peers=args.max_peers,
                spares=args.spares,
                checkpoint_dir=args.checkpoint_dir,
                checkpoint_every=args.checkpoint_every,
                shard_optimizer=args.shard_optimizer,
                replicas=args.replicas,
                compression=args.compression,
                shares=args.shares,
                recovery=args.recovery,
                sync=sync,
                **{  # the trainer's defaults unless given
                    name: value
                    for name in (
                        "straggler_factor",
                        "straggler_steps",
                        "readmit_steps",
                        "failslow_freezes",
                        "failslow_pause",
                    )
                    if (value := getattr(args, name)) is not None
                },
            )
            if trainer.resume() >= total:  # the checkpoint of the last step: the run is over
                print(f"training finished at step {trainer.committed} (checkpoint in "
                      f"{args.checkpoint_dir}): not training again", flush=True)  # fmt: skip
                mesh.set_role("done")
                if args.idle_when_done:
                    mesh.wait_leave_requested()
                return 0
            while trainer.committed < total:
                try:
                    r = trainer.step(loss_fn)
                except ftmesh.TrainingFinishedError:
                    print("the training finished without needing us", flush=True)
                    if args.idle_when_done:  # (a pod that exits is restarted: stay idle)
                        mesh.set_role("done")
                        mesh.wait_leave_requested()
                    return 0
                indices: list[int] = []
                if args.log_indices:  # the committed attempt ran last: its share is the tail
                    done = np.concatenate(trained) if trained else np.empty(0, np.int64)
                    indices = done[len(done) - r.share :].tolist() if r.share else []
                    trained.clear()
                every = args.digest_every
                report = every and r.step % every == 0
                progress(
                    {
                        "step": r.step,
                        "total": total,
                        "loss": round(r.loss, 4),
                        "samples": r.samples,
                        "skipped": r.skipped,
                        "members": len(r.members),
                        "share": r.share,
                        "computing": len(r.computing),
                        "fetched": r.sync_bytes,
                        "attempts": r.attempts,
                        "synced": r.synced,
                        "node": mesh.node_id,
                        "digest": trainer.digest() if report else None,
                        "shards": trainer.shard_digests() if report else None,
                        # DiLoCo: the outer optimizer's state alone (its momentum), which a
                        # joiner must receive with the global parameters
                        **(
                            {"outer": trainer.part_digests()["outer_optimizer"]}
                            if report and sync is not None
                            else {}
                        ),
                        "fallbacks": trainer.fallbacks,
                        **({"indices": indices} if args.log_indices else {}),
                        **(
                            evaluation(model, x_test, y_test)
                            if args.eval_every and r.step % args.eval_every == 0
                            else {}
                        ),
                    }
                )
                if args.step_delay:
                    time.sleep(args.step_delay)
            trainer.finish()
            progress(
                {
                    "done": True,
                    "step": trainer.committed,
                    "node": mesh.node_id,
                    "digest": trainer.digest(),
                }
            )
            report_result(args, model, optimizer, x_test, y_test, total, started)
            if args.idle_when_done:
                mesh.wait_leave_requested()
            return 0
    report_result(args, model, optimizer, x_test, y_test, total, started)
    return 0


def report_result(
    args: argparse.Namespace,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    x_test: torch.Tensor,
    y_test: torch.Tensor,
    total: int,
    started: float,
) -> None:
    if args.save_model:  # every worker of a mesh writes the same weights: replace atomically
        # A name of this worker's own: on a volume every pod shares (the Job's), each writer
        # is PID 1 of its container, so the pid alone would collide.
        tmp = f"{args.save_model}.{os.getpid()}-{uuid.uuid4().hex}.tmp"
        torch.save(model.state_dict(), tmp)
        os.replace(tmp, args.save_model)
    ev = evaluation(model, x_test, y_test)
    print(
        f"trained {total} steps in {time.monotonic() - started:.1f}s; "
        f"final digest {State(model=model, optimizer=optimizer, rng=False).live_digest()}"
    )
    print(f"test loss: {ev['test_loss']:.4f}")
    print(f"test accuracy: {ev['accuracy']:.3f}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
