"""``GradBuckets``: gradients land in the buckets during backward (no copy), every bucket is
launched once and in index order (all but the last during the last micro-batch's backward,
the last run by ``finish`` in the calling thread), weighted before the launch, so that
``.grad`` ends up holding the reduced mean gradient — also when user code replaced a
``.grad`` in between, and over micro-batches of unequal sizes."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import numpy as np
import pytest
import torch

from ftmesh.torch.buckets import GradBuckets, all_finite


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.Linear(64, 3)
    )


def _reference(x: torch.Tensor) -> list[torch.Tensor]:
    model = _model()
    model(x).square().sum().backward()  # type: ignore[no-untyped-call]
    return [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]


def _doubling_allreduce(
    launched: list[tuple[str, int]], buffers: list[np.ndarray]
) -> tuple[Any, Any]:
    """A stand-in for a 2-member allreduce of identical inputs: doubles in place. Records
    ``("launch", bucket)`` or ``("run", bucket)``."""

    def run(buf: np.ndarray) -> None:
        launched.append(("run", next(i for i, b in enumerate(buffers) if b is buf)))
        buf *= 2

    def launch(buf: np.ndarray) -> Future[Any]:
        run(buf)
        launched[-1] = ("launch", launched[-1][1])
        fut: Future[Any] = Future()
        fut.set_result(None)
        return fut

    return launch, run


@pytest.mark.parametrize("replace_grads", [False, True])
def test_reduced_gradients_end_up_in_grad(replace_grads: bool) -> None:
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    want = _reference(x)
    model = _model()
    params = list(model.parameters())
    buckets = GradBuckets(params, bucket_bytes=64 * 64 * 4, header_slots=3)  # several buckets
    assert len(buckets.buffers) > 1
    for _ in range(2):  # a second step reuses the buckets
        launched: list[tuple[str, int]] = []
        buckets.start(*_doubling_allreduce(launched, buckets.buffers))
        buckets.micro_batch(0.25, last=True)
        if replace_grads:
            for p in params:
                p.grad = None
        model(x).square().sum().backward()  # type: ignore[no-untyped-call]
        last = len(buckets.buffers) - 1
        assert launched == [("launch", i) for i in range(last)]  # during backward
        buckets.finish(timeout=5)
        assert launched == [*(("launch", i) for i in range(last)), ("run", last)]
        for p, g in zip(params, want, strict=True):
            assert p.grad is not None
            assert torch.allclose(p.grad, g * 0.5, rtol=1e-6, atol=1e-7)
    buckets.close()


def test_grads_are_views_of_the_buckets() -> None:
    model = _model()
    params = list(model.parameters())
    buckets = GradBuckets(params, bucket_bytes=1 << 20, header_slots=3)
    buckets.start(*_doubling_allreduce([], buckets.buffers))
    for p in params:
        assert p.grad is not None
        assert any(
            b.ctypes.data <= p.grad.data_ptr() < b.ctypes.data + b.nbytes for b in buckets.buffers
        )
    buckets.close()


@pytest.mark.parametrize("zero_grad", [False, True])
def test_micro_batches_add_up_to_the_mean_gradient(zero_grad: bool) -> None:
    """Micro-batches of 3, 3 and 2 samples of a step of 8 (mean losses each), with an identity
    "allreduce": the buckets hold the gradient of the mean loss over the 8, launched only
    during the last micro-batch; ``release`` (``optimizer.zero_grad()`` inside a step) between
    micro-batches loses nothing."""
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(2))
    model = _model()
    model(x).square().mean().backward()  # type: ignore[no-untyped-call]
    want = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    model = _model()
    params = list(model.parameters())
    buckets = GradBuckets(params, bucket_bytes=64 * 64 * 4, header_slots=3)
    launched: list[int] = []

    def launch(buf: np.ndarray) -> Future[Any]:
        launched.append(len(launched))
        fut: Future[Any] = Future()
        fut.set_result(None)
        return fut

    buckets.start(launch, lambda buf: None)
    parts = [x[:3], x[3:6], x[6:]]
    for k, part in enumerate(parts):
        last = k == len(parts) - 1
        buckets.micro_batch(len(part) / 8, last)
        if zero_grad:
            buckets.release()
        model(part).square().mean().backward()  # type: ignore[no-untyped-call]
        if not last:
            assert launched == []
            buckets.between(len(part) / len(parts[k + 1]))
    assert launched == list(range(len(buckets.buffers) - 1))
    buckets.finish(timeout=5)
    for p, g in zip(params, want, strict=True):
        assert p.grad is not None
        assert torch.allclose(p.grad, g, rtol=1e-5, atol=1e-6)
    buckets.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_device_buckets_reduce_on_the_device_and_the_header_gets_its_own_host_bucket(
    dtype: torch.dtype,
) -> None:
    """With ``direct`` (a GPU path for the parameters' device; here the CPU stands in for
    it), every parameter bucket's allreduce runs on a float32 tensor on that device (the
    gradient buffer itself for float32), the header rides in a host bucket of its own run
    last, and the layout says the buckets are on the device."""
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    want = _reference(x)
    model = _model().to(dtype)
    params = list(model.parameters())
    host = GradBuckets(params, bucket_bytes=64 * 64 * 4, header_slots=3)
    host.close()
    buckets = GradBuckets(params, 64 * 64 * 4, header_slots=3, direct=lambda device: True)
    *device, header = buckets.buffers
    assert device and all(isinstance(b, torch.Tensor) and b.dtype == torch.float32 for b in device)
    assert isinstance(header, np.ndarray) and len(header) == 3
    assert buckets.on_device == len(device) and buckets.layout != host.layout
    if dtype == torch.float32:  # .grad is a view of the very buffer the allreduce runs on
        bucket = buckets.buckets[0]
        p = bucket.params[0]
        assert isinstance(bucket.wire, torch.Tensor)
        assert buckets._views[id(p)].data_ptr() == bucket.wire.data_ptr()
    launched: list[tuple[str, int]] = []
    buckets.start(*_doubling_allreduce(launched, buckets.buffers))
    buckets.header[:] = [1.0, 2.0, 3.0]
    buckets.micro_batch(0.25, last=True)
    model(x.to(dtype)).float().square().sum().backward()  # type: ignore[no-untyped-call]
    buckets.finish(timeout=5)
    assert launched == [*(("launch", i) for i in range(len(device))), ("run", len(device))]
    assert buckets.header.tolist() == [2.0, 4.0, 6.0]
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    for p, g in zip(params, want, strict=True):
        assert p.grad is not None and p.grad.dtype == dtype
        assert torch.allclose(p.grad.float(), g * 0.5, rtol=tol, atol=tol)
    buckets.close()


def test_all_finite_finds_a_nan_or_an_infinity_and_clears_an_overflowing_sum() -> None:
    x = np.ones(1 << 16, dtype=np.float32)
    assert all_finite(x) and all_finite(torch.from_numpy(x)) and all_finite(x[:0])
    for bad in (np.nan, np.inf, -np.inf):
        y = x.copy()
        y[12345] = bad
        assert not all_finite(y) and not all_finite(torch.from_numpy(y)), bad
    # finite, but their float32 sum is infinite: the tensor path's quick sum says "maybe",
    # the exact check says finite
    big = np.full(8, 3e38, dtype=np.float32)
    with np.errstate(over="ignore"):
        assert not np.isfinite(big.sum())
    assert all_finite(big) and all_finite(torch.from_numpy(big))
