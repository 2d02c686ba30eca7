"""Gradient buckets that are allreduced while backward is still running.

Theory of operation: parameters are grouped, in reverse registration order (roughly the order
in which backward produces their gradients), into buckets of about ``bucket_bytes``. Each
bucket owns one flat float32 buffer, and each parameter's ``.grad`` *is* its slice of it (a
view, like DDP's ``gradient_as_bucket_view``): backward accumulates straight into the bucket,
and the allreduce, in place, leaves the reduced gradients in ``.grad`` with no copy either way.
(Should user code replace a ``.grad``, e.g. ``zero_grad(set_to_none=True)``, the hook copies
it in and ``write_grads`` copies the result out.) A post-accumulate-grad hook counts a
parameter's gradient as ready; when a bucket is complete it is handed to the mesh for an
allreduce without waiting, so communication overlaps with the rest of backward, as in
``DistributedDataParallel``. Buckets are launched strictly in index order (a bucket that
completes early waits for the ones before it), so every member issues the same collectives in
the same order whatever order its hooks fire in. The last bucket (the only one, for a small
model) is ready only when backward ends, so it is not handed off: ``finish`` runs its
allreduce in the calling thread, after the others. The last bucket carries extra slots:
the member's sample count, its summed loss, a round check and the leave bits of a planned
departure (see ``ElasticTrainer`` and ``ftmesh.training.protocol``).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np
import torch

from ..training.protocol import LEAVE_SLOTS

HEADER_SLOTS = 3 + LEAVE_SLOTS


class GradBuckets:
    def __init__(self, params: list[torch.nn.Parameter], bucket_bytes: int) -> None:
        self.params = params
        order = list(reversed(params))
        groups: list[list[torch.nn.Parameter]] = [[]]
        size = 0
        for p in order:
            nbytes = p.numel() * 4
            if groups[-1] and size + nbytes > bucket_bytes:
                groups.append([])
                size = 0
            groups[-1].append(p)
            size += nbytes
        self.groups = groups
        self.buffers: list[np.ndarray] = []
        self.slot: dict[int, tuple[int, int, int]] = {}  # id(param) -> (bucket, start, stop)
        self._grad_len: list[int] = []  # per bucket: elements before the header slots
        for b, group in enumerate(groups):
            offset = 0
            for p in group:
                self.slot[id(p)] = (b, offset, offset + p.numel())
                offset += p.numel()
            extra = HEADER_SLOTS if b == len(groups) - 1 else 0
            self.buffers.append(np.zeros(offset + extra, dtype=np.float32))
            self._grad_len.append(offset)
        self._views = {id(p): self._view(p) for p in params}
        self._pending: list[int] = []
        self._launched = 0
        self._futures: list[Future[Any]] = []
        self._launch: Callable[[np.ndarray], Future[Any]] | None = None
        self._run: Callable[[np.ndarray], object] | None = None
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._on_grad)  # type: ignore[no-untyped-call]
            for p in params
        ]

    @property
    def header(self) -> np.ndarray:
        """The extra slots of the last bucket: [samples, summed loss, round check, leave
        slots...]."""
        return self.buffers[-1][-HEADER_SLOTS:]

    def _view(self, p: torch.Tensor) -> torch.Tensor:
        b, start, stop = self.slot[id(p)]
        return torch.from_numpy(self.buffers[b][start:stop]).view_as(p)

    def start(
        self, launch: Callable[[np.ndarray], Future[Any]], run: Callable[[np.ndarray], object]
    ) -> None:
        """Zero the gradients (the buckets) and arm the hooks for one backward pass;
        ``launch(buffer)`` starts an allreduce, ``run(buffer)`` runs one (after those
        launched before it)."""
        for buf in self.buffers:
            buf.fill(0.0)
        for p in self.params:
            view = self._views[id(p)]
            if p.grad is not view:
                p.grad = view
        self._pending = [len(g) for g in self.groups]
        self._launched = 0
        self._futures = []
        self._launch = launch
        self._run = run

    def _on_grad(self, p: torch.Tensor) -> None:
        if self._launch is None or p.grad is None:
            return
        b, start, stop = self.slot[id(p)]
        if p.grad is not self._views[id(p)]:  # user code replaced it: copy it in
            self.buffers[b][start:stop] = p.grad.detach().reshape(-1).numpy()
        self._pending[b] -= 1
        self._launch_ready()

    def _launch_ready(self) -> None:
        assert self._launch is not None
        last = len(self.buffers) - 1  # run by finish()
        while self._launched < last and self._pending[self._launched] <= 0:
            self._futures.append(self._launch(self.buffers[self._launched]))
            self._launched += 1

    def finish(self, timeout: float) -> None:
        """Launch what is left (gradients that never came are zero), run the last bucket and
        wait for every bucket; raises the first collective error."""
        assert self._launch is not None and self._run is not None
        self._pending = [0] * len(self.buffers)
        self._launch_ready()
        run, self._launch, self._run = self._run, None, None
        last_error: BaseException | None = None
        try:
            run(self.buffers[-1])
        except Exception as exc:  # reported after those of the earlier buckets
            last_error = exc
        errors = [fut.exception(timeout) for fut in self._futures]
        first = next((e for e in [*errors, last_error] if e is not None), None)
        if first is not None:
            raise first

    def write_grads(self, scale: float) -> None:
        """Scale the reduced buckets by ``scale``: ``.grad`` holds the result."""
        for buf, n in zip(self.buffers, self._grad_len, strict=True):
            grads = buf[:n]
            np.multiply(grads, np.float32(scale), out=grads)
        with torch.no_grad():
            for p in self.params:
                view = self._views[id(p)]
                if p.grad is not view:
                    p.grad = view

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
