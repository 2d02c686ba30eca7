"""``ElasticTrainer(shard_optimizer=True)`` (ZeRO-1 sharded optimizer state, ring replicas)
under failures, on the in-process fake mesh of ``trainer_sim``: several trainers in threads,
collectives that fail for some members only, deaths at chosen rounds. Each scenario checks that
the survivors end at the same step with one model, that the replicas of every shard are
bitwise identical, that no state is reported lost unless it was (two adjacent losses with
replicas=2), and, where it applies, that the result is single-process training's."""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from trainer_sim import (
    FakeMesh,
    Hub,
    Inject,
    Member,
    Round,
    make_model,
    make_optimizer,
    make_sampler,
    max_diff,
    reference,
    run_members,
    start_member,
    wait_all,
)

from ftmesh.errors import ConfigError, LocalUsageError, PeerLostError
from ftmesh.mesh.blocking import SyncMesh
from ftmesh.state import State, StateLostError, latest_valid_checkpoint
from ftmesh.torch.trainer import ElasticTrainer, StepReport

pytestmark = pytest.mark.timeout(60)

CLOSE = 1e-5
"""Mesh vs single-process weights: equal up to summation order (a lost or stale piece of
optimizer state moves them by far more)."""


def _trainer(m: Member) -> ElasticTrainer:
    assert m.trainer is not None, f"{m.name} never started ({m.status}: {m.error!r})"
    return m.trainer


def _check_converged(
    members: dict[str, Member], survivors: list[str], total: int, *, fallbacks: int = 0
) -> None:
    """The survivors trained to ``total``, finished, and hold one model."""
    for name in survivors:
        m = members[name]
        assert m.status == "ok", f"{name}: {m.status} {m.error!r}"
        t = _trainer(m)
        assert t.committed == total, name
        assert t.fallbacks == fallbacks, f"{name} fell back {t.fallbacks} times"
        steps = [r.step for r in m.reports]
        assert steps == sorted(set(steps)), f"{name} repeated a step: {steps}"
    digests = {_trainer(members[n]).digest() for n in survivors}
    assert len(digests) == 1, "survivors hold different models"


def _check_replicas(members: dict[str, Member], survivors: list[str], replicas: int) -> None:
    """Every shard is held ``replicas`` times, and its copies are bitwise identical."""
    held: dict[str, list[str]] = defaultdict(list)
    for name in survivors:
        for rng, digest in _trainer(members[name]).shard_digests().items():
            held[rng].append(digest)
    assert held, "no shards held"
    split = {rng: ds for rng, ds in held.items() if len(set(ds)) > 1}
    assert not split, f"replicas of shards {sorted(split)} differ"
    assert all(len(ds) == replicas for ds in held.values()), held


def _check_reference(
    members: dict[str, Member], name: str, opt: str, total: int, *, tiny: bool = False
) -> None:
    model = {k: v.clone() for k, v in _trainer(members[name]).model.state_dict().items()}
    worst = max_diff(model, reference(opt, total, tiny))
    assert worst < CLOSE, f"final model differs from single-process training by {worst}"


def _nth(kind: str, n: int, act: Inject, dtype: str = "float32") -> Inject:
    """An ``inject`` that applies ``act`` to the ``n``-th completed float32 ``kind`` round (a
    step's gradient allreduce, or the parameter allgather that commits a sharded step);
    ``dtype="float64"``: of the step's gathered header rows (the barriers' single float64
    values are not counted)."""
    seen = [0]

    def inject(r: Round) -> dict[str, BaseException]:
        rows = dtype != "float64" or next(iter(r.contrib.values()))[2].size > 1
        if r.kind == kind and r.dtype == dtype and rows:
            seen[0] += 1
            if seen[0] == n:
                return act(r)
        return {}

    return inject


def _after_step(n: int) -> tuple[threading.Event, Callable[[Member, StepReport], None]]:
    """An event set once any member has committed step ``n``, and the ``on_step`` setting it."""
    reached = threading.Event()

    def on_step(m: Member, r: StepReport) -> None:
        if r.step >= n:
            reached.set()

    return reached, on_step


# ------------------------------------------------------------------------------ scenarios


@pytest.mark.parametrize("opt", ["adam", "sgd"])
def test_baseline_with_a_joiner(make_hub: Callable[..., Hub], opt: str) -> None:
    """4 members train; a fifth joins after step 3 and fetches the model and its shards."""
    total = 10
    hub = make_hub(start_with=4)
    joined, on_step = _after_step(3)

    members = {n: Member(n) for n in ["a", "b", "c", "d", "0j"]}
    for n in "abcd":
        start_member(hub, members[n], opt=opt, total=total, on_step=on_step)
    start_member(hub, members["0j"], opt=opt, total=total, start_after=joined)
    wait_all(hub, 45)
    everyone = list(members)
    _check_converged(members, everyone, total)
    first = members["0j"].reports[0]
    assert first.step >= 3 and first.synced and first.sync_bytes > 0, first  # it fetched state
    assert hub.fetched_into_buffer == ["0j"]  # into the buffer it prepared while joining
    _check_replicas(members, everyone, replicas=2)
    _check_reference(members, "a", opt, total)


def test_a_replicated_joiner_fetches_into_the_buffer_it_prepared(
    make_hub: Callable[..., Hub],
) -> None:
    """Unsharded, with SGD momentum (state that the first step creates): the members
    advertise the size of the state after it, and the joiner receives into its buffer."""
    total = 8
    hub = make_hub(start_with=3)
    joined, on_step = _after_step(3)

    members = {n: Member(n) for n in ["a", "b", "c", "0j"]}
    for n in "abc":
        start_member(hub, members[n], opt="sgd", total=total, shard=False, on_step=on_step)
    start_member(hub, members["0j"], opt="sgd", total=total, shard=False, start_after=joined)
    wait_all(hub, 45)
    _check_converged(members, list(members), total)
    assert members["0j"].reports[0].sync_bytes > 0
    assert hub.fetched_into_buffer == ["0j"]
    state = _trainer(members["a"]).state
    assert set(hub.state_bytes.values()) == {state.nbytes()}  # momentum included


def test_joiner_piece_fetch_fails_once(make_hub: Callable[..., Hub]) -> None:
    """The joiner's first fetch of a piece of optimizer state fails (transient): it retries;
    nobody reports the state lost."""
    total = 10
    hub = make_hub(start_with=3)
    joined, on_step = _after_step(3)
    failed: list[str] = []

    def fetch_fail(me: str, is_piece: bool) -> bool:
        if me == "0j" and is_piece and not failed:
            failed.append(me)
            return True
        return False

    hub.fetch_fail = fetch_fail

    # "0j" sorts first: rank 0 of the views it is in.
    members = {n: Member(n) for n in ["a", "b", "c", "0j"]}
    for n in "abc":
        start_member(hub, members[n], opt="adam", total=total, on_step=on_step)
    start_member(hub, members["0j"], opt="adam", total=total, start_after=joined)
    wait_all(hub, 45)
    assert failed == ["0j"], "the fetch failure was not injected"
    for m in members.values():
        assert not isinstance(m.error, StateLostError), f"{m.name}: {m.error}"
    everyone = list(members)
    _check_converged(members, everyone, total)
    _check_replicas(members, everyone, replicas=2)
    _check_reference(members, "a", "adam", total)


@pytest.mark.parametrize("shard", [True, False], ids=["sharded", "replicated"])
def test_members_that_miss_the_last_step_adopt_it(
    make_hub: Callable[..., Hub], shard: bool
) -> None:
    """The round that commits the last step (the parameter allgather when sharded, the
    gathered header rows when replicated) completes on a and b and stalls on c and d (nobody
    dies). a and b finish and leave; c and d must take the committed step from them (state
    fetches take a moment), not train it again alone."""
    total = 8
    # membership lags a little behind the stall; fetches are slower than leaving
    hub = make_hub(start_with=4, view_change_delay=0.3, fetch_delay=0.2)
    stalled: list[str] = []

    def stall(r: Round) -> dict[str, BaseException]:
        stalled.extend(["c", "d"])
        return {m: PeerLostError("stall") for m in ("c", "d")}

    hub.inject = _nth("allgather", total, stall, "float32" if shard else "float64")
    members = run_members(hub, "abcd", opt="adam", total=total, shard=shard)
    assert stalled == ["c", "d"], "the stall was not injected"
    _check_converged(members, list("abcd"), total)
    for m in members.values():
        assert [r.step for r in m.reports] == list(range(1, total + 1)), m.name
    # Every gradient allreduce that anybody completed ran on the whole ring, once per step.
    grads = [
        r
        for r in hub.history
        if r.kind == "allreduce" and r.dtype == "float32" and r.failed != set(r.members)
    ]
    assert [r.members for r in grads] == [tuple("abcd")] * total, [r.members for r in grads]
    _check_reference(members, "a", "adam", total)


@pytest.mark.parametrize("opt", ["adam", "sgd"])
def test_death_during_the_final_allgather(make_hub: Callable[..., Hub], opt: str) -> None:
    """e dies during step 6's parameter allgather: a and b complete it (commit step 6), c and
    d do not. The survivors re-shard from the replicas without losing anything."""
    total = 10
    hub = make_hub(start_with=5, view_change_delay=0.2)

    def kill_e(r: Round) -> dict[str, BaseException]:
        hub.kill("e")
        return {m: PeerLostError("e died") for m in ("c", "d", "e")}

    hub.inject = _nth("allgather", 6, kill_e)
    members = run_members(hub, "abcde", opt=opt, total=total)
    assert members["e"].status == "killed"
    survivors = list("abcd")
    _check_converged(members, survivors, total)
    _check_replicas(members, survivors, replicas=2)
    _check_reference(members, "a", opt, total)


@pytest.mark.parametrize("opt", ["adam", "sgd"])
def test_two_non_adjacent_deaths_in_a_row(make_hub: Callable[..., Hub], opt: str) -> None:
    """e dies during step 6's parameter allgather (a and b complete it); then b dies during
    the holdings allgather of the re-shard that follows, which completes on c only."""
    total = 10
    hub = make_hub(start_with=5, view_change_delay=0.2)
    armed = [False]
    second: list[tuple[str, ...]] = []

    def inject(r: Round) -> dict[str, BaseException]:
        if r.kind == "allgather" and r.dtype == "int64" and armed[0]:
            armed[0] = False
            second.append(r.members)
            hub.kill("b")
            return {m: PeerLostError("b died") for m in r.members if m != "c"}
        return first(r)

    def kill_e(r: Round) -> dict[str, BaseException]:
        armed[0] = True
        hub.kill("e")
        return {m: PeerLostError("e died") for m in ("c", "d", "e")}

    first = _nth("allgather", 6, kill_e)
    hub.inject = inject
    members = run_members(hub, "abcde", opt=opt, total=total)
    assert second == [tuple("abcd")], f"the second death hit {second}"
    assert members["b"].status == members["e"].status == "killed"
    survivors = ["a", "c", "d"]
    for n in survivors:
        assert not isinstance(members[n].error, StateLostError), f"{n}: {members[n].error}"
    _check_converged(members, survivors, total)
    _check_replicas(members, survivors, replicas=2)
    _check_reference(members, "a", opt, total)


def test_empty_shards_after_a_rollback(make_hub: Callable[..., Hub], tmp_path: Path) -> None:
    """A model of 3 trainable elements on 5 members (some shards are empty). Step 6's
    parameter allgather fails everywhere (nobody commits it, everyone rolls back to step 5 and
    re-shards); the 0-d optimizer state (Adam's step count) of the rebuilt empty shards must be
    step 5's, so that every member's checkpoint of step 8 is the same, with Adam's step 8."""
    total = 8
    hub = make_hub(start_with=5)

    def stall_all(r: Round) -> dict[str, BaseException]:
        return {m: PeerLostError("stall") for m in r.members}

    hub.inject = _nth("allgather", 6, stall_all)
    members = {n: Member(n) for n in "abcde"}
    for n, m in members.items():
        start_member(
            hub,
            m,
            opt="adam",
            total=total,
            tiny=True,
            checkpoint_dir=tmp_path / n,
            checkpoint_every=4,
        )
    wait_all(hub, 45)
    everyone = list(members)
    _check_converged(members, everyone, total)
    assert any(r.attempts > 1 for r in members["a"].reports), "the rollback did not happen"
    held: dict[str, set[str]] = defaultdict(set)
    for n in everyone:
        for rng, digest in _trainer(members[n]).shard_digests().items():
            held[rng].add(digest)
    assert "0:0" in held, f"no empty shard: {sorted(held)}"
    assert all(len(ds) == 1 for ds in held.values()), "replicas of a shard differ"
    steps: dict[str, float] = {}
    digests: dict[str, str] = {}
    for n in everyone:
        found = latest_valid_checkpoint(tmp_path / n)
        assert found is not None and found.snapshot.step == total, n
        digests[n] = found.snapshot.digest
        model = make_model(tiny=True)
        state = State(model=model, optimizer=make_optimizer("adam", model), rng=False)
        state.load_snapshot(found.snapshot)
        steps[n] = float(state.scalars["zero"]["step"])
    assert steps == dict.fromkeys(everyone, float(total)), f"Adam's step in checkpoints: {steps}"
    assert len(set(digests.values())) == 1, "members wrote different checkpoints"
    _check_reference(members, "a", "adam", total, tiny=True)


def _adjacent_deaths(hub: Hub) -> None:
    """b and c (ring neighbours: b's shard is held by b and c only) die together during step
    5's parameter allgather, which nobody completes."""

    def kill_b_c(r: Round) -> dict[str, BaseException]:
        hub.kill("b")
        hub.kill("c")
        return {m: PeerLostError("b and c died") for m in r.members}

    hub.inject = _nth("allgather", 5, kill_b_c)


def test_two_adjacent_deaths_lose_state(make_hub: Callable[..., Hub]) -> None:
    """More adjacent losses than replicas (2): every survivor reports the state lost."""
    hub = make_hub(start_with=5, view_change_delay=0.2)
    _adjacent_deaths(hub)
    members = run_members(hub, "abcde", opt="adam", total=10)
    assert members["b"].status == members["c"].status == "killed"
    for n in "ade":
        m = members[n]
        assert m.status == "error" and isinstance(m.error, StateLostError), f"{n}: {m.error!r}"
        assert "no surviving member holds elements" in str(m.error), str(m.error)


def test_two_adjacent_deaths_fall_back_to_checkpoints(
    make_hub: Callable[..., Hub], tmp_path: Path
) -> None:
    """As above with checkpoints every 4 steps: every survivor resumes from step 4, and they
    converge on single-process training's result."""
    total = 10
    hub = make_hub(start_with=5, view_change_delay=0.2)
    _adjacent_deaths(hub)
    members = {n: Member(n) for n in "abcde"}
    for n, m in members.items():
        start_member(
            hub, m, opt="adam", total=total, checkpoint_dir=tmp_path / n, checkpoint_every=4
        )
    wait_all(hub, 45)
    survivors = list("ade")
    _check_converged(members, survivors, total, fallbacks=1)
    _check_replicas(members, survivors, replicas=2)
    _check_reference(members, "a", "adam", total)


# ------------------------------------------------------------------------- mismatched settings

SETTINGS: dict[str, tuple[dict[str, Any], dict[str, Any], list[str]]] = {
    "replicas": ({"replicas": 2}, {"replicas": 3}, ["replicas: 2 on a; 3 on b"]),
    "shard_optimizer": ({"shard": True}, {"shard": False}, ["shard_optimizer: True on a"]),
    "checkpoint_every": (
        {"checkpoint_every": 2},
        {"checkpoint_every": 3},
        ["checkpoint_every: 2 on a; 3 on b"],
    ),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_members_with_different_settings_all_get_a_config_error(
    make_hub: Callable[..., Hub], tmp_path: Path, setting: str
) -> None:
    """a and b differ in one setting: at their first sync both raise ``ConfigError`` naming
    it and its values, at once (not after retrying until the step deadline), having
    trained nothing."""
    a, b, expected = SETTINGS[setting]
    hub = make_hub(start_with=2)
    members = {n: Member(n) for n in "ab"}
    started = time.monotonic()
    for name, kwargs in (("a", a), ("b", b)):
        start_member(
            hub, members[name], opt="adam", total=6, checkpoint_dir=tmp_path / name, **kwargs
        )
    wait_all(hub, 25)
    elapsed = time.monotonic() - started
    for m in members.values():
        assert isinstance(m.error, ConfigError), f"{m.name}: {m.status} {m.error!r}"
        for text in [setting, *expected]:
            assert text in str(m.error), str(m.error)
        assert m.reports == [], f"{m.name} trained {len(m.reports)} steps"
    assert elapsed < 10, f"the members took {elapsed:.1f}s to give up"
    collectives = [r.kind for r in hub.history]
    assert collectives == ["allreduce"], f"more than the sync allreduce ran: {collectives}"


def test_a_joiner_with_other_replicas_gets_a_config_error_and_the_mesh_goes_on(
    make_hub: Callable[..., Hub],
) -> None:
    """a and b train with replicas=2; c joins after step 2 with replicas=3. a and b hold the
    mesh's newest state, so theirs are the mesh's settings: c raises ``ConfigError`` (and
    leaves), a and b wait for it to leave and finish training."""
    hub = make_hub(start_with=2)
    joined, on_step = _after_step(2)

    members = {n: Member(n) for n in "abc"}
    for n in "ab":
        start_member(hub, members[n], opt="adam", total=20, on_step=on_step)
    start_member(hub, members["c"], opt="adam", total=20, replicas=3, start_after=joined)
    wait_all(hub, 45)
    c = members["c"]
    assert isinstance(c.error, ConfigError), f"c: {c.status} {c.error!r}"
    assert "replicas: 2 on a, b; 3 on c" in str(c.error), str(c.error)
    assert "restart it with theirs" in str(c.error), str(c.error)
    assert c.reports == []
    _check_converged(members, ["a", "b"], 20)
    waited = [r for r in members["a"].reports if r.attempts > 1]
    assert waited, "a never had to retry a step while c was in the view"


def test_replicated_members_may_checkpoint_at_different_periods(
    make_hub: Callable[..., Hub], tmp_path: Path
) -> None:
    """Without sharding each member writes its own checkpoints: the periods (and replicas,
    unused) need not agree."""
    total = 4
    hub = make_hub(start_with=2)
    members = {n: Member(n) for n in "ab"}
    for n, every, replicas in (("a", 2, 2), ("b", 3, 3)):
        start_member(
            hub,
            members[n],
            opt="adam",
            total=total,
            shard=False,
            replicas=replicas,
            checkpoint_dir=tmp_path / n,
            checkpoint_every=every,
        )
    wait_all(hub, 25)
    _check_converged(members, ["a", "b"], total)


def test_the_trainer_refuses_a_factored_optimizer_when_sharded(
    make_hub: Callable[..., Hub],
) -> None:
    """torch's Adafactor keeps factored (row and column) moments per matrix: refused when
    the trainer is built with shard_optimizer=True, accepted without."""
    hub = make_hub()
    model = make_model()
    for shard in (False, True):
        mesh = cast(SyncMesh, FakeMesh(hub, f"m{shard}"))
        optimizer = torch.optim.Adafactor(model.parameters())
        make = partial(ElasticTrainer, mesh, model, optimizer, make_sampler())
        if shard:
            with pytest.raises(LocalUsageError, match=r"torch\.optim\.Adafactor"):
                make(shard_optimizer=True)
        else:
            make(shard_optimizer=False)
