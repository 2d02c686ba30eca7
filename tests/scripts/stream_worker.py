"""A worker training on a ``ShardedStream`` (``tests/test_stream_launch.py``), run under
``ftmesh launch``: 12 shards of 20 to 53 samples (438 in all), global batches of 16, two
epochs (``trainer.epochs``), a small linear model.

Each sample carries its id (``shard * 1000 + offset``). The worker appends JSON lines to
``$STREAM_RECORD_DIR/<node id>.jsonl``, flushed at once (a SIGKILL loses nothing written):
``draw`` when an attempt hands it its micro-batch (before its gradients are reduced: the
step id, the attempt's view and the sample ids), and ``commit`` after every step it
committed itself (the step, the committed attempt's view, the members computing it, the
epoch). A test joins the two: the ids of a committed step are the draws of its members on
its view. ``$STREAM_DRAW_DELAY`` seconds are spent inside each step, after its draws, so
that a kill from the launcher fails an attempt in which the others had drawn (a kill
between steps need not: survivors that drop the dead member before their next step starts
never draw on the old view)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

import ftmesh
from ftmesh.torch import ElasticTrainer, ShardedStream

DRAW_DELAY = float(os.environ.get("STREAM_DRAW_DELAY") or 0)
LENGTHS = [20 + 3 * k for k in range(12)]
FEATURES, CLASSES, BATCH, EPOCHS = 8, 3, 16, 2


def sample(shard: int, offset: int) -> tuple[int, torch.Tensor, int]:
    sid = shard * 1000 + offset
    x = torch.sin(torch.arange(FEATURES, dtype=torch.float32) * ((sid % 89) + 1) * 0.07)
    return sid, x, sid % CLASSES


def open_shard(shard: int, offset: int) -> Iterator[tuple[int, torch.Tensor, int]]:
    return (sample(shard, i) for i in range(offset, LENGTHS[shard]))


def main() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(FEATURES, CLASSES)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    stream = ShardedStream(len(LENGTHS), open_shard, batch_size=BATCH)
    trainer = ElasticTrainer(ftmesh.connect(), model, optimizer, stream)
    out_dir = Path(os.environ["STREAM_RECORD_DIR"])
    out = open(out_dir / f"{trainer.mesh.node_id}.jsonl", "a")  # noqa: SIM115

    def write(record: dict[str, object]) -> None:
        out.write(json.dumps(record) + "\n")
        out.flush()

    for _ in trainer.epochs(EPOCHS):
        for step in trainer.steps():
            with step:
                for ids, x, y in step.batches():
                    view = step.action.view.epoch
                    write({"draw": step.index, "view": view, "ids": ids.tolist()})
                    time.sleep(DRAW_DELAY)  # (inside the step: a kill lands after the draws)
                    F.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
                optimizer.step()
            report = step.report
            if report is not None and not report.adopted:
                write(
                    {
                        "commit": step.index,
                        "view": step.action.view.epoch,
                        "workers": list(step.workers),
                        "epoch": step.epoch,
                    }
                )
    pos = trainer.stream_position
    assert pos is not None
    write({"done": trainer.committed, "epoch": pos.epoch, "digest": trainer.digest()})
    out.close()


if __name__ == "__main__":
    main()
