"""State commit/restore/digest/serialisation with a real torch model and Adam."""

from __future__ import annotations

import copy
import random
from typing import Any

import numpy as np
import pytest
import torch

from ftmesh.errors import LocalUsageError, RemoteProtocolError
from ftmesh.state import (
    NoCommittedStateError,
    Snapshot,
    StaleSnapshotError,
    State,
    StateMismatchError,
)


def make(seed: int = 0, *, dropout: float = 0.1) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 16),
        torch.nn.BatchNorm1d(16),
        torch.nn.ReLU(),
        torch.nn.Dropout(dropout),
        torch.nn.Linear(16, 3),
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, opt


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, scale: float = 1.0) -> None:
    # Data comes from the global RNGs, so RNG capture/restore is exercised too.
    x = torch.randn(8, 6) * scale
    y = torch.from_numpy(np.random.standard_normal((8, 3)).astype(np.float32))
    opt.zero_grad()
    loss = ((model(x) - y) ** 2).mean() + random.random() * 0
    loss.backward()
    opt.step()


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for t in model.state_dict().values()]


def assert_bitwise(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype and torch.equal(
            x.view(-1).view(torch.uint8), y.view(-1).view(torch.uint8)
        )


def test_restore_after_interrupted_step_is_bitwise_identical_to_uninterrupted() -> None:
    # Reference: five clean steps.
    seed_all(1)
    model_a, opt_a = make()
    state_a = State(model=model_a, optimizer=opt_a, arrays={"ema": np.zeros(4)})
    for step in range(1, 6):
        train_step(model_a, opt_a)
        state_a.arrays["ema"] += step
        state_a.commit(step=step)

    # Same run, but step 3 is "interrupted": applied with garbage, then rolled back.
    seed_all(1)
    model_b, opt_b = make()
    state_b = State(model=model_b, optimizer=opt_b, arrays={"ema": np.zeros(4)})
    for step in range(1, 6):
        if step == 3:
            train_step(model_b, opt_b, scale=1e3)
            state_b.arrays["ema"] += 99
            state_b.step = 42
            assert state_b.restore() == 2
        train_step(model_b, opt_b)
        state_b.arrays["ema"] += step
        state_b.commit(step=step)

    assert_bitwise(weights(model_a), weights(model_b))
    assert state_a.digest() == state_b.digest()
    assert state_b.step == 5
    np.testing.assert_array_equal(state_a.arrays["ema"], state_b.arrays["ema"])


def test_restore_removes_optimizer_state_created_after_commit() -> None:
    model, opt = make()
    state = State(model=model, optimizer=opt)
    state.commit()
    before = state.live_digest()
    train_step(model, opt)
    assert len(opt.state) > 0
    state.restore()
    assert len(opt.state) == 0
    assert state.live_digest() == before


def test_restored_optimizer_does_not_alias_the_snapshot() -> None:
    model, opt = make()
    state = State(model=model, optimizer=opt)
    train_step(model, opt)
    state.commit()
    d = state.digest()
    state.restore()
    train_step(model, opt)  # updates exp_avg in place: must not write into the snapshot
    assert root_digest_again(state.committed) == d


def root_digest_again(snap: Snapshot | None) -> str:
    assert snap is not None
    return Snapshot.from_parts([snap.to_bytes()]).digest


def test_digest_equal_for_equal_states_and_independent_of_registration_order() -> None:
    m1, o1 = make(3)
    m2, o2 = make(3)
    s1 = State(model=m1, optimizer=o1, scalars={"b": 1, "a": (1, 2.5)}, rng=False)
    s2 = State(optimizer=o2, model=m2, scalars={"a": (1, 2.5), "b": 1}, rng=False)
    assert s1.commit().digest == s2.commit().digest
    with torch.no_grad():
        next(m2.parameters()).view(-1)[0] += 1e-7
    assert s1.live_digest() != s2.live_digest()


def test_digest_covers_dtype_and_shape() -> None:
    raw = np.arange(12, dtype=np.int32)
    a = State(arrays={"x": raw.copy()}, rng=False).commit().digest
    b = State(arrays={"x": raw.reshape(3, 4).copy()}, rng=False).commit().digest
    c = State(arrays={"x": raw.view(np.float32).copy()}, rng=False).commit().digest
    assert len({a, b, c}) == 3


def test_rng_is_restored() -> None:
    state = State()
    state.commit()
    first = (random.random(), np.random.random(), torch.rand(1).item())
    state.restore()
    assert (random.random(), np.random.random(), torch.rand(1).item()) == first


def test_serialise_and_load_into_another_member() -> None:
    model, opt = make(5)
    train_step(model, opt)
    scalars: dict[str, Any] = {
        "epoch": 3,
        "pos": (1, [2, 3.5], None),
        "blob": b"\x00\x01",
        "nested": {1: "int key", "k": np.arange(3)},
        "half": torch.ones(2, dtype=torch.bfloat16),
    }
    src = State(model=model, optimizer=opt, arrays={"a": np.ones((2, 3))}, scalars=scalars)
    snap = src.commit(step=7)
    parts = snap.to_bytes_parts()
    assert sum(len(p) for p in parts) == snap.nbytes

    model2, opt2 = make(9)
    dst = State(model=model2, optimizer=opt2, arrays={"a": np.zeros((2, 3))})
    copy_snap = Snapshot.from_parts(parts)
    assert copy_snap.digest == snap.digest
    dst.load_snapshot(copy_snap)
    assert dst.step == 7 and dst.committed_step == 7
    assert dst.digest() == src.digest()
    assert dst.live_digest() == src.live_digest()
    assert_bitwise(weights(model), weights(model2))
    assert dst.scalars["pos"] == (1, [2, 3.5], None)
    assert dst.scalars["nested"][1] == "int key"
    assert torch.equal(dst.scalars["half"], scalars["half"])
    # Training continues identically on both.
    seed_all(11)
    train_step(model, opt)
    seed_all(11)
    train_step(model2, opt2)
    assert_bitwise(weights(model), weights(model2))


def test_commits_reuse_buffers_unless_leased() -> None:
    state = State(arrays={"x": np.zeros(1000)}, rng=False)
    s1 = state.commit(1)
    s2 = state.commit(2)
    s3 = state.commit(3)  # reuses s1's arena
    assert s3._arena is s1._arena
    with pytest.raises(StaleSnapshotError):
        s1.to_bytes_parts()
    with s2.lease():
        s4 = state.commit(4)  # s2 is leased: fresh buffers
        assert s4._arena is not s2._arena
        assert s2.digest  # still valid
    state.arrays["x"][:] = 5
    state.commit(5)
    assert state.committed is not None
    assert state.committed.numpy("a/x")[0] == 5


def test_usage_errors() -> None:
    state = State(rng=False)
    with pytest.raises(NoCommittedStateError):
        state.restore()
    with pytest.raises(LocalUsageError):
        state.register("bad/name", np.zeros(1))
    with pytest.raises(LocalUsageError):
        state.register("obj", np.array([object()]))
    with pytest.raises(LocalUsageError):
        state.register("thing", object())
    state.scalars["f"] = lambda: 0
    with pytest.raises(LocalUsageError):
        state.commit()
    model, opt = make()
    other = State(model=model, rng=False).commit()
    with pytest.raises(StateMismatchError):
        State(model=copy.deepcopy(model), optimizer=opt).load_snapshot(other)
    wrong = State(model=torch.nn.Linear(2, 2), rng=False)
    with pytest.raises(StateMismatchError):
        wrong.load_snapshot(other)


@pytest.mark.parametrize("cut", [0, 5, 11, 40, -1])
def test_malformed_blobs_are_refused(cut: int) -> None:
    blob = State(arrays={"x": np.arange(100.0)}).commit().to_bytes()
    bad = bytearray(blob[:cut] if cut >= 0 else blob)
    if cut < 0:
        bad[20] ^= 0xFF  # inside the header
    with pytest.raises(RemoteProtocolError):
        Snapshot.from_buffer(bytes(bad))


def test_nbytes_is_the_size_of_the_next_commit_without_copying() -> None:
    model = torch.nn.Linear(300, 200)
    opt = torch.optim.Adam(model.parameters())
    state = State(model=model, optimizer=opt, arrays={"big": np.ones(300_000)})
    assert state.nbytes() == state.commit(step=1).nbytes
    model(torch.randn(2, 300)).sum().backward()
    opt.step()  # creates the moments
    grown = state.nbytes()
    assert grown > state.committed.nbytes  # type: ignore[union-attr]
    assert grown == state.commit(step=2).nbytes


def test_commits_work_where_pages_cannot_be_mapped_up_front(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ftmesh.state import memory

    monkeypatch.setattr(memory, "_madvise", None)  # another OS, or a kernel before 5.14
    state = State(arrays={"w": np.arange(1 << 20, dtype=np.float64)}, rng=False)
    snap = state.commit(step=1)
    assert (snap.numpy("a/w") == state.arrays["w"]).all()
    assert not memory.populate(memory.mapped_zeros(4 << 20))
    assert not memory.prepared_zeros(4 << 20).any()
