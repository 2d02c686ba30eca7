"""Issue #26: one member's numbers in the step header can no longer crash, stall, split or
poison the mesh (``DESIGN-NOTES``: the step header: what an insider can and cannot do).

Pure parts (the row checks, the step machine's verdict, the straggler sync slots) with
Hypothesis; insiders patched in their own thread of the in-process fake mesh
(``trainer_sim``); non-finite gradients from one member, skipped alike by everyone.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from trainer_sim import (
    DATA_X,
    DATA_Y,
    Hub,
    all_ok,
    make_model,
    make_optimizer,
    make_sampler,
    max_diff,
    start_loop,
    trainer_of,
    wait_all,
)

from ftmesh.collective.view import Peer, RingView
from ftmesh.torch import ElasticTrainer, Step
from ftmesh.training.actions import Compute, Failed, Failure
from ftmesh.training.config import TrainerConfig
from ftmesh.training.protocol import (
    HEADER_SLOTS,
    MAX_SPEED,
    SPEED_SLOTS,
    RowFault,
    check_value,
    header_size,
    leavers,
    round_tag,
)
from ftmesh.training.step import NONFINITE_LIMIT, StepMachine, StepVerdict
from ftmesh.training.stragglers import (
    MAX_MILLI_SPEED,
    SYNC_FIELDS,
    StragglerRule,
    Stragglers,
    milli_speed,
)

BATCH = 12
PARTS = 2
CHECKS = [check_value("ab" * 32), check_value("cd" * 32)]


def _view(*names: str) -> RingView:
    return RingView.of(Peer(n, "127.0.0.1", 1000 + i) for i, n in enumerate(names))


def _machine(me: str = "a", **config: Any) -> StepMachine:
    m = StepMachine(TrainerConfig(**config), me, lambda i: BATCH)
    m.parts = PARTS
    return m


def _compute(view: RingView, index: int = 0, check: bool = False) -> Compute:
    return Compute(view, index, view.node_ids, None, check, 1)


def _honest_rows(m: StepMachine, action: Compute, check: bool) -> np.ndarray:
    """Every member's row as honest members write it (equal shares, measured speeds)."""
    view = action.view
    shares = [BATCH // view.size] * view.size
    rows = []
    for r in range(view.size):
        h = np.zeros(header_size(PARTS, speeds=True), dtype=np.float32)
        h[0] = shares[r]
        h[1] = 0.5
        h[2] = round_tag(action.index)
        if check:
            h[HEADER_SLOTS : HEADER_SLOTS + PARTS] = CHECKS
        h[HEADER_SLOTS + PARTS + r] = 100.0 + r
        h[-1] = m.pace.split_tag(action)
        rows.append(m.row(h, False))
    return np.array(rows)


def _verdict(m: StepMachine, action: Compute, rows: np.ndarray, check: bool) -> StepVerdict:
    header = rows[:, :-1].astype(np.float32).sum(axis=0, dtype=np.float32).tolist()
    return m.check_step(action, header, rows, CHECKS if check else None)


# -- the row checks ---------------------------------------------------------------------------


def test_honest_rows_pass_and_give_each_members_own_speed() -> None:
    m, view = _machine(), _view("a", "b", "c")
    action = _compute(view)
    v = _verdict(m, action, _honest_rows(m, action, False), False)
    assert v == StepVerdict(speeds=(100.0, 101.0, 102.0))


@pytest.mark.parametrize(
    ("slot", "value", "fault"),
    [
        (0, 1e30, RowFault.SAMPLES),
        (0, -1.0, RowFault.SAMPLES),
        (2, math.nan, RowFault.NOT_FINITE),
        (2, 7.0, RowFault.ROUND),
        (HEADER_SLOTS - 1, 4.0, RowFault.LEAVE),
        (HEADER_SLOTS, 1.0, RowFault.CHECKS),
        (-2, 3.0, RowFault.SPLIT),
        (-1, 0.5, RowFault.FLAG),
        (-1, 16.0, RowFault.FLAG),
        (-1, -2.0, RowFault.FLAG),
    ],
)
def test_a_bad_slot_in_one_row_fails_the_attempt_naming_its_member(
    slot: int, value: float, fault: RowFault
) -> None:
    m, view = _machine(), _view("a", "b", "c")
    action = _compute(view)
    rows = _honest_rows(m, action, False)
    rows[2, slot] = np.float32(value)  # "c", patched in its own process
    v = _verdict(m, action, rows, False)
    assert v.failed is not None and v.failed.kind is Failure.HEADER
    assert "c: " + fault.value in v.failed.detail
    assert {o.rank for o in v.offences} == {2}


@pytest.mark.parametrize("speed", [3e38, math.inf, -1.0, 0.0, MAX_SPEED * 2])
def test_a_member_lying_about_its_speed_is_named_and_not_believed(speed: float) -> None:
    """Item 1 and 4: a huge (or zero, while computing) speed is the member's own offence;
    the step goes on with its speed unmeasured."""
    m, view = _machine(), _view("a", "b", "c")
    action = _compute(view)
    rows = _honest_rows(m, action, False)
    rows[1, HEADER_SLOTS + PARTS + 1] = np.float32(speed)
    v = _verdict(m, action, rows, False)
    if not math.isfinite(speed):
        assert v.failed is not None and v.failed.kind is Failure.HEADER
        return
    assert v.failed is None
    assert v.speeds == (100.0, 0.0, 102.0)
    assert [(o.rank, o.fault) for o in v.offences] == [(1, RowFault.SPEED)]


def test_claims_about_other_members_are_the_claimants_offence() -> None:
    """Item 4: an insider writing into the honest members' speed slots changes nothing of
    theirs (each speed is read from its own member's row) and is named."""
    m, view = _machine(), _view("a", "b", "c")
    action = _compute(view)
    rows = _honest_rows(m, action, False)
    rows[2, HEADER_SLOTS + PARTS + 0] = np.float32(-99.999)  # "a is very slow", says c
    rows[2, HEADER_SLOTS + PARTS + 1] = np.float32(-100.999)
    v = _verdict(m, action, rows, False)
    assert v.failed is None
    assert v.speeds == (100.0, 101.0, 0.0)
    assert [(o.rank, o.fault) for o in v.offences] == [(2, RowFault.OTHERS_SLOT)]


def test_a_header_that_is_not_the_sum_of_the_rows_is_a_typed_failure() -> None:
    """A member that reports a row other than what it added: nobody can say who, but the
    attempt fails with a typed reason (never acted on)."""
    m, view = _machine(), _view("a", "b", "c")
    action = _compute(view)
    rows = _honest_rows(m, action, False)
    header = rows[:, :-1].sum(axis=0).tolist()
    header[2] += 1.0
    v = m.check_step(action, header, rows, None)
    assert v.failed is not None and v.failed.kind is Failure.HEADER
    assert [o.fault for o in v.offences] == [RowFault.MISMATCH]
    assert all(o.rank == -1 for o in v.offences)


def test_a_false_check_value_is_told_apart_from_divergence() -> None:
    """Item 3: one member's check values differ from a strict majority's: the majority fails
    the attempt naming it (no StateDivergedError for everyone); that member, alone, is told
    it diverged."""
    view = _view("a", "b", "c")
    action = _compute(view, index=3, check=True)
    rows = _honest_rows(_machine(), action, True)
    rows[1, HEADER_SLOTS] += 1  # "b" adds 1 to a check slot
    for me in "ac":
        v = _verdict(_machine(me), action, rows, True)
        assert v.failed is not None and v.failed.kind is Failure.HEADER, me
        assert [(o.rank, o.fault) for o in v.offences] == [(1, RowFault.CHECKS)]
        assert not v.diverged
    b = _machine("b")
    mine = [CHECKS[0] + 1, CHECKS[1]]
    header = rows[:, :-1].sum(axis=0).tolist()
    v = b.check_step(action, header, rows, mine)
    assert v.diverged == (0,) and v.rows[1] == tuple(mine)


def test_two_members_disagreeing_with_no_majority_both_stop() -> None:
    view = _view("a", "b")
    action = _compute(view, index=3, check=True)
    rows = _honest_rows(_machine(), action, True)
    rows[1, HEADER_SLOTS] += 1
    v = _verdict(_machine("a"), action, rows, True)
    assert v.diverged == (0,) and v.failed is None


def test_leave_bits_with_non_finite_values_are_not_a_valid_sum() -> None:
    for bad in (math.nan, math.inf, -math.inf, 1e30, -1.0):
        assert leavers(np.array([bad] + [0.0] * 10), 4) is None


# -- property: arbitrary numbers only ever give the machine's typed verdicts -------------------

_any_float = st.floats(allow_nan=True, allow_infinity=True, width=32) | st.sampled_from(
    [0.0, 1.0, 3e38, -3e38, 2.0**24, 1e9]
)


@settings(max_examples=300, deadline=None)
@given(
    size=st.integers(1, 4),
    index=st.integers(0, 1 << 20),
    check=st.booleans(),
    cells=st.lists(_any_float, min_size=1, max_size=4 * 300),
    header_noise=st.lists(_any_float, min_size=0, max_size=300),
    finite=st.booleans(),
)
def test_any_numbers_give_a_typed_verdict(
    size: int,
    index: int,
    check: bool,
    cells: list[float],
    header_noise: list[float],
    finite: bool,
) -> None:
    names = "abcd"[:size]
    view = _view(*names)
    m = _machine("a")
    action = _compute(view, index=index, check=check)
    width = header_size(PARTS, speeds=True) + 1
    rows = _honest_rows(m, action, check)
    flat = rows.reshape(-1)
    for i, x in enumerate(cells):  # overwrite a prefix, cyclically, with arbitrary values
        flat[(i * 7919) % len(flat)] = x
    header = rows[:, :-1].sum(axis=0).tolist()
    for i, x in enumerate(header_noise):
        header[(i * 31) % len(header)] = x
    v = m.check_step(
        action, header, rows.reshape(size, width), CHECKS if check else None, reduced_finite=finite
    )
    assert isinstance(v, StepVerdict)
    assert v.failed is None or isinstance(v.failed, Failed)
    assert all(math.isfinite(s) and 0 <= s <= MAX_SPEED for s in v.speeds)
    if v.failed is None and not v.diverged and v.speeds:
        # what the straggler rule and the next split then do with them must not raise
        m.stragglers.observe(index, names, list(v.speeds), BATCH)
        m.stragglers.sync_slots(names)


@settings(max_examples=100, deadline=None)
@given(shape=st.sampled_from([(0,), (3,), (2, 2), (5, 30)]))
def test_rows_of_the_wrong_shape_are_a_typed_failure(shape: tuple[int, ...]) -> None:
    m, view = _machine(), _view("a", "b", "c")
    v = m.check_step(_compute(view), [0.0] * 10, np.zeros(shape), None)
    assert v.failed is not None and v.failed.kind is Failure.HEADER


@settings(max_examples=200, deadline=None)
@given(
    speeds=st.lists(_any_float, min_size=2, max_size=2),
    claims=st.lists(
        st.integers(-(2**63), 2**63 - 1), min_size=2 * SYNC_FIELDS, max_size=2 * SYNC_FIELDS
    ),
)
def test_agreed_speeds_never_overflow_the_sync_slots(
    speeds: list[float], claims: list[int]
) -> None:
    """Item 1: ``round(speed * 1000)`` into an int64 slot raised ``OverflowError`` on every
    member for a speed of 3e38."""
    s = Stragglers(StragglerRule(), False, 0.1)
    s.known = {"a": speeds[0], "b": speeds[1]}
    slots = s.sync_slots(["a", "b"])
    assert slots.dtype == np.int64 and int(slots.max()) <= MAX_MILLI_SPEED
    s.adopt(np.array(claims, dtype=np.int64), ["a", "b"], 5)
    assert all(0 < v <= MAX_SPEED for v in s.known.values())
    s.sync_slots(["a", "b"])
    assert milli_speed(math.nan) == -1 and milli_speed(3e38) == MAX_MILLI_SPEED


# -- insiders patched in their own thread of the fake mesh ----------------------------------------


SPEED = 100.0
"""Every member's measured speed in the insider runs (threads on a loaded host measure
noise; the straggler rule must only see the insider's claims)."""


def _insider(kind: str, attempts: int = 10**9) -> Any:
    """A ``setup`` for the loop members: each reports ``SPEED``; member "c" patches its own
    header's speed part (what it adds and what it says it added), ``attempts`` times."""
    left = [attempts]

    def setup(t: ElasticTrainer) -> None:
        machine = t._machine
        honest = machine.speed_slots
        me = t.mesh.node_id

        def lying(action: Compute, share: int, seconds: float) -> np.ndarray:
            slots = honest(action, share, seconds)
            rank = action.view.rank_of(me)
            if me in action.workers:
                slots[rank] = SPEED
            if me != "c" or left[0] <= 0:
                return slots
            left[0] -= 1
            if kind == "huge":
                slots[rank] = 3e38
            elif kind == "others":  # everyone else is very slow, says c (before: evicted)
                slots[: action.view.size] = -SPEED + 1e-3
                slots[rank] = 1e6
            elif kind == "nan":
                slots[-1] = math.nan
            return slots

        machine.speed_slots = lying  # type: ignore[method-assign]

    return setup


@pytest.mark.parametrize("kind", ["huge", "others"])
def test_an_insiders_speed_claims_crash_and_evict_nobody(kind: str) -> None:
    """Items 1 and 4 in the fake mesh: every member finishes, no honest member sits out as a
    straggler, the insider is the only member reported."""
    hub = Hub(start_with=3)
    try:
        members = start_loop(
            hub, "abc", total=12, setup=_insider(kind), straggler_steps=2, readmit_steps=3
        )
        wait_all(hub, 60)
        all_ok(members, "abc")
        for n in "abc":
            reports = members[n].reports
            assert [r.step for r in reports] == list(range(1, 13))
            for r in reports:
                assert set(r.computing) >= {"a", "b"}, (n, r)
        assert hub.offences and {accused for _, accused, _ in hub.offences} == {"c"}
        assert {reporter for reporter, _, _ in hub.offences} == {"a", "b"}
    finally:
        hub.shutdown()


def test_a_nan_in_the_header_fails_attempts_names_the_insider_and_never_crashes() -> None:
    """Items 1 and 3: a NaN in the header used to fail every attempt, silently, until
    ``step_timeout``. Now each such attempt fails with a typed reason naming the insider
    (the accusation path then leaves it out; the fake mesh has none, so the insider here
    stops after 3 attempts) and the run goes on."""
    hub = Hub(start_with=3)
    try:
        members = start_loop(hub, "abc", total=6, setup=_insider("nan", attempts=3))
        wait_all(hub, 60)
        all_ok(members, "abc")
        accused = [(r, a) for r, a, _ in hub.offences]
        assert set(accused) == {("a", "c"), ("b", "c")}
        assert len(accused) == 6  # each honest member, once per failed attempt
        for n in "abc":
            assert trainer_of(members[n]).committed == 6
    finally:
        hub.shutdown()


# -- non-finite gradients ---------------------------------------------------------------------

NAN_STEPS = (2, 3, 4)  # (0-based) steps whose gradients are NaN on member "b"
TOTAL = 10


def _nan_body(t: ElasticTrainer, step: Step) -> None:
    poisoned = t.mesh.node_id == "b" and step.index in NAN_STEPS
    for idx in step.indices():
        i = torch.as_tensor(idx)
        loss = F.cross_entropy(t.model(DATA_X[i]), DATA_Y[i])
        if poisoned:
            loss = loss * math.nan
        loss.backward()  # type: ignore[no-untyped-call]
    t.optimizer.step()


def _skipping_reference() -> dict[str, torch.Tensor]:
    """Single-process training that skips the update of ``NAN_STEPS``."""
    model = make_model()
    optimizer = make_optimizer("sgd", model)
    sampler = make_sampler()
    for step in range(TOTAL):
        if step in NAN_STEPS:
            continue
        i = torch.as_tensor(sampler.global_indices(step))
        optimizer.zero_grad()
        F.cross_entropy(model(DATA_X[i]), DATA_Y[i]).backward()  # type: ignore[no-untyped-call]
        optimizer.step()
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("shard", [False, True], ids=["replicated", "sharded"])
def test_nan_gradients_from_one_member_are_skipped_alike_and_named(
    caplog: pytest.LogCaptureFixture, shard: bool
) -> None:
    """Item 4: b's gradients are NaN in 3 steps: every member skips those updates alike
    (the models equal single-process training that skips them), they stay finite, every
    member counts 3 non-finite steps, b is named in a WARNING, and b is not reported as an
    insider (fewer than ``NONFINITE_LIMIT`` in a row)."""
    assert len(NAN_STEPS) < NONFINITE_LIMIT
    hub = Hub(start_with=3)
    caplog.set_level("WARNING", logger="ftmesh.training")
    try:
        members = start_loop(hub, "abc", total=TOTAL, body=_nan_body, shard_optimizer=shard)
        wait_all(hub, 60)
        all_ok(members, "abc")
        want = _skipping_reference()
        for n in "abc":
            t = trainer_of(members[n])
            model = t.model.state_dict()
            assert all(bool(torch.isfinite(v).all()) for v in model.values()), n
            assert max_diff(model, want) < 1e-5, n
            assert t.statistics().nonfinite_steps_total == len(NAN_STEPS), n
        assert hub.offences == []
        named = [r.getMessage() for r in caplog.records if "non-finite gradients" in r.message]
        assert named and all("from b" in text for text in named)
    finally:
        hub.shutdown()


def test_a_member_with_non_finite_gradients_for_long_is_reported() -> None:
    """After ``NONFINITE_LIMIT`` steps in a row, each further one is b's offence."""

    def body(t: ElasticTrainer, step: Step) -> None:
        for idx in step.indices():
            i = torch.as_tensor(idx)
            loss = F.cross_entropy(t.model(DATA_X[i]), DATA_Y[i])
            if t.mesh.node_id == "b":
                loss = loss * math.inf
            loss.backward()  # type: ignore[no-untyped-call]
        t.optimizer.step()

    hub = Hub(start_with=2)
    try:
        members = start_loop(hub, "ab", total=NONFINITE_LIMIT + 2, body=body)
        wait_all(hub, 60)
        all_ok(members, "ab")
        assert [(r, a) for r, a, _ in hub.offences] == [("a", "b")] * 3
        for n in "ab":
            assert trainer_of(members[n]).statistics().nonfinite_steps_total == NONFINITE_LIMIT + 2
    finally:
        hub.shutdown()


def test_speed_slots_constant_is_the_header_tail() -> None:
    assert header_size(PARTS, speeds=True) - header_size(PARTS) == SPEED_SLOTS


# -- a run that lost its state says so (item 5) ------------------------------------------------


def _drive_alone(m: StepMachine, view: RingView) -> Any:
    """Drive ``m`` alone on ``view`` until it computes or the run ends."""
    from ftmesh.training.actions import (
        Done,
        Members,
        Reduced,
        Sync,
        ViewSeen,
        WaitView,
        WaitViewChange,
    )

    a = m.begin(0.0)
    for _ in range(50):
        if isinstance(a, Sync):
            a = m.feed(0.0, Reduced(m.sync_vector(view, 100, "ab" * 32)))
        elif isinstance(a, WaitView | WaitViewChange):
            a = m.feed(0.0, ViewSeen(view))
        elif type(a).__name__ == "ReadMembers":
            a = m.feed(0.0, Members(()))
        elif type(a).__name__ in ("Compute", "Raise", "Finished"):
            return a
        else:
            a = m.feed(0.0, Done())
    raise AssertionError(f"no end: {a}")


def test_a_fresh_member_that_finds_the_runs_state_gone_fails_loudly() -> None:
    """A joiner that saw members publish 146 committed steps, then finds itself alone with
    nobody holding that state (and no checkpoint: it would have resumed it), raises a
    StateLostError naming step 146 instead of restarting the run from step 1."""
    from ftmesh.state.errors import StateLostError
    from ftmesh.training.actions import Raise

    cfg = {"join_settle": 0.0, "quorum": "any", "straggler_factor": 0}
    m = StepMachine(TrainerConfig.of(**cfg), "a", lambda i: BATCH)
    m.seen_step = 146
    a = _drive_alone(m, _view("a"))
    assert isinstance(a, Raise) and isinstance(a.error, StateLostError), a
    assert "146" in str(a.error) and m.committed == -1
    fresh = StepMachine(TrainerConfig.of(**cfg), "a", lambda i: BATCH)
    assert type(_drive_alone(fresh, _view("a"))).__name__ == "Compute"  # a new mesh starts
