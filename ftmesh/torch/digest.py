"""Content hash of a model's and optimizer's state, for bitwise comparison across members."""

from __future__ import annotations

import hashlib
from typing import Any

import torch


def _feed(h: Any, name: str, value: object) -> None:
    h.update(name.encode())
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(value, dict):
        for k in sorted(value, key=str):
            _feed(h, f"{name}.{k}", value[k])
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            _feed(h, f"{name}[{i}]", v)
    else:
        h.update(repr(value).encode())


def state_digest(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> str:
    """BLAKE2b over every tensor's dtype, shape and bytes, and every other value's repr, in a
    canonical (sorted-name) order. Equal digests mean bitwise-equal state."""
    h = hashlib.blake2b(digest_size=16)
    _feed(h, "model", model.state_dict())
    if optimizer is not None:
        _feed(h, "optimizer", optimizer.state_dict())
    return h.hexdigest()
