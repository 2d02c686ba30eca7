"""``ElasticTrainer(sync=DiLoCo(...))``: semi-synchronous rounds on the in-process fake mesh of
``trainer_sim`` (several trainers in threads). Each scenario checks that after every round all
members that committed it hold the same registered state (global parameters, the inner
optimizer's registered part, the outer momentum: ``part_digests``), and that the weights are
those of a hand-written single-process DiLoCo: per member, H inner steps of its own optimizer
(whose state is member-local) from the global parameters on its share of the round, then the
outer Nesterov SGD step on the mean of the outer gradients of the members that finished the
round. A member lost in the middle of a round's inner steps is left out of that round, the
others commit it with their outer gradients; a joiner fetches the outer state."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
import torch
import torch.utils.data as tud
from trainer_sim import (
    DATA_X,
    DATA_Y,
    FakeMesh,
    Hub,
    LossBeforeOneComputes,
    Member,
    data_loss,
    make_model,
    make_optimizer,
    member_thread,
    wait_all,
)

from ftmesh.errors import ConfigError, Departed, LocalUsageError
from ftmesh.mesh.blocking import SyncMesh
from ftmesh.torch import ElasticSampler, ElasticTrainer, StateDivergedError, TrainerConfig
from ftmesh.training.config import DiLoCo

pytestmark = pytest.mark.timeout(60)

H = 3
ROUND_BATCH = 24
"""Samples per round (the data's global batch): 8 per member of 3, split into H inner batches."""
SETTINGS = DiLoCo(inner_steps=H, outer_lr=0.7, outer_momentum=0.9, nesterov=True)
CLOSE = 1e-5
"""Mesh vs single-process weights: equal up to the allreduce's summation order."""


def _sampler() -> ElasticSampler:
    return ElasticSampler(len(DATA_X), ROUND_BATCH, seed=3)


Digests = dict[int, dict[str, dict[str, str]]]
"""round (committed step) -> member -> part -> digest."""


def _run(
    hub: Hub,
    member: Member,
    total: int,
    digests: Digests,
    lock: threading.Lock,
    *,
    die_in_round: int | None = None,
    in_round: tuple[int, threading.Event] | None = None,
    die_after: tuple[threading.Event, ...] = (),
    dead: threading.Event | None = None,
    start_after: threading.Event | None = None,
    on_round: Callable[[Member, int], None] | None = None,
    **settings: Any,
) -> None:
    """A member's thread: ``total`` rounds with the closure API, then finish; after each
    round it records its part digests. ``die_in_round``: the member dies (killed in the hub)
    during the inner steps of that 0-based round, after its first inner step and once every
    event of ``die_after`` is set, and then sets ``dead``. ``in_round=(r, event)``:
    ``event`` is set as the member starts the inner steps of round ``r``."""
    with member_thread(hub, member, start_after):
        mesh = FakeMesh(hub, member.name)
        model = make_model()
        t = ElasticTrainer(
            cast(SyncMesh, mesh), model, make_optimizer("sgd", model), _sampler(),
            quorum="any", join_settle=0.0, step_timeout=30.0, sync=SETTINGS, **settings,
        )  # fmt: skip
        member.trainer = t
        calls = [0]

        def loss_fn(idx: np.ndarray) -> torch.Tensor:
            calls[0] += 1
            if in_round is not None and t.committed == in_round[0]:
                in_round[1].set()
            if die_in_round is not None and t.committed == die_in_round and calls[0] > 1:
                for event in die_after:  # (the others' rounds started with it in the view)
                    event.wait(30)
                hub.kill(member.name)  # its next call into the mesh ends the thread
                if dead is not None:
                    dead.set()
            return data_loss(model, idx)

        while t.committed < total:
            calls[0] = 0
            report = t.step(loss_fn)
            member.reports.append(report)
            with lock:
                digests.setdefault(report.step, {})[member.name] = t.part_digests()
            if on_round is not None:
                on_round(member, report.step)
        t.finish(timeout=20.0)


def _start(hub: Hub, member: Member, *args: Any, **kwargs: Any) -> None:
    th = threading.Thread(
        target=_run, args=(hub, member, *args), kwargs=kwargs, name=member.name, daemon=True
    )
    hub.threads.append(th)
    th.start()


def _check_identical(digests: Digests, rounds: int) -> None:
    """Every round's committers hold the same registered state after it."""
    assert sorted(digests) == list(range(1, rounds + 1)), sorted(digests)
    for step, by_member in digests.items():
        distinct = {tuple(sorted(d.items())) for d in by_member.values()}
        assert len(distinct) == 1, f"round {step}: members differ: {by_member}"
        parts = next(iter(by_member.values()))
        assert "outer_optimizer" in parts and "model" in parts, parts


def _reference(plan: Sequence[tuple[Sequence[str], Sequence[str]]]) -> dict[str, torch.Tensor]:
    """Single-process DiLoCo. ``plan[r]``: (the members the round's samples are split among,
    the members whose outer gradient the round averages)."""
    sampler = _sampler()
    global_model = make_model()
    outer = torch.optim.SGD(
        global_model.parameters(), lr=SETTINGS.outer_lr, momentum=SETTINGS.outer_momentum,
        nesterov=SETTINGS.nesterov,
    )  # fmt: skip
    locals_: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]] = {}
    for r, (split, finished) in enumerate(plan):
        deltas = []
        for m in finished:
            if m not in locals_:
                model = make_model()
                locals_[m] = (model, make_optimizer("sgd", model))
            model, inner = locals_[m]
            model.load_state_dict(global_model.state_dict())
            share = sampler.indices(r, sorted(split), m)
            for batch in np.array_split(share, H):
                inner.zero_grad()
                data_loss(model, batch).backward()  # type: ignore[no-untyped-call]
                inner.step()
            pairs = zip(global_model.parameters(), model.parameters(), strict=True)
            deltas.append([g.detach() - p.detach() for g, p in pairs])
        outer.zero_grad()
        for k, p in enumerate(global_model.parameters()):
            p.grad = sum((d[k] / len(finished) for d in deltas), torch.zeros_like(p))
        outer.step()
    return {k: v.clone() for k, v in global_model.state_dict().items()}


def _max_diff(t: ElasticTrainer, ref: dict[str, torch.Tensor]) -> float:
    model = t.model.state_dict()
    return max(float((model[k] - ref[k]).abs().max()) for k in ref)


def test_rounds_match_single_process_diloco(make_hub: Callable[..., Hub]) -> None:
    """3 members, 4 rounds of H=3 inner steps, the state check in every round: one global
    state after every round, the weights of single-process DiLoCo, one outer-gradient
    allreduce per round (no collective per inner step), and each member ran the inner steps
    of every round once."""
    rounds = 4
    hub = make_hub(start_with=3)
    digests: Digests = {}
    lock = threading.Lock()
    members = {n: Member(n) for n in "abc"}
    for m in members.values():
        _start(hub, m, rounds, digests, lock, check_every=1)  # the state check every round
    wait_all(hub, 45)
    for n, m in members.items():
        assert m.status == "ok", f"{n}: {m.status} {m.error!r}"
    _check_identical(digests, rounds)
    ref = _reference([("abc", "abc")] * rounds)
    for m in members.values():
        t = cast(ElasticTrainer, m.trainer)
        assert t.diloco_rounds_computed == rounds
        worst = _max_diff(t, ref)
        assert worst < CLOSE, f"{m.name}: differs from single-process DiLoCo by {worst}"
        # the outer momentum is there (and, by the digests, the same everywhere)
        assert all("momentum_buffer" in s for s in t._rounds.outer.state.values())  # type: ignore[union-attr]
    # the weights are not those of a plain average of the members (outer_lr, momentum act)
    plain = _reference_without_outer(rounds)
    assert _max_diff(cast(ElasticTrainer, members["a"].trainer), plain) > 1e-3
    # per round: the float32 outer-gradient allreduce, no more (inner steps are local)
    grads = [r for r in hub.history if r.kind == "allreduce" and r.dtype == "float32"]
    assert len(grads) == rounds, [(r.kind, r.dtype) for r in hub.history]
    assert all(r.members == ("a", "b", "c") for r in grads)
    losses = [r.loss for r in members["a"].reports]
    assert all(np.isfinite(losses)), losses


def _reference_without_outer(rounds: int) -> dict[str, torch.Tensor]:
    """DiLoCo with outer_lr 1 and no momentum (parameter averaging), to tell it apart."""
    global SETTINGS
    saved = SETTINGS
    SETTINGS = DiLoCo(inner_steps=H, outer_lr=1.0, outer_momentum=0.0, nesterov=False)
    try:
        return _reference([("abc", "abc")] * rounds)
    finally:
        SETTINGS = saved


def test_a_member_lost_mid_round_is_left_out_of_it(make_hub: Callable[..., Hub]) -> None:
    """``c`` dies during round 2's inner steps: ``a`` and ``b`` commit round 2 with their own
    outer gradients (computed on their thirds of the round, not run again), averaged over
    the two of them; then go on as a pair. The weights are single-process DiLoCo's with that
    plan."""
    rounds, dies = 5, 2
    hub = make_hub(start_with=3)
    digests: Digests = {}
    lock = threading.Lock()
    members = {n: Member(n) for n in "abc"}
    started = {n: threading.Event() for n in "ab"}
    for n in "ab":
        _start(hub, members[n], rounds, digests, lock, in_round=(dies, started[n]), check_every=1)
    # c dies once a and b run round 2's inner steps (on a busy host it could die before
    # they start it, and they would train the round on halves: another plan)
    die_after = tuple(started.values())
    _start(
        hub, members["c"], rounds, digests, lock, die_in_round=dies, die_after=die_after,
        check_every=1,
    )  # fmt: skip
    wait_all(hub, 45)
    assert members["c"].status == "killed", (members["c"].status, members["c"].error)
    for n in "ab":
        assert members[n].status == "ok", f"{n}: {members[n].status} {members[n].error!r}"
    _check_identical(digests, rounds)
    assert set(digests[dies + 1]) == {"a", "b"}
    plan = [("abc", "abc")] * dies + [("abc", "ab")] + [("ab", "ab")] * (rounds - dies - 1)
    ref = _reference(plan)
    for n in "ab":
        t = cast(ElasticTrainer, members[n].trainer)
        assert t.diloco_rounds_computed == rounds, "a survivor ran a round's inner steps twice"
        # the loss of c costs a survivor at most one failed attempt: one when the round's
        # collectives had started on a view with c, none when the view had lost c first
        assert t.recoveries <= 1, t.recoveries
        worst = _max_diff(t, ref)
        assert worst < CLOSE, f"{n}: differs from single-process DiLoCo by {worst}"
        # the round's report counts what was trained: a third each, c's third skipped
        (lost,) = [r for r in members[n].reports if r.step == dies + 1]
        third = ROUND_BATCH // 3
        assert (lost.share, lost.skipped, lost.computing) == (third, third, ("a", "b")), lost
    # from the round c died in, the outer-gradient allreduces ran on a and b (the one with c
    # failed, or never formed: the view lost c first)
    grads = [r for r in hub.history if r.kind == "allreduce" and r.dtype == "float32"]
    done = [r for r in grads if not r.failed]
    assert len(done) == rounds, grads
    assert [r.members for r in done[dies:]] == [("a", "b")] * (rounds - dies), done


def test_a_round_lost_before_one_survivor_computed_is_run_again_on_the_new_split(
    make_hub: Callable[..., Hub],
) -> None:
    """``c`` dies during round 2's inner steps, after ``a`` started them and before ``b``
    began the round (``b`` waits for the loss): ``a`` holds an outer gradient of its third,
    ``b`` none. The retry must not mix the two splits: ``a`` drops its ``Δ`` and runs the
    round's inner steps again on its half, with its inner optimizer's state as the first run
    found it, and the round trains each of its samples once (no sample skipped, none
    twice). The weights are single-process DiLoCo's with the pair's split of round 2."""
    rounds, dies = 4, 2
    hub = make_hub(start_with=3)
    digests: Digests = {}
    lock = threading.Lock()
    members = {n: Member(n) for n in "abc"}
    loss = LossBeforeOneComputes(dies)
    a_inside = (dies, loss.a_inside)
    _start(hub, members["a"], rounds, digests, lock, in_round=a_inside, check_every=1)
    _start(
        hub, members["b"], rounds, digests, lock, on_round=lambda m, s: loss.hold_b(s),
        check_every=1,
    )  # fmt: skip
    _start(
        hub, members["c"], rounds, digests, lock, die_in_round=dies, die_after=(loss.a_inside,),
        dead=loss.dead, check_every=1,
    )  # fmt: skip
    wait_all(hub, 45)
    assert members["c"].status == "killed", (members["c"].status, members["c"].error)
    for n in "ab":
        assert members[n].status == "ok", f"{n}: {members[n].status} {members[n].error!r}"
    _check_identical(digests, rounds)
    ref = _reference([("abc", "abc")] * dies + [("ab", "ab")] * (rounds - dies))
    for n in "ab":
        t = cast(ElasticTrainer, members[n].trainer)
        worst = _max_diff(t, ref)
        assert worst < CLOSE, f"{n}: differs from single-process DiLoCo by {worst}"
        (lost,) = [r for r in members[n].reports if r.step == dies + 1]
        assert (lost.share, lost.skipped) == (ROUND_BATCH // 2, 0), lost
    # a ran round 2's inner steps twice (its third, then its half), b once
    computed = {n: cast(ElasticTrainer, members[n].trainer).diloco_rounds_computed for n in "ab"}
    assert computed == {"a": rounds + 1, "b": rounds}, computed


def test_a_joiner_gets_the_global_parameters_and_the_outer_state(
    make_hub: Callable[..., Hub],
) -> None:
    """``a`` and ``b`` train; ``j`` starts after round 2 and fetches the state: its state
    after each round it commits equals theirs (outer momentum included), and it ran inner
    steps only for the rounds after it joined."""
    rounds = 6
    hub = make_hub(start_with=2)
    digests: Digests = {}
    lock = threading.Lock()
    joined = threading.Event()

    def on_round(m: Member, step: int) -> None:
        if step >= 2:
            joined.set()

    members = {n: Member(n) for n in ["a", "b", "j"]}
    for n in "ab":
        _start(hub, members[n], rounds, digests, lock, on_round=on_round)
    _start(hub, members["j"], rounds, digests, lock, start_after=joined)
    wait_all(hub, 45)
    for n, m in members.items():
        assert m.status == "ok", f"{n}: {m.status} {m.error!r}"
    _check_identical(digests, rounds)
    first = members["j"].reports[0]
    assert first.step >= 2 and first.synced and first.sync_bytes > 0, first
    joined_at = [s for s, by in sorted(digests.items()) if "j" in by]
    assert joined_at and joined_at[0] < rounds, "the joiner committed no round with the others"
    t = cast(ElasticTrainer, members["j"].trainer)
    assert 0 < t.diloco_rounds_computed < rounds
    assert all("momentum_buffer" in s for s in t._rounds.outer.state.values())  # type: ignore[union-attr]


def test_a_hot_spare_applies_the_rounds_of_the_others(make_hub: Callable[..., Hub]) -> None:
    """``max_peers=2``: ``c`` is a hot spare, runs no inner steps and contributes nothing; the
    round is the mean over ``a`` and ``b``, and ``c`` holds the same state after each."""
    rounds = 3
    hub = make_hub(start_with=3)
    digests: Digests = {}
    lock = threading.Lock()
    members = {n: Member(n) for n in "abc"}
    for m in members.values():
        _start(hub, m, rounds, digests, lock, max_peers=2)
    wait_all(hub, 45)
    for n, m in members.items():
        assert m.status == "ok", f"{n}: {m.status} {m.error!r}"
    _check_identical(digests, rounds)
    assert all(len(by) == 3 for by in digests.values())
    ref = _reference([("ab", "ab")] * rounds)
    for n, m in members.items():
        t = cast(ElasticTrainer, m.trainer)
        assert t.diloco_rounds_computed == (0 if n == "c" else rounds), n
        worst = _max_diff(t, ref)
        assert worst < CLOSE, f"{n}: differs from single-process DiLoCo by {worst}"


def test_a_planned_departure_leaves_after_the_round_it_announced_in(
    make_hub: Callable[..., Hub],
) -> None:
    """``c`` is asked to leave (SIGTERM's ``request_leave``) after round 1: its leave bit goes
    out in round 2's header, its outer gradient counts in round 2, and it leaves after it
    (``Departed``); ``a`` and ``b`` run rounds 3-4 on the view without it with no failed
    collective and no retried attempt, and equal the single-process DiLoCo of that plan."""
    rounds = 4
    hub = make_hub(start_with=3)
    digests: Digests = {}
    lock = threading.Lock()
    members = {n: Member(n) for n in "abc"}

    def leave(member: Member, step: int) -> None:
        if member.name == "c" and step == 1:
            cast(ElasticTrainer, member.trainer).mesh.request_leave()

    for m in members.values():
        _start(hub, m, rounds, digests, lock, on_round=leave)
    wait_all(hub, 45)
    c = members["c"]
    assert c.status == "left" and isinstance(c.error, Departed), (c.status, c.error)
    assert c.error.step == 2
    for n in "ab":
        m = members[n]
        assert m.status == "ok", f"{n}: {m.status} {m.error!r}"
        assert [r.members for r in m.reports] == [("a", "b", "c")] * 2 + [("a", "b")] * 2
        assert [r.leaving for r in m.reports][1] == ("c",)
        assert all(r.attempts == 1 for r in m.reports), [r.attempts for r in m.reports]
    assert hub.failed_rounds() == []
    _check_identical(digests, rounds)
    ref = _reference([("abc", "abc")] * 2 + [("ab", "ab")] * 2)
    for n in "ab":
        worst = _max_diff(cast(ElasticTrainer, members[n].trainer), ref)
        assert worst < CLOSE, f"{n}: differs from single-process DiLoCo by {worst}"


def test_a_diverged_outer_state_is_caught_at_the_next_check(make_hub: Callable[..., Hub]) -> None:
    """``check_every=2``: ``b``'s outer momentum is changed behind the trainer's back after
    round 1; at the next state check ``b``, alone against a strict majority, raises
    ``StateDivergedError`` naming ``outer_optimizer``, and ``a`` and ``c`` go on and finish."""
    rounds = 4
    hub = make_hub(start_with=3)
    digests: Digests = {}
    lock = threading.Lock()
    members = {n: Member(n) for n in "abc"}

    def corrupt(member: Member, step: int) -> None:
        if member.name == "b" and step == 1:
            t = cast(ElasticTrainer, member.trainer)
            outer = t._state.state.objects["outer_optimizer"]
            for state in outer.state.values():
                state["momentum_buffer"].add_(1.0)

    for m in members.values():
        _start(hub, m, rounds, digests, lock, on_round=corrupt, check_every=2)
    wait_all(hub, 45)
    b = members["b"]
    assert b.status == "error" and isinstance(b.error, StateDivergedError), (b.status, b.error)
    assert b.error.parts.get("outer_optimizer") == [["a", "c"], ["b"]], b.error.parts
    assert cast(ElasticTrainer, b.trainer).committed == 2  # checks at rounds 1, 3, ...: 3
    for n in "ac":
        assert members[n].status == "ok", f"{n}: {members[n].status} {members[n].error!r}"
    assert {(r, accused) for r, accused, _ in hub.offences} == {("a", "b"), ("c", "b")}


def test_a_checkpoint_holds_the_outer_state(make_hub: Callable[..., Hub], tmp_path: Path) -> None:
    """One member, a checkpoint every 2 rounds: a new trainer resumes from round 4 with the
    same global parameters and outer momentum (part digests and the whole state's)."""
    hub = make_hub(start_with=1)
    digests: Digests = {}
    lock = threading.Lock()
    first = Member("a")
    _start(hub, first, 4, digests, lock, checkpoint_dir=tmp_path, checkpoint_every=2)
    wait_all(hub, 45)
    assert first.status == "ok", f"{first.status} {first.error!r}"
    saved = cast(ElasticTrainer, first.trainer)
    model = make_model()
    resumed = ElasticTrainer(
        cast(SyncMesh, FakeMesh(hub, "b")), model, make_optimizer("sgd", model), _sampler(),
        sync=SETTINGS, checkpoint_dir=tmp_path, checkpoint_every=2,
    )  # fmt: skip
    try:
        assert resumed.resume() == 4
        assert resumed.part_digests()["outer_optimizer"] == saved.part_digests()["outer_optimizer"]
        assert resumed.part_digests()["model"] == saved.part_digests()["model"]
        assert resumed.digest() == saved.digest()
        outer = resumed._rounds.outer.state  # type: ignore[union-attr]
        assert outer and all("momentum_buffer" in st for st in outer.values())
    finally:
        resumed.close()


def test_an_error_in_the_inner_steps_leaves_the_committed_state(
    make_hub: Callable[..., Hub],
) -> None:
    """The user's ``loss_fn`` raises in the middle of a round's inner steps: the error reaches
    the caller, the model holds the committed (global) parameters again, the inner optimizer's
    registered part is the committed one, and the next round trains on."""
    hub = make_hub(start_with=1)
    model = make_model()
    t = ElasticTrainer(
        cast(SyncMesh, FakeMesh(hub, "a")), model, make_optimizer("sgd", model), _sampler(),
        sync=SETTINGS, quorum="any", join_settle=0.0, step_timeout=30.0,
    )  # fmt: skip
    try:
        t.step(lambda idx: data_loss(model, idx))
        before = t.part_digests()
        calls = [0]

        def failing(idx: np.ndarray) -> torch.Tensor:
            calls[0] += 1
            if calls[0] == 2:
                raise RuntimeError("boom")
            return data_loss(model, idx)

        with pytest.raises(RuntimeError, match="boom"):
            t.step(failing)
        assert t.committed == 1
        assert t.part_digests() == before
        t.step(lambda idx: data_loss(model, idx))
        assert t.committed == 2
    finally:
        t.close()


def test_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="inner_steps"):
        DiLoCo(inner_steps=0)
    with pytest.raises(ConfigError, match="outer_lr"):
        DiLoCo(inner_steps=2, outer_lr=0)
    with pytest.raises(ConfigError, match="outer_momentum"):
        DiLoCo(inner_steps=2, outer_momentum=1.0)
    with pytest.raises(ConfigError, match="nesterov"):
        DiLoCo(inner_steps=2, outer_momentum=0.0)
    with pytest.raises(ConfigError, match="shard_optimizer"):
        TrainerConfig(sync=DiLoCo(inner_steps=2), shard_optimizer=True)
    with pytest.raises(ConfigError, match="sync"):
        TrainerConfig(sync="diloco")  # type: ignore[arg-type]


def test_the_layout_carries_the_settings() -> None:
    """Members with other DiLoCo settings differ in the registered state's layout (the sync
    turns that into a ``ConfigError``)."""
    hub = Hub()
    try:
        layouts: list[Any] = []
        for settings in (SETTINGS, DiLoCo(inner_steps=H + 1), None):
            model = make_model()
            t = ElasticTrainer(
                cast(SyncMesh, FakeMesh(hub, f"m{len(layouts)}")), model,
                make_optimizer("sgd", model), _sampler(), sync=settings,
            )  # fmt: skip
            layouts.append(t._state.layout)
            t.close()
        assert len(set(layouts)) == 3, layouts
    finally:
        hub.shutdown()


def _run_loop(
    hub: Hub,
    member: Member,
    total: int,
    digests: Digests,
    lock: threading.Lock,
    *,
    die_in_round: int | None = None,
    arrived: dict[str, threading.Event] | None = None,
    arrive_in: int | None = None,
    **settings: Any,
) -> None:
    """``_run`` with the loop API: ``for step in trainer.steps(total): with step:``, the body
    one inner step per batch of ``step.indices()`` (zero_grad, forward, backward,
    ``optimizer.step()``), as the closure path runs them. ``arrived``: in round
    ``arrive_in`` each member sets its event at its first inner batch (its attempt's view
    is fixed then), and the dying member waits for the others' before it dies, so that it
    dies in the round on every member's view (else, on a loaded host, the others could start
    the round after its death, on a view without it)."""
    with member_thread(hub, member, None):
        model = make_model()
        opt = make_optimizer("sgd", model)
        t = ElasticTrainer(
            cast(SyncMesh, FakeMesh(hub, member.name)), model, opt, _sampler(),
            quorum="any", join_settle=0.0, step_timeout=30.0, sync=SETTINGS, **settings,
        )  # fmt: skip
        member.trainer = t
        for step in t.steps(total):
            with step:
                for k, idx in enumerate(step.indices()):
                    if arrived is not None and step.index == arrive_in and k == 0:
                        arrived[member.name].set()
                    if die_in_round is not None and step.index == die_in_round and k == 1:
                        for name, ev in (arrived or {}).items():
                            assert ev.wait(20.0), f"{name} never reached round {die_in_round}"
                        hub.kill(member.name)  # its next call into the mesh ends the thread
                    opt.zero_grad()
                    loss = data_loss(model, idx)
                    loss.backward()  # type: ignore[no-untyped-call]
                    step.record_loss(loss)
                    opt.step()
            report = step.report
            assert report is not None
            member.reports.append(report)
            with lock:
                digests.setdefault(report.step, {})[member.name] = t.part_digests()
        t.finish(timeout=20.0)


def test_the_loop_api_runs_the_same_rounds(make_hub: Callable[..., Hub]) -> None:
    """The loop API (``trainer.steps()``, the inner steps in the body): ``c`` dies in round
    2's inner steps, ``a`` and ``b`` commit it with their own outer gradients (no inner step
    run twice) and go on: the same registered state on every member after every round, and
    the weights of single-process DiLoCo with that plan (as the closure path's test); the
    reported loss is the members' mean inner loss, as the closure path reports it."""
    rounds, dies = 4, 2
    hub = make_hub(start_with=3)
    digests: Digests = {}
    lock = threading.Lock()
    members = {n: Member(n) for n in "abc"}
    arrived = {n: threading.Event() for n in "abc"}
    for n, m in members.items():
        th = threading.Thread(
            target=_run_loop, args=(hub, m, rounds, digests, lock), name=n, daemon=True,
            kwargs={"die_in_round": dies if n == "c" else None, "check_every": 1,
                    "arrived": arrived, "arrive_in": dies},
        )  # fmt: skip
        hub.threads.append(th)
        th.start()
    wait_all(hub, 45)
    assert members["c"].status == "killed", members["c"].status
    for n in "ab":
        assert members[n].status == "ok", f"{n}: {members[n].status} {members[n].error!r}"
    _check_identical(digests, rounds)
    assert set(digests[dies + 1]) == {"a", "b"}
    plan = [("abc", "abc")] * dies + [("abc", "ab")] + [("ab", "ab")] * (rounds - dies - 1)
    ref = _reference(plan)
    for n in "ab":
        t = cast(ElasticTrainer, members[n].trainer)
        assert t.diloco_rounds_computed == rounds, "a survivor ran a round's inner steps twice"
        # the loss of c costs a survivor at most one failed attempt: one when the round's
        # collectives had started on a view with c, none when the view had lost c first
        assert t.recoveries <= 1, t.recoveries
        worst = _max_diff(t, ref)
        assert worst < CLOSE, f"{n}: differs from single-process DiLoCo by {worst}"
    losses = [r.loss for r in members["a"].reports]
    assert all(np.isfinite(losses)) and all(0.1 < x < 5 for x in losses), losses


def test_the_loop_api_trains_rounds_from_a_data_loader(make_hub: Callable[..., Hub]) -> None:
    """A trainer built on a ``DataLoader`` (shuffled, two worker processes kept across
    iterators; ``batch_size`` the round's global batch), the body ``for x, y in
    step.batches()``: the inner batches come collated from the loader, and ``c``'s death in
    round 2's inner steps starts its iterator over on the new view. The weights are those of
    single-process DiLoCo with that plan, as with ``step.indices()``."""
    rounds, dies = 4, 2
    hub = make_hub(start_with=3)
    members = {n: Member(n) for n in "abc"}
    arrived = {n: threading.Event() for n in "abc"}
    dataset = tud.TensorDataset(DATA_X, DATA_Y)

    def run(member: Member) -> None:
        with member_thread(hub, member, None):
            model = make_model()
            opt = make_optimizer("sgd", model)
            loader = tud.DataLoader(
                dataset, batch_size=ROUND_BATCH, shuffle=True, drop_last=True, num_workers=2,
                persistent_workers=True,
            )  # fmt: skip
            t = ElasticTrainer(
                cast(SyncMesh, FakeMesh(hub, member.name)), model, opt, loader, data_seed=3,
                quorum="any", join_settle=0.0, step_timeout=30.0, sync=SETTINGS,
            )  # fmt: skip
            member.trainer = t
            try:
                for step in t.steps(rounds):
                    with step:
                        for k, (x, y) in enumerate(step.batches()):
                            if step.index == dies and k == 0:
                                arrived[member.name].set()
                            if member.name == "c" and step.index == dies and k == 1:
                                for ev in arrived.values():
                                    assert ev.wait(20.0)
                                hub.kill(member.name)
                            opt.zero_grad()
                            loss = torch.nn.functional.cross_entropy(model(x), y)
                            loss.backward()  # type: ignore[no-untyped-call]
                            opt.step()
                    assert step.report is not None
                    member.reports.append(step.report)
                t.finish(timeout=20.0)
            finally:
                t.close()  # (a killed member's too: its loader's worker processes)

    for m in members.values():
        th = threading.Thread(target=run, args=(m,), name=m.name, daemon=True)
        hub.threads.append(th)
        th.start()
    wait_all(hub, 50)
    assert members["c"].status == "killed", (members["c"].status, members["c"].error)
    plan = [("abc", "abc")] * dies + [("abc", "ab")] + [("ab", "ab")] * (rounds - dies - 1)
    ref = _reference(plan)
    for n in "ab":
        assert members[n].status == "ok", f"{n}: {members[n].status} {members[n].error!r}"
        t = cast(ElasticTrainer, members[n].trainer)
        assert t.committed == rounds and t.diloco_rounds_computed == rounds
        worst = _max_diff(t, ref)
        assert worst < CLOSE, f"{n}: differs from single-process DiLoCo by {worst}"
        assert t._loader is not None and t._loader.restarts >= 1


def test_the_loop_api_refuses_an_outer_step_of_its_own_and_restores_on_errors(
    make_hub: Callable[..., Hub],
) -> None:
    """In a DiLoCo loop body ``optimizer.step()`` after the loop over the inner batches is
    refused (the outer step is the trainer's), ``step.batches()`` is refused (no DataLoader
    plan for rounds), and an error in the middle of the inner steps reaches the caller with
    the committed (global) parameters in the model; the next round trains on."""
    hub = make_hub(start_with=1)
    model = make_model()
    opt = make_optimizer("sgd", model)
    t = ElasticTrainer(
        cast(SyncMesh, FakeMesh(hub, "a")), model, opt, _sampler(),
        sync=SETTINGS, quorum="any", join_settle=0.0, step_timeout=30.0,
    )  # fmt: skip

    def inner(step: Any, fail_at: int | None = None) -> None:
        for k, idx in enumerate(step.indices()):
            if k == fail_at:
                raise RuntimeError("boom")
            opt.zero_grad()
            data_loss(model, idx).backward()  # type: ignore[no-untyped-call]
            opt.step()

    try:
        steps = iter(t.steps())
        step = next(steps)
        with step:
            inner(step)
            with pytest.raises(LocalUsageError, match="inner step"):
                opt.step()
        assert t.committed == 1
        before = t.part_digests()
        step = next(steps)
        with pytest.raises(RuntimeError, match="boom"), step:
            inner(step, fail_at=2)
        assert t.committed == 1 and t.part_digests() == before
        step = next(iter(t.steps()))  # (an error in a body ends its loop: a new one)
        with pytest.raises(LocalUsageError, match=r"step\.indices\(\)"), step:
            next(iter(step.batches()))
        step = next(iter(t.steps()))
        with step:
            inner(step)
        assert t.committed == 2 and t.part_digests() != before
    finally:
        t.close()
