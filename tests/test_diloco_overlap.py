"""DiLoCo with overlap (``DiLoCo(fragments=F, overlap=True, mix=a)``) on the in-process fake
mesh of ``trainer_sim``.

The reference is a hand-written single-process streaming DiLoCo with the delayed merge: at
step ``s`` (fragment ``p = s % F``) each member that holds local parameters from step
``s - 1`` takes ``Δ_p = θ_p - θ_m,p`` from them *before* it runs the step's ``H / F`` inner
steps (a member without them takes none and starts from ``θ``); the outer Nesterov SGD moves
``θ_p`` by the mean of the ``Δ_p`` sent (none sent: no move); then each member mixes
``θ_m,p = a θ_m,p + (1 - a) θ_p``. Each scenario checks that after every step all members hold
bitwise the same registered state (``part_digests``) and, where the plan is known, the
reference's weights; and that the fragment's allreduce ran before the step's inner steps (the
fake mesh's collectives block, so it had completed by then)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np
import pytest
import torch
from trainer_sim import (
    DATA_X,
    FakeMesh,
    Hub,
    LossBeforeOneComputes,
    Member,
    check_identical,
    data_loss,
    make_model,
    make_optimizer,
    member_thread,
    wait_all,
)

from ftmesh.errors import ConfigError
from ftmesh.mesh.blocking import SyncMesh
from ftmesh.torch import ElasticSampler, ElasticTrainer
from ftmesh.training.config import DiLoCo

pytestmark = pytest.mark.timeout(60)

H = 4
STEP_BATCH = 24
MIX = 0.5
FRAGMENTS = {2: [0, 1, 1, 1], 1: [0, 0, 0, 0]}
"""The fragment of each parameter tensor of ``make_model()`` (weight 30 | bias 5, weight 15,
bias 3) for F = 2, and for F = 1 (one-step delayed DiLoCo)."""
SIZES = {2: (30, 23), 1: (53,)}
CLOSE = 1e-5

Digests = dict[int, dict[str, dict[str, str]]]


def _settings(frags: int) -> DiLoCo:
    return DiLoCo(inner_steps=H, fragments=frags, overlap=True, mix=MIX)


def _sampler() -> ElasticSampler:
    return ElasticSampler(len(DATA_X), STEP_BATCH, seed=3)


def _fragment_syncs(hub: Hub, frags: int) -> int:
    """The committed allreduces of a fragment's bucket so far."""
    return sum(
        1
        for r in list(hub.history)
        if r.kind == "allreduce" and r.dtype == "float32" and not r.failed
        and r.size in SIZES[frags]
    )  # fmt: skip


class _Run:
    """One member's thread: ``total`` steps (closure or loop API), recording after each the
    part digests and the senders count, and at each step's first inner step how many
    fragment allreduces had completed."""

    def __init__(self, hub: Hub, member: Member, frags: int, digests: Digests) -> None:
        self.hub, self.member, self.frags, self.digests = hub, member, frags, digests
        self.senders: dict[int, int] = {}
        self.synced_before_inner: dict[int, int] = {}

    def _inner(self, t: ElasticTrainer, model: torch.nn.Module, idx: np.ndarray) -> torch.Tensor:
        self.synced_before_inner.setdefault(t.committed, _fragment_syncs(self.hub, self.frags))
        return data_loss(model, idx)

    def run(
        self,
        total: int,
        lock: threading.Lock,
        api: str = "closure",
        die_in_step: int | None = None,
        start_after: threading.Event | None = None,
        on_step: Callable[[int], None] | None = None,
        in_step: Callable[[int], None] | None = None,
        dead: threading.Event | None = None,
    ) -> None:
        """``in_step``: called with the step index at each inner batch (before
        ``die_in_step`` takes effect); ``dead`` is set once the member died."""
        hub, member = self.hub, self.member
        with member_thread(hub, member, start_after):
            model = make_model()
            opt = make_optimizer("sgd", model)
            t = ElasticTrainer(
                cast(SyncMesh, FakeMesh(hub, member.name)), model, opt, _sampler(),
                quorum="any", join_settle=0.0, step_timeout=30.0, sync=_settings(self.frags),
                check_every=1,
            )  # fmt: skip
            member.trainer = t
            calls = [0]

            def loss_fn(idx: np.ndarray) -> torch.Tensor:
                calls[0] += 1
                if in_step is not None:
                    in_step(t.committed)
                if die_in_step is not None and t.committed == die_in_step and calls[0] > 1:
                    hub.kill(member.name)  # its next call into the mesh ends the thread
                    if dead is not None:
                        dead.set()
                return self._inner(t, model, idx)

            def after(report: Any) -> None:
                member.reports.append(report)
                if not report.adopted:
                    self.senders[report.step] = t._senders
                with lock:
                    self.digests.setdefault(report.step, {})[member.name] = t.part_digests()
                if on_step is not None:
                    on_step(report.step)

            if api == "closure":
                while t.committed < total:
                    calls[0] = 0
                    after(t.step(loss_fn))
            else:
                for step in t.steps(total):
                    with step:
                        for idx in step.indices():
                            opt.zero_grad()
                            loss = loss_fn(idx)
                            loss.backward()  # type: ignore[no-untyped-call]
                            step.record_loss(loss)
                            opt.step()
                    after(step.report)
            t.finish(timeout=20.0)

    def start(self, *args: Any, **kwargs: Any) -> None:
        th = threading.Thread(
            target=self.run, args=args, kwargs=kwargs, name=self.member.name, daemon=True
        )
        self.hub.threads.append(th)
        th.start()


def _delta(params: list[torch.nn.Parameter], model: torch.nn.Module) -> list[torch.Tensor]:
    """The global parameters minus a member's."""
    return [g.detach() - p.detach() for g, p in zip(params, model.parameters(), strict=True)]


def _reference(
    plan: Sequence[tuple[str, str]], frags: int, overlap: bool = True
) -> dict[str, torch.Tensor]:
    """Single-process streaming DiLoCo with the delayed merge (the module docstring).
    ``plan[s]``: (the members step ``s``'s samples are split among, the members that
    committed it). ``overlap=False``: streaming DiLoCo without overlap, to tell them apart."""
    sampler = _sampler()
    global_model = make_model()
    params = list(global_model.parameters())
    outer = torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)
    members: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]] = {}
    last: dict[str, int] = {}  # member -> the last step it committed with its inner steps
    for s, (split, finished) in enumerate(plan):
        frag = s % frags
        synced = [f == frag for f in FRAGMENTS[frags]]
        deltas: list[list[torch.Tensor]] = []
        for m in finished:
            if m not in members:
                model = make_model()
                members[m] = (model, make_optimizer("sgd", model))
            model, inner = members[m]
            if last.get(m) != s - 1:
                model.load_state_dict(global_model.state_dict())
            elif overlap:
                deltas.append(_delta(params, model))
            for batch in np.array_split(sampler.indices(s, sorted(split), m), H // frags):
                inner.zero_grad()
                data_loss(model, batch).backward()  # type: ignore[no-untyped-call]
                inner.step()
            if not overlap:
                deltas.append(_delta(params, model))
        for k, p in enumerate(params):
            p.grad = (
                sum((d[k] / len(deltas) for d in deltas), torch.zeros_like(p))
                if synced[k] and deltas
                else None
            )
        outer.step()
        mix = MIX if overlap else 0.0
        for m in finished:
            with torch.no_grad():
                for k, p in enumerate(members[m][0].parameters()):
                    if synced[k]:
                        p.mul_(mix).add_(params[k], alpha=1.0 - mix)
            last[m] = s
    return {k: v.clone() for k, v in global_model.state_dict().items()}


def _max_diff(t: ElasticTrainer, ref: dict[str, torch.Tensor]) -> float:
    model = t.model.state_dict()
    return max(float((model[k] - ref[k]).abs().max()) for k in ref)


@pytest.mark.parametrize(("frags", "api"), [(2, "closure"), (2, "loop"), (1, "closure")])
def test_overlap_matches_single_process_streaming_diloco_with_the_delayed_merge(
    make_hub: Callable[..., Hub], frags: int, api: str
) -> None:
    """3 members, 6 steps: one global state after every step, the reference's weights (not
    those of streaming DiLoCo without overlap); every step's fragment allreduce completed
    before the step's first inner step; the first step has no sender (nobody held local
    parameters yet), every later step three."""
    steps = 6
    hub = make_hub(start_with=3)
    digests: Digests = {}
    lock = threading.Lock()
    runs = {n: _Run(hub, Member(n), frags, digests) for n in "abc"}
    for r in runs.values():
        r.start(steps, lock, api)
    wait_all(hub, 45)
    for n, r in runs.items():
        assert r.member.status == "ok", f"{n}: {r.member.status} {r.member.error!r}"
    check_identical(digests, steps)
    ref = _reference([("abc", "abc")] * steps, frags)
    for r in runs.values():
        t = cast(ElasticTrainer, r.member.trainer)
        worst = _max_diff(t, ref)
        assert worst < CLOSE, f"{r.member.name}: differs from the reference by {worst}"
        assert r.senders == {1: 0, **{s: 3 for s in range(2, steps + 1)}}, r.senders
        # step s (0-based) sent its fragment before its inner steps: s + 1 syncs by then
        assert r.synced_before_inner == {s: s + 1 for s in range(steps)}, r.synced_before_inner
    plain = _reference([("abc", "abc")] * steps, frags, overlap=False)
    assert _max_diff(cast(ElasticTrainer, runs["a"].member.trainer), plain) > 1e-3


def test_a_member_lost_mid_step_is_left_out_and_the_others_send_their_kept_gradient(
    make_hub: Callable[..., Hub],
) -> None:
    """``c`` dies during step 2's inner steps, after its outer gradient went out: the
    attempt fails at the header, ``a`` and ``b`` send their kept outer gradients again on the
    new ring (two senders) and commit step 2 without running its inner steps again."""
    steps, dies, frags = 6, 2, 2
    hub = make_hub(start_with=3)
    digests: Digests = {}
    lock = threading.Lock()
    runs = {n: _Run(hub, Member(n), frags, digests) for n in "abc"}
    inside = {n: threading.Event() for n in "ab"}

    def survivor(n: str) -> Callable[[int], None]:
        return lambda index: inside[n].set() if index == dies else None

    def victim(index: int) -> None:  # (c dies once a and b run step 2 on its view)
        if index == dies:
            assert all(e.wait(30) for e in inside.values()), "a or b never began step 2"

    for n, r in runs.items():
        if n == "c":
            r.start(steps, lock, die_in_step=dies, in_step=victim)
        else:
            r.start(steps, lock, in_step=survivor(n))
    wait_all(hub, 45)
    assert runs["c"].member.status == "killed", runs["c"].member.status
    check_identical(digests, steps)
    plan = [("abc", "abc")] * dies + [("abc", "ab")] + [("ab", "ab")] * (steps - dies - 1)
    ref = _reference(plan, frags)
    for n in "ab":
        r = runs[n]
        assert r.member.status == "ok", f"{n}: {r.member.status} {r.member.error!r}"
        t = cast(ElasticTrainer, r.member.trainer)
        assert t.diloco_rounds_computed == steps, "a survivor ran a step's inner steps twice"
        assert r.senders[dies + 1] == 2, r.senders
        worst = _max_diff(t, ref)
        assert worst < CLOSE, f"{n}: differs from the reference by {worst}"
        (lost,) = [x for x in r.member.reports if x.step == dies + 1]
        third = STEP_BATCH // 3
        assert (lost.share, lost.skipped) == (third, third), lost  # c's third: skipped


def test_a_step_lost_before_one_survivor_computed_is_run_again_on_the_new_split(
    make_hub: Callable[..., Hub],
) -> None:
    """``c`` dies during step 2's inner steps after ``a`` began them, and before ``b`` began
    step 2 (``b`` waits for the loss): the retry runs step 2 on the pair's split, ``a``
    again from its local parameters as the step found them (its outer gradient, taken from
    them, is the same), so that no sample trains twice and none is lost."""
    steps, dies, frags = 5, 2, 2
    hub = make_hub(start_with=3)
    digests: Digests = {}
    lock = threading.Lock()
    runs = {n: _Run(hub, Member(n), frags, digests) for n in "abc"}
    loss = LossBeforeOneComputes(dies)
    runs["a"].start(steps, lock, in_step=loss.a_step)
    runs["b"].start(steps, lock, on_step=loss.hold_b)
    runs["c"].start(steps, lock, die_in_step=dies, in_step=loss.victim, dead=loss.dead)
    wait_all(hub, 45)
    assert runs["c"].member.status == "killed", runs["c"].member.status
    check_identical(digests, steps)
    ref = _reference([("abc", "abc")] * dies + [("ab", "ab")] * (steps - dies), frags)
    for n in "ab":
        r = runs[n]
        assert r.member.status == "ok", f"{n}: {r.member.status} {r.member.error!r}"
        t = cast(ElasticTrainer, r.member.trainer)
        worst = _max_diff(t, ref)
        assert worst < CLOSE, f"{n}: differs from the reference by {worst}"
        (lost,) = [x for x in r.member.reports if x.step == dies + 1]
        assert (lost.share, lost.skipped) == (STEP_BATCH // 2, 0), lost
    computed = {
        n: cast(ElasticTrainer, runs[n].member.trainer).diloco_rounds_computed for n in "ab"
    }
    assert computed == {"a": steps + 1, "b": steps}, computed


def test_a_joiner_sends_nothing_at_its_first_step_then_its_own(
    make_hub: Callable[..., Hub],
) -> None:
    """``j`` starts after step 2 and fetches the state: its first step's mean is over the two
    members with local parameters (it runs the inner steps from the global ones), from its
    second step on it sends too; one state everywhere after every step."""
    steps, frags = 8, 2
    hub = make_hub(start_with=2)
    digests: Digests = {}
    lock = threading.Lock()
    joined = threading.Event()

    def on_step(step: int) -> None:
        if step >= 2:
            joined.set()

    runs = {n: _Run(hub, Member(n), frags, digests) for n in ["a", "b", "j"]}
    for n in "ab":
        runs[n].start(steps, lock, on_step=on_step)
    runs["j"].start(steps, lock, start_after=joined)
    wait_all(hub, 45)
    for n, r in runs.items():
        assert r.member.status == "ok", f"{n}: {r.member.status} {r.member.error!r}"
    check_identical(digests, steps)
    j = runs["j"]
    first = min(j.senders)  # (the first step it computed; it may have adopted one before)
    assert first < steps, "the joiner committed no step with the others"
    assert j.senders[first] == 2, j.senders
    assert all(j.senders[s] == 3 for s in range(first + 1, steps + 1)), j.senders
    t = cast(ElasticTrainer, j.member.trainer)
    assert t._rounds is not None and len(t._rounds.outer.state) == 4


def test_overlap_settings() -> None:
    with pytest.raises(ConfigError, match="mix"):
        DiLoCo(inner_steps=4, overlap=True, mix=1.0)
    with pytest.raises(ConfigError, match="mix"):
        DiLoCo(inner_steps=4, overlap=True, mix=-0.1)
    with pytest.raises(ConfigError, match="overlap"):
        DiLoCo(inner_steps=4, overlap=1)  # type: ignore[arg-type]
    assert "overlap" in _settings(2).tag and "overlap" not in DiLoCo(inner_steps=4).tag
