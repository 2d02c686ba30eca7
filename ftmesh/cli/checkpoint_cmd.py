"""``ftmesh checkpoint export``: a checkpoint's state as a ``torch.save`` or safetensors file
(``ftmesh.state.export``)."""

from __future__ import annotations

import argparse
from typing import Any

from ..state.export import FORMATS, export_checkpoint


def add_checkpoint_parser(sub: Any) -> None:
    ck = sub.add_parser("checkpoint", help="work with checkpoints written by ElasticTrainer")
    ck_sub = ck.add_subparsers(dest="checkpoint", required=True)
    ex = ck_sub.add_parser(
        "export", help="write a checkpoint's state with torch.save or as safetensors"
    )
    ex.add_argument("source", help="a checkpoint directory (its newest valid one) or file")
    ex.add_argument("out", help="the file to write (.safetensors: safetensors, else torch)")
    ex.add_argument("--format", choices=FORMATS, default=None, help="default: from OUT")
    ex.add_argument(
        "--part", default=None, help="one part only, e.g. model (load_state_dict takes it)"
    )


def run_checkpoint(args: argparse.Namespace) -> int:
    done = export_checkpoint(args.source, args.out, fmt=args.format, part=args.part)
    print(
        f"exported step {done.step} ({', '.join(done.parts)}: {done.tensors} tensors, "
        f"{done.nbytes / 1e6:.1f} MB) to {done.path}"
    )
    return 0
