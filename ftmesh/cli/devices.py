"""The GPUs ``ftmesh launch`` hands out, one per local worker, found without importing torch.

Theory of operation: a host's NVIDIA GPUs are the ``/dev/nvidiaN`` device nodes (in a
container, the ones mapped into it, which CUDA numbers from 0); a ``CUDA_VISIBLE_DEVICES``
already in the launcher's environment restricts that list, as it would for CUDA (entries up to
the first invalid one, ``-1``). Each worker gets a slot, ``LOCAL_RANK``: the lowest one no
running worker holds, so a replacement takes the slot of the worker it replaces, and with it
``CUDA_VISIBLE_DEVICES`` = the slot's GPU (slots wrap around when there are more workers than
GPUs). Stdlib only: it also runs where nothing but Python is installed.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from pathlib import Path

_DEVICE = re.compile(r"nvidia(\d+)")


def visible_gpus(environ: Mapping[str, str], dev: Path = Path("/dev")) -> list[str]:
    """The GPUs workers may use, as ``CUDA_VISIBLE_DEVICES`` entries (empty: none)."""
    given = environ.get("CUDA_VISIBLE_DEVICES")
    if given is not None:
        out = []
        for entry in (e.strip() for e in given.split(",")):
            if not entry or entry.startswith("-"):
                break  # CUDA ignores everything from the first invalid entry on
            out.append(entry)
        return out
    try:
        count = sum(1 for p in dev.iterdir() if _DEVICE.fullmatch(p.name))
    except OSError:
        return []
    return [str(i) for i in range(count)]


def free_slot(taken: Collection[int]) -> int:
    """The lowest ``LOCAL_RANK`` no running worker holds."""
    slot = 0
    while slot in taken:
        slot += 1
    return slot


def worker_env(slot: int, gpus: list[str]) -> dict[str, str]:
    """The environment of the worker in ``slot``: its rank, and its GPU if there are any."""
    env = {"LOCAL_RANK": str(slot)}
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = gpus[slot % len(gpus)]
    return env
