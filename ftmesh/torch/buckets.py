"""Gradient buckets that are allreduced while the last micro-batch's backward still runs.

Theory of operation: parameters are grouped, in reverse registration order (roughly the order
in which backward produces their gradients), into buckets of about ``bucket_bytes``, one dtype
and device per bucket. Each bucket owns one flat gradient buffer in its parameters' dtype and
on their device, and each parameter's ``.grad`` *is* its slice of it (a view, like DDP's
``gradient_as_bucket_view``): backward accumulates straight into the bucket. The allreduce
runs on a float32 buffer in host memory: for float32 CPU parameters that is the gradient
buffer itself, so the allreduce leaves the reduced gradients in ``.grad`` with no copy either
way; bfloat16 and float16 parameters, and parameters on a GPU, are staged (one copy to a
float32 host buffer, pinned where torch can pin memory, and one cast back), so the sum over
members accumulates in float32 whatever the parameters' precision (at twice the wire bytes
of bfloat16), and the cast back is deterministic: every member holds the same bits.
Should user code replace a ``.grad`` (``zero_grad()`` sets it to ``None``, so backward makes a
fresh one), the hook adds it into the bucket and puts the view back.

A step's share runs as micro-batches ``k = 1..K`` of ``m_k`` samples out of the step's global
batch of ``T``; each micro-batch's loss is its mean, so its gradient ``g_k`` must count with
weight ``w_k = m_k / T`` for the sum over all members to be the gradient of the global batch's
mean loss. The buckets keep a running sum ``R`` scaled so that no gradient is touched more
than needed: after micro-batch ``k < K`` it holds ``R_k = R'_{k-1} + g_k`` and is rescaled by
``w_k / w_{k+1}`` (a no-op for equal micro-batches); after the last one, each bucket is
multiplied by ``w_K`` just before its allreduce. By induction the allreduce sends
``sum_k w_k g_k``, and the reduced result is the global mean gradient with no pass after it.

Only during the last micro-batch does a post-accumulate-grad hook count a parameter's
gradient as ready, once (a body may run several backward passes per micro-batch: a GAN's
discriminator and generator losses); when a bucket is complete it is handed to the mesh for
an allreduce without waiting, so communication overlaps with the rest of backward, as in
``DistributedDataParallel``. Buckets are launched strictly in index order (a bucket that
completes early waits for the ones before it), so every member issues the same collectives in
the same order whatever order its hooks fire in. A gradient that arrives for a parameter after
its bucket's allreduce was launched (a second backward pass through it in the last
micro-batch) cannot be counted any more: it raises ``LocalUsageError`` rather than leave a
partial sum. The last bucket (the only one, for a small model) is ready only when backward
ends, so it is not handed off: ``finish`` runs its allreduce in the calling thread, after the
others. The last bucket's float32 buffer carries the header slots
(``ftmesh.training.protocol``): the member's sample count, its summed loss, a round check, the
leave bits of a planned departure and the state-check values.

*Device buckets.* When the member's collective sessions have a GPU path (``SyncMesh.gpu``:
NCCL per view epoch through torch's process group) and ``direct`` says so for a bucket's
device, the bucket's allreduce runs on the device: on the gradient buffer itself for float32
parameters, on a float32 buffer on the same device for bfloat16 and float16 ones (one device
copy each way, no host memory). Which backend then carries it is the session's choice for the
view (NCCL when every member can, else staged through the TCP ring by the session). The
header cannot ride in a device buffer (its slots are read on the host and travel exact), so
when the last bucket is on the device the header gets a host buffer of its own, allreduced on
the TCP ring after the device buckets: one more small collective per step. Whether buckets
are on the device is part of ``layout``, so members that would issue different collectives
never share a step.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np
import torch

from ..errors import LocalUsageError
from ..training.shards import LAYOUT_BITS

Wire = np.ndarray | torch.Tensor
"""What one bucket's allreduce runs on: a float32 host array, or a float32 device tensor."""


class _Bucket:
    """One bucket: its parameters, the gradient buffer ``.grad`` views point into (the
    parameters' dtype and device) and the float32 buffer its allreduce runs on: in host
    memory (the same memory for float32 CPU parameters; else a staging copy, pinned where
    torch can pin), or with ``direct`` on the parameters' device (the gradient buffer itself
    for float32). A bucket without parameters holds only the header."""

    def __init__(self, params: list[torch.nn.Parameter], extra: int, direct: bool) -> None:
        assert not (direct and extra), "the header lives in host memory"
        first = params[0] if params else None
        self.params = params
        self.dtype = first.dtype if first is not None else torch.float32
        self.device = first.device if first is not None else torch.device("cpu")
        self.n = sum(p.numel() for p in params)
        self.direct = direct
        self.staged = self.dtype != torch.float32 or (self.device.type != "cpu" and not direct)
        if direct:
            self._wire_t = torch.zeros(self.n, dtype=torch.float32, device=self.device)
            self.wire: Wire = self._wire_t
        else:
            pin = self.device.type == "cuda"
            self._wire_t = torch.zeros(self.n + extra, dtype=torch.float32, pin_memory=pin)
            self.wire = self._wire_t.numpy()
        if self.staged:
            self.grads = torch.zeros(self.n, dtype=self.dtype, device=self.device)
        else:
            self.grads = self._wire_t[: self.n]
        self.views: dict[int, torch.Tensor] = {}
        offset = 0
        for p in params:
            self.views[id(p)] = self.grads[offset : offset + p.numel()].view_as(p)
            offset += p.numel()

    def zero(self) -> None:
        self._wire_t.zero_()
        if self.staged:
            self.grads.zero_()

    def scale(self, factor: float) -> None:
        """Multiply the gradients (not the header) by ``factor``."""
        if factor == 1.0:
            return
        with torch.no_grad():
            (self.grads if self.staged else self._wire_t[: self.n]).mul_(factor)

    def outgoing(self, weight: float) -> Wire:
        """The wire buffer holding ``weight`` times the gradients (accumulated in float32)."""
        wire = self._wire_t[: self.n]
        with torch.no_grad():
            if self.staged:
                wire.copy_(self.grads)  # to host (or to the device's float32 buffer)
            if weight != 1.0:
                wire.mul_(weight)
        return self.wire

    def incoming(self) -> None:
        """The allreduce is done: the reduced float32 sums back into ``.grad`` (one
        deterministic cast, so every member holds the same bits)."""
        if self.staged:
            with torch.no_grad():
                self.grads.copy_(self._wire_t[: self.n])


class GradBuckets:
    """A trainer's gradient buckets; see the module docstring."""

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        bucket_bytes: int,
        header_slots: int,
        direct: Callable[[torch.device], bool] = lambda device: False,
        fragments: Sequence[int] | None = None,
    ) -> None:
        """``direct(device)``: whether buckets of parameters on ``device`` allreduce there
        (the member has a GPU path for it; see the module docstring). ``fragments``: the
        fragment of each parameter (streaming DiLoCo, ``ftmesh.torch.diloco``): no bucket
        spans two, the header gets a bucket of its own, and ``start(..., fragment=f)``
        reduces only fragment ``f``'s buckets and the header's."""
        check_bucketable(params)
        self.params = params
        frag = {id(p): f for p, f in zip(params, fragments, strict=True)} if fragments else {}
        groups: list[list[torch.nn.Parameter]] = [[]]
        size = 0
        for p in reversed(params):
            nbytes = p.numel() * p.element_size()
            kind = (p.dtype, p.device, frag.get(id(p)))
            last = groups[-1]
            here = (last[0].dtype, last[0].device, frag.get(id(last[0]))) if last else kind
            if last and (size + nbytes > bucket_bytes or here != kind):
                groups.append([])
                size = 0
            groups[-1].append(p)
            size += nbytes
        on_device = [bool(g) and direct(g[0].device) for g in groups]
        if on_device[-1] or frag:  # the header gets a host bucket of its own
            groups.append([])
            on_device.append(False)
        self.fragment_of_bucket: list[int | None] = [
            frag.get(id(g[0])) if g else None for g in groups
        ]
        """Each bucket's fragment (``None``: every fragment's, the header's bucket)."""
        self._skip: set[int] = set()
        """The buckets this attempt does not reduce (another fragment's)."""
        self.groups = groups
        self.header_slots = header_slots
        header_at = len(groups) - 1
        self.buckets = [
            _Bucket(g, header_slots if b == header_at else 0, on_device[b])
            for b, g in enumerate(groups)
        ]
        self.buffers: list[Wire] = [bk.wire for bk in self.buckets]
        """The float32 buffers the allreduces run on, one per bucket (the last one, in host
        memory, ends with the header)."""
        self.slot = {id(p): b for b, g in enumerate(groups) for p in g}  # id(param) -> bucket
        self._views = {i: v for bk in self.buckets for i, v in bk.views.items()}
        self._pending: list[int] = []
        self._launched = 0
        self._futures: list[Future[Any]] = []
        self._launch: Callable[[Wire], Future[Any]] | None = None
        self._run: Callable[[Wire], object] | None = None
        self._last = False
        self._weight = 1.0
        self._detached = False
        self._counted: set[int] = set()
        """id(param) of the gradients counted ready in the last micro-batch."""
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._on_grad)  # type: ignore[no-untyped-call]
            for p in params
        ]

    @property
    def header(self) -> np.ndarray:
        """The header slots at the end of the last bucket (``ftmesh.training.protocol``)."""
        wire = self.buckets[-1].wire
        assert isinstance(wire, np.ndarray)
        return wire[len(wire) - self.header_slots :]

    @property
    def on_device(self) -> int:
        """How many buckets allreduce on their device."""
        return sum(bk.direct for bk in self.buckets)

    def gradients(self, buf: Wire) -> Wire:
        """The gradient part of one of ``buffers`` (all of it but the last one's header)."""
        return buf[: self.buckets[-1].n] if buf is self.buffers[-1] else buf

    @property
    def layout(self) -> int:
        """A hash of the buckets' sizes, dtypes and device kinds (every member must have
        the same)."""
        text = ",".join(
            f"{bk.n}:{bk.dtype}:{bk.device.type}:{'d' if bk.direct else 'h'}" for bk in self.buckets
        )
        digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big") >> (64 - LAYOUT_BITS)

    @property
    def armed(self) -> bool:
        """Between ``start`` and the end of ``finish``."""
        return self._launch is not None

    def start(
        self,
        launch: Callable[[Wire], Future[Any]],
        run: Callable[[Wire], object],
        fragment: int | None = None,
    ) -> None:
        """Zero the gradients (the buckets, header included) for one attempt of a step;
        ``launch(buffer)`` starts an allreduce, ``run(buffer)`` runs one (after those
        launched before it). Then ``micro_batch`` for each micro-batch, and ``finish``.
        ``fragment``: only that fragment's buckets (and the header's) are reduced; the
        others keep what this member put in them."""
        for bk in self.buckets:
            bk.zero()
        self._skip = (
            set()
            if fragment is None
            else {b for b, f in enumerate(self.fragment_of_bucket) if f not in (None, fragment)}
        )
        self._attach_views()
        self._pending = [len(g) for g in self.groups]
        self._launched = 0
        self._futures = []
        self._launch = launch
        self._run = run
        self._last = False
        self._weight = 1.0
        self._counted.clear()

    def _attach_views(self) -> None:
        for p in self.params:
            view = self._views[id(p)]
            if p.grad is not view:
                p.grad = view

    def micro_batch(self, weight: float, last: bool) -> None:
        """The next micro-batch's backward counts with ``weight`` (its samples over the
        step's); with ``last``, its gradients are launched as they complete."""
        self._weight = weight
        self._last = last
        self._attach_views()

    def send(self) -> None:
        """The gradients in the buckets are final already (DiLoCo's overlap: an outer
        gradient written as the step begins, ``ftmesh.torch.diloco``): launch every bucket
        but the last now; ``finish`` runs the last (the header)."""
        self._last = True
        self._pending = [0] * len(self.buckets)
        self._launch_ready()

    def between(self, ratio: float) -> None:
        """After a micro-batch that was not the last: rescale the running sum by ``ratio``
        (this micro-batch's weight over the next one's; see the module docstring)."""
        for bk in self.buckets:
            bk.scale(ratio)

    def release(self) -> None:
        """Inside a step, ``optimizer.zero_grad()``: drop ``.grad`` (the buckets keep the sum
        of the micro-batches before; the next backward's gradients are added to it)."""
        for p in self.params:
            p.grad = None

    @contextlib.contextmanager
    def detached(self) -> Iterator[None]:
        """Inside an attempt, backward passes that are not the step's (DiLoCo's inner steps,
        ``ftmesh.torch.diloco``): ``.grad`` is the parameters' own, the buckets keep what they
        hold and launch nothing; afterwards ``.grad`` is the buckets' views again."""
        self._detached = True
        for p in self.params:
            p.grad = None
        try:
            yield
        finally:
            self._detached = False
            self._attach_views()

    def _on_grad(self, p: torch.Tensor) -> None:
        if self._launch is None or self._detached or p.grad is None:
            return
        view = self._views[id(p)]
        if p.grad is not view:  # user code replaced it: add it in
            with torch.no_grad():
                view.add_(p.grad.detach())
            p.grad = view
        if self._last:
            slot = self.slot[id(p)]
            if id(p) in self._counted:  # another backward pass through p
                if slot < self._launched:
                    raise LocalUsageError(
                        f"a parameter of shape {tuple(p.shape)} got a second gradient in the "
                        "step's last micro-batch after its bucket's allreduce had started: run "
                        "one backward pass per micro-batch through each parameter (sum the "
                        "losses, or freeze with requires_grad_(False) the modules a loss must "
                        "not update)"
                    )
                return
            self._counted.add(id(p))
            self._pending[slot] -= 1
            self._launch_ready()

    def _launch_ready(self) -> None:
        assert self._launch is not None
        last = len(self.buckets) - 1  # run by finish()
        while self._launched < last and self._pending[self._launched] <= 0:
            if self._launched not in self._skip:
                wire = self.buckets[self._launched].outgoing(self._weight)
                self._futures.append(self._launch(wire))
            self._launched += 1

    def finish(self, timeout: float) -> None:
        """Launch what is left (gradients that never came are zero), run the last bucket and
        wait for every bucket; raises the first collective error. ``.grad`` then holds the
        reduced mean gradient."""
        assert self._launch is not None and self._run is not None
        self._last = True
        self._pending = [0] * len(self.buckets)
        self._launch_ready()
        run, self._launch, self._run = self._run, None, None
        last_error: BaseException | None = None
        try:
            run(self.buckets[-1].outgoing(self._weight))
        except Exception as exc:  # reported after those of the earlier buckets
            last_error = exc
        errors = [fut.exception(timeout) for fut in self._futures]
        first = next((e for e in [*errors, last_error] if e is not None), None)
        self._attach_views()
        if first is not None:
            raise first
        for b, bk in enumerate(self.buckets):
            if b not in self._skip:
                bk.incoming()

    def abandon(self, timeout: float) -> None:
        """A step's body raised: stop launching, and wait (at most ``timeout``) for the
        allreduces in flight, whose errors nobody wants."""
        self._launch = self._run = None
        for fut in self._futures:
            fut.exception(timeout)
        self._futures = []

    def close(self) -> None:
        """Remove the hooks from the parameters."""
        for h in self._hooks:
            h.remove()


def all_finite(x: Wire) -> bool:
    """No NaN or infinity in ``x`` (twice a step: our gradients before they go out, the
    reduced ones after). In host memory one pass of ``isfinite`` (its boolean temporary is a
    quarter of the bucket): 0.25 ms for 2M float32 on this project's 2-core host, against
    0.92 ms for the float64 sum it replaced, which had been 0.5 of a backward pass's CPU per
    step in ``ftmesh bench recovery``'s worker. On a device one float32 sum and one small copy
    to the host: a NaN or an infinity makes the sum non-finite, and so may finite values that
    overflow it, which the exact check then clears."""
    if isinstance(x, torch.Tensor):
        if bool(torch.isfinite(x.sum(dtype=torch.float32)).item()):
            return True
        return bool(torch.isfinite(x).all().item())
    return bool(np.isfinite(x).all())


def check_bucketable(params: Sequence[torch.nn.Parameter]) -> None:
    """Refuse, naming the parameter's shape, what the buckets cannot hold."""
    for p in params:
        if not p.dtype.is_floating_point or p.dtype == torch.float64:
            raise LocalUsageError(
                f"a parameter of shape {tuple(p.shape)} is {p.dtype}: the gradient buckets "
                "hold float32, bfloat16 and float16 parameters"
            )


def micro_batches(share: np.ndarray, micro_batch: int) -> list[np.ndarray]:
    """Cut ``share`` into the fewest micro-batches of at most ``micro_batch`` samples (0: one),
    of sizes that differ by at most one."""
    if len(share) == 0:
        return []
    if micro_batch <= 0 or len(share) <= micro_batch:
        return [share]
    count = -(-len(share) // micro_batch)
    return list(np.array_split(share, count))
