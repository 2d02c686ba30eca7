"""Sharded (ZeRO-1) optimizer state: the sync planner (pure) and ``ShardedOptimizer`` driven
in-process for several simulated members, against an unsharded optimizer as the reference."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable
from typing import Any, cast

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from trainer_sim import FakeMesh, Hub

from ftmesh.collective import Peer, RingView
from ftmesh.errors import ConfigError, LocalUsageError
from ftmesh.mesh.blocking import SyncMesh
from ftmesh.state import StateLostError
from ftmesh.state.sharding import ShardLayout
from ftmesh.torch.zero import ELEMENTWISE_OPTIMIZERS, HeldPiece, ShardedOptimizer
from ftmesh.training.shards import (
    Piece,
    SettingsMismatchError,
    ShardSettings,
    Version,
    check_settings,
    holdings_record,
    on_offer,
    plan_shard_sync,
    read_holdings,
    read_settings,
    round_id,
    settings_slots,
)


def _digest(*parts: object) -> str:
    return hashlib.blake2b(repr(parts).encode(), digest_size=32).hexdigest()


def _holdings(members: list[str], length: int, replicas: int, step: int, rnd: int) -> list[Version]:
    lay = ShardLayout.of(members, length, replicas)
    out = []
    for m in members:
        pieces = []
        for j in lay.held_by(m):
            a, b = lay.shard_range(j)
            pieces.append(Piece(a, b, _digest(a, b, step)))
        out.append(Version(step, rnd, tuple(pieces)))
    return out


@settings(max_examples=50, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(-1, 2**40),
            st.integers(0, 2**56 - 1),
            st.lists(
                st.tuples(
                    st.integers(0, 2**40),
                    st.integers(0, 2**20),
                    st.binary(min_size=32, max_size=32),
                ),
                max_size=3,
            ),
        ),
        max_size=2,
    )
)
def test_holdings_records_round_trip(
    versions: list[tuple[int, int, list[tuple[int, int, bytes]]]],
) -> None:
    vs = [
        Version(s, r, tuple(Piece(a, a + n, d.hex()) for a, n, d in pieces))
        for s, r, pieces in versions
        if s != -1
    ]
    rec = holdings_record(vs, 3)
    assert read_holdings(np.stack([rec, rec]), 3) == [vs, vs]


def test_junk_records_count_as_holding_nothing() -> None:
    rng = np.random.default_rng(0)
    junk = rng.integers(-(2**62), 2**62, size=(4, len(holdings_record([], 2))), dtype=np.int64)
    for versions in read_holdings(junk, 2):
        for v in versions:
            assert all(0 <= p.start <= p.stop for p in v.pieces)


def test_one_loss_is_covered_by_replicas_and_fetched_from_them() -> None:
    members = ["a", "b", "c", "d"]
    length, rnd = 1001, round_id("e1")
    held = _holdings(members, length, 2, 7, rnd)
    # "b" died: the survivors' records, in the new view's rank order
    survivors = ["a", "c", "d"]
    records = [[held[members.index(m)]] for m in survivors]
    new = ShardLayout.of(survivors, length, 2)
    for rank, me in enumerate(survivors):
        needed = [new.shard_range(j) for j in new.held_by(me)]
        plan = plan_shard_sync(records, 7, [0, 1, 2], rank, needed, length)
        covered = sorted((s.start, s.stop) for s in plan.segments)
        assert sum(b - a for a, b in covered) == sum(b - a for a, b in needed)
        for seg in plan.segments:
            assert seg.piece.start <= seg.start < seg.stop <= seg.piece.stop
            for src in seg.sources:  # every source really holds that piece
                assert seg.piece in records[src][0].pieces
            if seg.local:
                assert seg.piece in records[rank][0].pieces
    # "c" needs b's old shard, which only "c" itself (b's right neighbour) holds now: local
    plan = plan_shard_sync(
        records, 7, [0, 1, 2], 1, [ShardLayout.of(members, length, 2).shard_range(1)], length
    )
    assert all(s.local for s in plan.segments)


def test_two_adjacent_losses_raise_state_lost_on_every_member() -> None:
    members = ["a", "b", "c", "d"]
    held = _holdings(members, 100, 2, 3, 1)
    records = [[held[0]], [held[3]]]  # b and c died: b's shard had holders b, c
    for rank in range(2):
        with pytest.raises(StateLostError, match=r"elements \[25:50\)"):
            plan_shard_sync(records, 3, [0, 1], rank, [(0, 50)], 100)


def test_only_the_target_version_counts() -> None:
    members = ["a", "b"]
    new = _holdings(members, 10, 1, 5, round_id("v2"))
    old_round = _holdings(members, 10, 1, 5, round_id("v1"))  # same step, other round
    # rank 1 holds only a same-step piece of another round: its shard is lost
    with pytest.raises(StateLostError):
        plan_shard_sync([[new[0]], [old_round[1]]], 5, [0, 1], 0, [(0, 10)], 10)
    # a pending version (step 6) and the committed one (step 5): the target picks
    pending = _holdings(members, 10, 1, 6, round_id("v3"))
    plan = plan_shard_sync([[pending[0], new[0]], [new[1]]], 5, [0, 1], 0, [(0, 10)], 10)
    assert [(s.start, s.stop, s.local) for s in plan.segments] == [(0, 5, True), (5, 10, False)]
    assert plan.round == round_id("v2")


def _reduced_settings(settings: list[ShardSettings]) -> list[ShardSettings]:
    n = len(settings)
    reduced = np.maximum.reduce([settings_slots(s, r, n) for r, s in enumerate(settings)])
    return read_settings(reduced, n)


def test_settings_travel_in_slots_and_differences_are_named() -> None:
    members = [f"m{i}" for i in range(6)]
    same = [ShardSettings.of(True, 2, 10)] * 6
    assert _reduced_settings(same) == same
    check_settings(same, members, 0)
    # replicated training uses neither replicas nor the checkpoint period
    replicated = [ShardSettings.of(False, r, r) for r in range(6)]
    check_settings(_reduced_settings(replicated), members, 0)
    odd = _reduced_settings([*same[:5], ShardSettings.of(True, 3, 0)])
    for rank in (0, 5):  # nobody trained yet: nobody's settings are the mesh's
        with pytest.raises(ConfigError) as err:
            check_settings(odd, members, rank)
        text = str(err.value)
        assert "replicas: 2 on m0, m1, m2, m3 and 1 more; 3 on m5" in text, text
        assert "checkpoint_every: 10 on m0, m1, m2, m3 and 1 more; 0 on m5" in text, text
    mixed = _reduced_settings([*same[:5], ShardSettings.of(False, 2, 10)])
    with pytest.raises(ConfigError, match=r"shard_optimizer: True on .*; False on m5\. Start"):
        check_settings(mixed, members, 0)
    # m0..m4 hold the mesh's newest state: m5 is the odd one; the others wait for it to leave
    with pytest.raises(SettingsMismatchError) as waiting:
        check_settings(odd, members, 2, established=[0, 1, 2, 3, 4])
    assert waiting.value.odd == ("m5",)
    with pytest.raises(ConfigError, match="restart it with theirs"):
        check_settings(odd, members, 5, established=[0, 1, 2, 3, 4])
    with pytest.raises(ConfigError, match="Start every member"):  # the holders disagree
        check_settings(odd, members, 0, established=[0, 5])


# -- ShardedOptimizer in-process: N members, one process -------------------------------------


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Tanh(), torch.nn.Linear(13, 3))


MakeOpt = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]


def _adamw(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.01)


class _Member:
    def __init__(
        self,
        name: str,
        replicas: int,
        make_opt: MakeOpt = _adamw,
        model: Callable[[], torch.nn.Module] = _model,
    ) -> None:
        self.name = name
        self.model = model()
        params = list(self.model.parameters())
        self.template = make_opt(params)
        self.zero = ShardedOptimizer(params, self.template, replicas)


def _step(
    members: list[_Member],
    grads: list[torch.Tensor],
    version: tuple[int, int],
    with_state: bool = False,
) -> list[dict[str, torch.Tensor]]:
    """One sharded step; with ``with_state`` (a checkpoint step), each member's gathered
    whole optimizer state."""
    flat_grad = torch.cat([g.reshape(-1) for g in grads])
    for m in members:
        m.zero.update(flat_grad, version)
    gathered = np.stack([m.zero.gather_input(with_state) for m in members])
    out = []
    for m in members:
        out.append(m.zero.apply_gathered(gathered, with_state))
        m.zero.commit()
    return out


def _reshard(members: list[_Member], step: int, rnd: int) -> None:
    """Re-shard over ``members`` from what each holds (in-process 'fetch')."""
    names = [m.name for m in members]
    lay = ShardLayout.of(names, members[0].zero.length, members[0].zero.replicas)
    store: dict[str, HeldPiece] = {}
    records = []
    for m in members:
        versions = []
        for v_step, v_round, held in m.zero.versions():
            pieces = []
            for p in held:
                d = _digest(m.name, v_step, p.start, p.stop)
                store[d] = p
                pieces.append(Piece(p.start, p.stop, d))
            versions.append(Version(v_step, v_round, tuple(pieces)))
        records.append(versions)
    for rank, m in enumerate(members):
        needed = [lay.shard_range(j) for j in lay.held_by(m.name)]
        plan = plan_shard_sync(
            records, step, list(range(len(members))), rank, needed, m.zero.length
        )
        m.zero.rebuild(lay, m.name, plan.segments, store, (step, plan.round), [])


def test_sharded_adamw_matches_the_unsharded_optimizer_bitwise_through_a_loss() -> None:
    ref = _model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.01)
    members = [_Member(n, 2) for n in "abcde"]
    for m in members:
        m.zero.start_fresh(ShardLayout.of([x.name for x in members], m.zero.length, 2), m.name)
    gen = torch.Generator().manual_seed(1)
    for step in range(12):
        grads = [torch.randn(p.shape, generator=gen) for p in ref.parameters()]
        for p, g in zip(ref.parameters(), grads, strict=True):
            p.grad = g.clone()
        ref_opt.step()
        _step(members, grads, (step + 1, 7))
        if step == 5:  # "c" dies; the others re-shard from the replicas
            members = [m for m in members if m.name != "c"]
            _reshard(members, step + 1, 7)
        for m in members:
            for p, q in zip(m.model.parameters(), ref.parameters(), strict=True):
                assert torch.equal(p, q), f"step {step + 1}: {m.name} differs from unsharded"
    # owners and replicas hold identical optimizer state
    by_range: dict[tuple[int, int], list[dict[str, torch.Tensor]]] = {}
    for m in members:
        for p in m.zero.held():
            by_range.setdefault((p.start, p.stop), []).append(p.state)
    assert all(len(v) == 2 for v in by_range.values())
    for states in by_range.values():
        for key in states[0]:
            assert torch.equal(states[0][key], states[1][key])


def test_a_failed_allgather_keeps_both_versions() -> None:
    members = [_Member(n, 2) for n in "ab"]
    for m in members:
        m.zero.start_fresh(ShardLayout.of(["a", "b"], m.zero.length, 2), m.name)
    grads = torch.ones(members[0].zero.length)
    _step(members, [grads], (1, 3))
    before = members[0].model.state_dict()
    members[0].zero.update(grads, (2, 4))  # the allgather that would commit step 2 fails
    steps = [(s, r) for s, r, _ in members[0].zero.versions()]
    assert steps == [(2, 4), (1, 3)]
    after = members[0].model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # the model is untouched


def test_sharding_needs_one_param_group_and_float32() -> None:
    model = _model()
    opt = torch.optim.SGD([{"params": [model[0].weight]}, {"params": [model[0].bias]}], lr=0.1)
    with pytest.raises(Exception, match="one parameter group"):
        ShardedOptimizer(list(model.parameters()), opt, 2)
    half = torch.nn.Linear(2, 2).double()
    with pytest.raises(Exception, match="float32"):
        ShardedOptimizer(list(half.parameters()), torch.optim.SGD(half.parameters(), lr=0.1), 2)


# -- which optimizers may be sharded ------------------------------------------------------------


def _mixed_model() -> torch.nn.Module:
    """Parameters of shapes (3, 2, 3, 3), (3,), (5, 12), (5,), (3, 5), (3,): 140 elements,
    cut by 5 members into shards that straddle tensors."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(2, 3, 3),
        torch.nn.Flatten(),
        torch.nn.Linear(12, 5),
        torch.nn.Tanh(),
        torch.nn.Linear(5, 3),
    )


def _check_against_unsharded(make_opt: MakeOpt, *, rtol: float = 0.0, atol: float = 0.0) -> None:
    """Five members (replicas 2) step a sharded ``make_opt`` and one process steps it
    unsharded, on the same random gradients for 8 steps; "c" dies after step 4 and the others
    re-shard from the replicas. Every member's parameters must equal the unsharded ones within
    ``rtol``/``atol`` (0: bitwise) after every step, the last step's gathered optimizer state
    (a checkpoint's) the unsharded optimizer's flattened, and the holders of each shard must
    hold bitwise the same state."""
    ref = _mixed_model()
    ref_params = list(ref.parameters())
    ref_opt = make_opt(ref_params)
    members = [_Member(n, 2, make_opt, _mixed_model) for n in "abcde"]
    for m in members:
        m.zero.start_fresh(ShardLayout.of([x.name for x in members], m.zero.length, 2), m.name)
    gen = torch.Generator().manual_seed(1)
    steps = 8
    for step in range(steps):
        grads = [torch.randn(p.shape, generator=gen) for p in ref_params]
        for p, g in zip(ref_params, grads, strict=True):
            p.grad = g.clone()
        ref_opt.step()
        fulls = _step(members, grads, (step + 1, 7), with_state=step == steps - 1)
        if step == 3:
            members = [m for m in members if m.name != "c"]
            _reshard(members, step + 1, 7)
        for m in members:
            for p, q in zip(m.model.parameters(), ref_params, strict=True):
                torch.testing.assert_close(
                    p.detach(), q.detach(), rtol=rtol, atol=atol, msg=f"step {step + 1}, {m.name}"
                )
    ref_state: dict[str, Any] = ref_opt.state[ref_params[0]]
    for full in fulls:
        assert set(full) == set(ref_state)
        for key, value in full.items():
            if value.dim() == 0:
                expected = ref_state[key]
            else:
                expected = torch.cat([ref_opt.state[p][key].reshape(-1) for p in ref_params])
            torch.testing.assert_close(value, expected, rtol=rtol, atol=atol, msg=key)
    by_range: dict[tuple[int, int], list[dict[str, torch.Tensor]]] = {}
    for m in members:
        for piece in m.zero.held():
            by_range.setdefault((piece.start, piece.stop), []).append(piece.state)
    assert all(len(states) == 2 for states in by_range.values()), by_range.keys()
    for a, b in by_range.values():
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a), "holders of a shard differ"


ALLOWED = sorted(ELEMENTWISE_OPTIMIZERS, key=lambda c: c.__name__)


@pytest.mark.parametrize("cls", ALLOWED, ids=[c.__name__ for c in ALLOWED])
def test_every_allowed_optimizer_matches_unsharded_bitwise(
    cls: Callable[..., torch.optim.Optimizer],
) -> None:
    """Default hyper-parameters. Bitwise: each element goes through the same float32
    operations sharded or not (the single-tensor path, torch's default on CPU)."""
    _check_against_unsharded(lambda params: cls(params))


OPTIONS: list[tuple[type[torch.optim.Optimizer], dict[str, Any]]] = [
    (torch.optim.SGD, {"momentum": 0.9, "nesterov": True, "weight_decay": 0.1, "maximize": True}),
    (torch.optim.SGD, {"momentum": 0.9, "dampening": 0.1, "foreach": True}),
    (torch.optim.Adam, {"amsgrad": True, "maximize": True, "weight_decay": 0.1, "foreach": True}),
    (torch.optim.Adam, {"decoupled_weight_decay": True, "weight_decay": 0.1}),
    (torch.optim.AdamW, {"amsgrad": True, "lr": torch.tensor(0.01)}),
    (torch.optim.Adamax, {"weight_decay": 0.1, "maximize": True, "foreach": True}),
    (torch.optim.NAdam, {"decoupled_weight_decay": True, "weight_decay": 0.1}),
    (torch.optim.RAdam, {"decoupled_weight_decay": True, "weight_decay": 0.1, "foreach": True}),
    (torch.optim.RMSprop, {"centered": True, "momentum": 0.9, "weight_decay": 0.1}),
    # initial_accumulator_value is used by Adagrad's constructor, not by its step
    (torch.optim.Adagrad, {"initial_accumulator_value": 0.5, "lr_decay": 0.1}),
    (torch.optim.Adadelta, {"weight_decay": 0.1, "foreach": True}),
    (torch.optim.ASGD, {"t0": 2, "weight_decay": 0.1}),
    (torch.optim.Rprop, {"maximize": True, "foreach": True}),
]


@pytest.mark.parametrize(
    "cls, options", OPTIONS, ids=[f"{c.__name__}-{'-'.join(o)}" for c, o in OPTIONS]
)
def test_allowed_optimizers_with_options_match_unsharded_bitwise(
    cls: Callable[..., torch.optim.Optimizer], options: dict[str, Any]
) -> None:
    _check_against_unsharded(lambda params: cls(params, **options))


FUSED: list[tuple[type[torch.optim.Optimizer], dict[str, Any]]] = [
    (torch.optim.SGD, {"fused": True, "momentum": 0.9}),
    (torch.optim.Adam, {"fused": True}),
    (torch.optim.AdamW, {"fused": True, "amsgrad": True}),
    (torch.optim.Adagrad, {"fused": True}),
]


@pytest.mark.parametrize("cls, options", FUSED, ids=[c.__name__ for c, _ in FUSED])
def test_fused_optimizers_match_unsharded_to_float32_rounding(
    cls: Callable[..., torch.optim.Optimizer], options: dict[str, Any]
) -> None:
    """``fused=True``: the vectorised kernel rounds an element differently in the vector body
    and in the tail of a tensor, so shards (other tensors) differ from unsharded by a few
    float32 ulps; the holders of a shard (same tensor) still agree bitwise."""
    _check_against_unsharded(lambda params: cls(params, **options), rtol=1e-6, atol=1e-7)


class _NormSGD(torch.optim.Optimizer):
    """Steps each tensor along its gradient scaled to unit norm: a per-tensor norm, as in
    LARS and LAMB, so not element-wise."""

    def __init__(self, params: list[torch.nn.Parameter], lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad / (p.grad.norm() + 1e-12), alpha=-group["lr"])


class _DeclaredAdam(torch.optim.Adam):
    ftmesh_elementwise = True


class _NormAdam(_DeclaredAdam):
    """Inherits the declaration, which does not count: a subclass may change the update
    (add a per-tensor clip, say), so it must declare for itself."""


REFUSED: list[type[torch.optim.Optimizer]] = [
    _NormSGD,
    _NormAdam,
    torch.optim.Adafactor,
    torch.optim.Muon,
    torch.optim.LBFGS,
    torch.optim.SparseAdam,
]


@pytest.mark.parametrize("cls", REFUSED, ids=[c.__name__ for c in REFUSED])
def test_optimizers_not_known_to_be_elementwise_are_refused(
    cls: type[torch.optim.Optimizer],
) -> None:
    param = torch.nn.Parameter(torch.randn(4, 3))
    make: Callable[..., torch.optim.Optimizer] = cls
    with pytest.raises(
        LocalUsageError, match=rf"cannot use .*\.{cls.__name__}: .*ftmesh_elementwise = True"
    ):
        ShardedOptimizer([param], make([param]), 2)


def test_a_declared_optimizer_is_accepted_and_the_declaration_matters() -> None:
    """A class that declares itself element-wise is taken at its word: a subclass of Adam that
    does is sharded bitwise like Adam; _NormSGD, wrongly declared, gives another model, which
    is why an undeclared class is refused."""
    _check_against_unsharded(lambda params: _DeclaredAdam(params, lr=0.01))

    class _WronglyDeclared(_NormSGD):
        ftmesh_elementwise = True

    with pytest.raises(AssertionError, match="step 1"):
        _check_against_unsharded(lambda params: _WronglyDeclared(params), rtol=1e-4, atol=1e-4)


# -- what a member offers in a sync -------------------------------------------------------------


def test_on_offer_drops_contained_pieces_and_keeps_at_most_the_widest() -> None:
    # (held shards first, then the pieces held before a re-shard, as ShardedOptimizer offers)
    assert on_offer([(0, 5), (5, 10), (0, 10)], 4) == [2]  # the whole one covers both halves
    assert on_offer([(0, 5), (5, 10), (0, 5)], 4) == [0, 1]  # a duplicate range once
    assert on_offer([(0, 2), (2, 4), (4, 6), (6, 9), (9, 10)], 4) == [0, 1, 2, 3]
    assert on_offer([(0, 1), (1, 4), (4, 6), (6, 9), (9, 10)], 2) == [1, 3]  # widest, in order
    assert on_offer([], 4) == []


def test_a_member_alone_then_joined_twice_at_one_step_syncs_each_time() -> None:
    """A member training alone after a fall-back to a checkpoint (the whole state as one
    piece) takes in two joiners one after the other at the same step (seen in CI: two
    adjacent losses, then the replacements arriving a moment apart), and syncs once more on
    the same view, as a retried sync does. Each sync offers what a
    holdings record holds (it offered 5 of at most 4 and stopped with ``LocalUsageError``),
    and every member ends with its shards of the checkpoint's state."""
    hub = Hub(timeout=10.0)
    members = {n: _Member(n, 2) for n in "abc"}
    meshes = {n: FakeMesh(hub, n) for n in "abc"}
    for n, m in members.items():
        hub.servers[n] = lambda step, digest, z=m.zero: z.served.get(digest)
    length = members["a"].zero.length
    gen = torch.Generator().manual_seed(3)
    full = {
        "step": torch.tensor(5.0),
        "exp_avg": torch.randn(length, generator=gen),
        "exp_avg_sq": torch.rand(length, generator=gen),
    }
    members["a"].zero.load_full(45, 9, {k: v.clone() for k, v in full.items()})
    try:
        for ids in ("a", "ab", "abc", "abc"):  # (the last: a sync retried on the same view)
            view = RingView.of(Peer(i, "127.0.0.1", 1) for i in ids)
            errors: list[BaseException] = []

            def sync(n: str, view: RingView = view, errors: list[BaseException] = errors) -> None:
                try:
                    members[n].zero.sync(
                        cast(SyncMesh, meshes[n]), view, 45, [view.rank_of("a")], wait=10.0
                    )
                except BaseException as exc:
                    errors.append(exc)

            threads = [threading.Thread(target=sync, args=(n,)) for n in ids]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            assert not errors, errors  # (without the bound: "at most 4 pieces, got 6")
        for n, m in members.items():
            held = m.zero.held()
            assert held, n
            for p in held:
                assert torch.equal(p.state["exp_avg"], full["exp_avg"][p.start : p.stop]), n
                assert torch.equal(p.state["exp_avg_sq"], full["exp_avg_sq"][p.start : p.stop])
    finally:
        hub.shutdown()
