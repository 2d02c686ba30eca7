"""An in-process fake mesh for driving several ``ElasticTrainer`` instances in threads, and
helpers for failure scenarios (``test_training_sharded_sim.py``).

``Hub`` plays the mesh: the view is the sorted ids of the live members whose role is ``train``;
collectives run in lockstep rounds, one per view epoch, completing when every member of the
view has contributed. A round fails for all its members when a member dies, when their
contributions disagree (kind, operation, shape, dtype), when a member moves on to another view
or waits on another view, or when it stalls past ``timeout``. ``Hub.inject`` sees every round
as it completes and may fail it for some members only (partial completion: some commit a step,
others do not) and kill members; ``Hub.fetch_fail`` makes state fetches fail. ``Hub.history``
records every round.

Each member runs in a daemon thread (``run_members``); a killed member's thread ends with
``Killed`` at its next call into the mesh, and ``Hub.shutdown`` kills everyone, so that no
thread outlives its test.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F

from ftmesh.collective.ops import CollectiveOp, Kind
from ftmesh.collective.view import Peer, RingView
from ftmesh.errors import CollectiveError, DeadlineExceeded, Departed, PeerLostError
from ftmesh.membership.messages import MemberState
from ftmesh.mesh.blocking import SyncMesh
from ftmesh.mesh.meta import DATA_KEY, ROLE_KEY
from ftmesh.state import Snapshot
from ftmesh.state.errors import StateTransferError
from ftmesh.torch import Step
from ftmesh.torch.sampler import ElasticSampler
from ftmesh.torch.trainer import ElasticTrainer, StepReport
from ftmesh.training.start import StartConfig


class Killed(BaseException):
    """Raised in a member's thread when the hub killed it (not an ``Exception``: the trainer
    must not catch it)."""


@dataclass(frozen=True)
class RoundRecord:
    """A finished collective round: who took part, and who got an error instead of the
    result (everyone, when the round failed as a whole)."""

    kind: str
    dtype: str
    members: tuple[str, ...]
    failed: frozenset[str]
    size: int = 0
    """Elements of one member's contribution."""


@dataclass
class Round:
    epoch: str
    members: tuple[str, ...]
    contrib: dict[str, tuple[str, str, np.ndarray]] = field(default_factory=dict)
    """member -> (kind, op, data)."""
    result: dict[str, np.ndarray] = field(default_factory=dict)
    error: dict[str, BaseException] = field(default_factory=dict)
    done: bool = False

    @property
    def kind(self) -> str:
        return next(iter(self.contrib.values()))[0]

    @property
    def dtype(self) -> str:
        return str(next(iter(self.contrib.values()))[2].dtype)

    @property
    def size(self) -> int:
        return int(next(iter(self.contrib.values()))[2].size)


Inject = Callable[[Round], dict[str, BaseException]]


class Hub:
    """The shared fake mesh; see the module docstring. ``start_with``: no view exists until
    that many members train at once (so that the first step runs on the whole initial ring,
    deterministically). ``view_change_delay``: how long ``wait_view_change`` takes (how far
    membership lags behind a failure). ``fetch_delay``: how long a state fetch takes before it
    contacts the holders."""

    def __init__(
        self,
        *,
        timeout: float = 2.0,
        start_with: int = 1,
        view_change_delay: float = 0.02,
        fetch_delay: float = 0.0,
    ) -> None:
        self.cv = threading.Condition()  # an RLock: ``inject`` may call ``kill``
        self.timeout = timeout
        self.start_with = start_with
        self.view_change_delay = view_change_delay
        self.fetch_delay = fetch_delay
        self.alive: set[str] = set()
        self.left: set[str] = set()
        """Members that left gracefully (``FakeMesh.close``): ``LEFT`` in ``members()``."""
        self.roles: dict[str, str] = {}
        self.servers: dict[str, Callable[[int, str], Snapshot | None]] = {}
        self.state_bytes: dict[str, int] = {}
        self.fetched_into_buffer: list[str] = []
        """Members whose fetch landed in the buffer they prepared while joining."""
        self.rounds: dict[str, Round] = {}
        self.history: list[RoundRecord] = []
        self.inject: Inject | None = None
        self.fetch_fail: Callable[[str, bool], bool] | None = None
        """``(member, is_piece) -> fail?``, asked for each fetch that would succeed."""
        self.threads: list[threading.Thread] = []
        self.offences: list[tuple[str, str, str]] = []
        """``(reporter, accused, detail)`` of every ``report_offence`` (the step header)."""
        self.closed = False
        self._started = False

    # -- membership ------------------------------------------------------------------------
    def add(self, node: str) -> None:
        with self.cv:
            if self.closed:
                raise Killed()
            self.alive.add(node)

    def kill(self, node: str) -> None:
        """``node`` dies (or leaves): rounds it belongs to fail, its thread ends."""
        with self.cv:
            self.alive.discard(node)
            for r in list(self.rounds.values()):
                if node in r.members and not r.done:
                    self._fail(r, PeerLostError(f"{node} died"))
            self.cv.notify_all()

    def leave(self, node: str) -> None:
        """``node`` leaves gracefully: like ``kill``, but membership shows it ``LEFT``."""
        with self.cv:
            if node in self.alive:
                self.left.add(node)
            self.kill(node)

    def failed_rounds(self) -> list[RoundRecord]:
        """Rounds that failed for any member."""
        return [r for r in self.history if r.failed]

    def shutdown(self, join_timeout: float = 10.0) -> None:
        """Kill every member and join the member threads."""
        self.closed = True
        for node in list(self.alive):
            self.kill(node)
        for t in self.threads:
            t.join(join_timeout)

    def view(self) -> RingView | None:
        with self.cv:
            ids = sorted(m for m in self.alive if self.roles.get(m) == "train")
            if len(ids) >= self.start_with:
                self._started = True
            if not ids or not self._started:
                return None
        return RingView.of(Peer(i, "127.0.0.1", 1) for i in ids)

    # -- collectives -----------------------------------------------------------------------
    def collective(self, me: str, view: RingView, kind: str, x: np.ndarray, op: str) -> np.ndarray:
        with self.cv:
            if me not in self.alive:
                raise Killed()
            # Moving on to another view abandons the rounds of the old one.
            for r in list(self.rounds.values()):
                if r.epoch != view.epoch and me in r.members and me not in r.contrib:
                    self._fail(r, CollectiveError(f"{me} left view {r.epoch}"))
            if any(m not in self.alive for m in view.node_ids):
                raise PeerLostError("a member of the view is dead")
            r = self.rounds.get(view.epoch) or Round(view.epoch, view.node_ids)
            self.rounds[view.epoch] = r
            r.contrib[me] = (kind, op, np.array(x, copy=True))
            if len(r.contrib) == len(r.members):
                self._complete(r)
            else:
                self._break_deadlocks()
            self.cv.notify_all()
            deadline = time.monotonic() + self.timeout
            while not r.done:
                if me not in self.alive:
                    raise Killed()
                left = deadline - time.monotonic()
                if left <= 0:
                    self._fail(r, PeerLostError("stall"))
                    self.cv.notify_all()
                    break
                self.cv.wait(left)
            if me not in self.alive:
                raise Killed()
            if me in r.error:
                raise r.error[me]
            return r.result[me]

    def _break_deadlocks(self) -> None:
        """Fail at once the rounds that can never complete: those whose missing members all
        wait in other such rounds (members that picked different views: each waits for the
        others on its own), as the real mesh fails collectives on mismatched views instead
        of waiting for the stall timeout."""
        where = {m: e for e, r in self.rounds.items() for m in r.contrib}

        def missing(r: Round) -> list[str]:
            return [m for m in r.members if m not in r.contrib]

        stuck = {e for e, r in self.rounds.items() if all(m in where for m in missing(r))}
        changed = True
        while changed:
            changed = False
            for e in list(stuck):
                if any(where[m] not in stuck for m in missing(self.rounds[e])):
                    stuck.discard(e)
                    changed = True
        for e in stuck:
            self._fail(self.rounds[e], CollectiveError("members wait on different views"))

    def _fail(self, r: Round, exc: BaseException) -> None:
        for m in r.members:
            r.error.setdefault(m, exc)
        r.done = True
        self.rounds.pop(r.epoch, None)
        if r.contrib:
            self.history.append(
                RoundRecord(r.kind, r.dtype, r.members, frozenset(r.members), r.size)
            )

    def _complete(self, r: Round) -> None:
        self.rounds.pop(r.epoch, None)
        r.done = True
        sigs = {(k, op, d.shape, str(d.dtype)) for k, op, d in r.contrib.values()}
        if len(sigs) != 1:
            for m in r.members:
                r.error[m] = CollectiveError(f"mismatched contributions {sigs}")
            self.history.append(
                RoundRecord(r.kind, r.dtype, r.members, frozenset(r.members), r.size)
            )
            return
        kind, op, _, _ = next(iter(sigs))
        xs = [r.contrib[m][2] for m in r.members]
        if kind == "allreduce" and op == "max":
            out = np.max(np.stack(xs), axis=0)
        elif kind == "allreduce":
            out = xs[0].copy()
            for y in xs[1:]:
                out = out + y  # one order for everybody: bitwise identical results
            out = out.astype(xs[0].dtype)
        elif kind == "allgather":
            out = np.stack(xs)
        else:
            raise AssertionError(f"unknown collective {kind}")
        errors = self.inject(r) if self.inject is not None else {}
        for m in r.members:
            if m in errors:
                r.error[m] = errors[m]
            else:
                r.result[m] = out
        self.history.append(RoundRecord(kind, r.dtype, r.members, frozenset(errors), r.size))


class FakeSession:
    """The part of ``ViewSession`` that ``ElasticTrainer`` uses, on the hub."""

    def __init__(self, mesh: FakeMesh, view: RingView) -> None:
        self.hub, self.node_id, self.view = mesh.hub, mesh.node_id, view

    def run(self, op: CollectiveOp, x: np.ndarray) -> Any:
        assert op.compression is None, "the fake mesh does not compress"
        if op.kind is Kind.BARRIER:
            self.hub.collective(self.node_id, self.view, "allgather", np.zeros(1), "")
            return SimpleNamespace(output=None)
        out = self.hub.collective(self.node_id, self.view, op.kind.value, x, op.op)
        if op.kind is Kind.ALLREDUCE:
            x[...] = out
            out = x
        return SimpleNamespace(output=out)

    def submit(self, op: CollectiveOp, x: np.ndarray) -> Future[Any]:
        fut: Future[Any] = Future()
        try:
            fut.set_result(self.run(op, x))
        except Exception as exc:  # a failed collective: the future carries it
            fut.set_exception(exc)
        return fut

    def allreduce(self, x: np.ndarray, op: str = "sum", compression: Any = None) -> Any:
        return self.run(CollectiveOp.allreduce(op, compression), x)

    def allgather(self, x: np.ndarray) -> Any:
        return self.run(CollectiveOp(kind=Kind.ALLGATHER), x)

    def barrier(self, io_timeout: float | None = None) -> Any:
        return self.run(CollectiveOp(kind=Kind.BARRIER, io_timeout=io_timeout), None)


class FakeMesh:
    """One member's handle on the hub: the part of ``SyncMesh`` that ``ElasticTrainer``
    uses."""

    start_config = StartConfig()
    gpu = None  # no GPU path: the buckets stay in host memory (SyncMesh.gpu)

    def __init__(self, hub: Hub, node_id: str) -> None:
        self.hub = hub
        self.node_id = node_id
        self.progress: Any = None  # the last report_progress
        self._leave = False
        hub.add(node_id)

    def request_leave(self) -> None:
        self._leave = True

    def leave_requested(self) -> bool:
        return self._leave

    def close(self, join_timeout: float = 10.0) -> None:
        self.hub.leave(self.node_id)

    def _check(self) -> None:
        if self.node_id not in self.hub.alive:
            raise Killed()

    def report_progress(self, progress: Any) -> None:
        self.progress = progress

    def report_offence(self, node: str, detail: str) -> None:
        with self.hub.cv:
            self.hub.offences.append((self.node_id, node, detail))

    def set_role(self, role: str) -> None:
        self._check()
        with self.hub.cv:
            self.hub.roles[self.node_id] = role
            self.hub.cv.notify_all()

    def serve_state(self, fn: Callable[[int, str], Snapshot | None]) -> tuple[str, int]:
        self.hub.servers[self.node_id] = fn
        return ("127.0.0.1", 1)

    def wait_quiet(self, settle: float, timeout: float = 60.0, until: Any = None) -> None:
        self._check()

    def view(self) -> RingView | None:
        return self.hub.view()

    def wait_view(
        self, min_members: int = 1, settle: float = 0.0, timeout: float = 60.0
    ) -> RingView:
        deadline = time.monotonic() + timeout
        while True:
            self._check()
            v = self.hub.view()
            if v is not None and v.size >= min_members and self.node_id in v.node_ids:
                return v
            if time.monotonic() > deadline:
                raise DeadlineExceeded(f"{self.node_id}: no view of {min_members} members")
            time.sleep(0.005)

    def wait_view_change(self, epoch: str, timeout: float) -> RingView | None:
        self._check()
        time.sleep(min(self.hub.view_change_delay, timeout))
        return self.hub.view()

    def exclusions(self) -> dict[str, Any]:
        return {}

    def members(self) -> list[Any]:
        with self.hub.cv:
            return [
                SimpleNamespace(
                    node=m,
                    name=m,
                    state=MemberState.ALIVE
                    if m in self.hub.alive
                    else MemberState.LEFT
                    if m in self.hub.left
                    else MemberState.DEAD,
                    meta={ROLE_KEY: role, DATA_KEY: "127.0.0.1:1"},  # (what read_member wants)
                )
                for m, role in self.hub.roles.items()
            ]

    def session(self, view: RingView) -> FakeSession:
        return FakeSession(self, view)

    def drop_view(self, view: RingView) -> None:
        pass

    def advertise_state(self, nbytes: int) -> None:
        self.hub.state_bytes[self.node_id] = nbytes

    def advertised_state_bytes(self) -> int:
        others = [n for m, n in self.hub.state_bytes.items() if m != self.node_id]
        return max(others, default=0)

    def fetch_state(
        self,
        holders: Sequence[str],
        step: int,
        digest: str,
        stats: Any = None,
        buffer: np.ndarray | None = None,
    ) -> Snapshot:
        self._check()
        if self.hub.fetch_delay:
            time.sleep(self.hub.fetch_delay)
            self._check()
        for h in holders:
            server = self.hub.servers.get(h)
            if h not in self.hub.alive or server is None:
                continue
            snap = server(step, digest)
            if snap is None or snap.step != step or snap.digest != digest:
                continue
            is_piece = "start" in snap.trees.get("scalars", {})  # see trainer._piece_snapshot
            fail = self.hub.fetch_fail
            if fail is not None and fail(self.node_id, is_piece):
                raise StateTransferError(f"injected failure fetching {digest[:8]}", {})
            if buffer is not None and buffer.nbytes >= snap.nbytes:  # as the real one does
                self.hub.fetched_into_buffer.append(self.node_id)
                buffer[: snap.nbytes] = np.frombuffer(snap.to_bytes(), dtype=np.uint8)
                return Snapshot.from_buffer(buffer[: snap.nbytes])
            return snap
        raise StateTransferError(f"nobody serves step {step} {digest[:8]}", {})


# -- the model, data and optimizers ---------------------------------------------------------

# torch's first optimizer imports torch._dynamo and sympy (5-30 s on a loaded 2-core host):
# pay it here, at import, not inside the scenarios' bounded waits (``wait_all``), where three
# member threads would wait for it together.
torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)

DATA_X = torch.randn(64, 6, generator=torch.Generator().manual_seed(5))
DATA_Y = torch.randint(0, 3, (64,), generator=torch.Generator().manual_seed(6))
GLOBAL_BATCH = 8


def make_model(tiny: bool = False) -> torch.nn.Module:
    """The same initial weights every call (53 elements; ``tiny``: 3 elements, fewer than the
    members of a 5-member ring, so some shards are empty)."""
    gen = torch.Generator().manual_seed(0)
    model: torch.nn.Module
    if tiny:
        model = torch.nn.Linear(6, 3)
        model.weight.requires_grad_(False)  # only the 3 biases train
    else:
        model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return model


def make_optimizer(kind: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if kind == "adam":
        return torch.optim.Adam(params, lr=0.01)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True)
    raise ValueError(kind)


def make_sampler() -> ElasticSampler:
    return ElasticSampler(len(DATA_X), GLOBAL_BATCH, seed=1)


def data_loss(model: torch.nn.Module, idx: np.ndarray) -> torch.Tensor:
    """The mean loss of ``model`` on the samples ``idx`` of the data."""
    i = torch.as_tensor(idx)
    return torch.nn.functional.cross_entropy(model(DATA_X[i]), DATA_Y[i])


def loss_fn_for(model: torch.nn.Module) -> Callable[[np.ndarray], torch.Tensor]:
    def loss_fn(idx: np.ndarray) -> torch.Tensor:
        return data_loss(model, idx)

    return loss_fn


def check_identical(digests: dict[int, dict[str, dict[str, str]]], steps: int) -> None:
    """``digests``: committed step -> member -> part -> digest. Every step 1..``steps`` was
    committed, and its committers hold the same registered state after it."""
    assert sorted(digests) == list(range(1, steps + 1)), sorted(digests)
    for step, by_member in digests.items():
        distinct = {tuple(sorted(d.items())) for d in by_member.values()}
        assert len(distinct) == 1, f"step {step}: members differ: {by_member}"


def reference(opt: str, steps: int, tiny: bool = False) -> dict[str, torch.Tensor]:
    """The model after ``steps`` steps of single-process training on the whole global
    batches: what the mesh must compute (up to summation order)."""
    model = make_model(tiny)
    optimizer = make_optimizer(opt, model)
    sampler = make_sampler()
    for step in range(steps):
        i = torch.as_tensor(sampler.global_indices(step))
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(DATA_X[i]), DATA_Y[i]).backward()  # type: ignore[no-untyped-call]
        optimizer.step()
    return {k: v.clone() for k, v in model.state_dict().items()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


# -- running members ---------------------------------------------------------------------------


@dataclass
class Member:
    """One member's run: its trainer, its step reports, how it ended."""

    name: str
    trainer: ElasticTrainer | None = None
    reports: list[StepReport] = field(default_factory=list)
    status: str = "running"
    """``ok`` (trained every step and finished), ``killed``, ``left`` (a planned departure:
    ``error`` is the ``Departed``), or ``error``."""
    error: BaseException | None = None
    mesh: FakeMesh | None = None


@contextlib.contextmanager
def member_thread(hub: Hub, member: Member, start_after: threading.Event | None) -> Iterator[None]:
    """The frame of a member's thread: wait for ``start_after``, run the body, record how it
    ended (``ok``, ``killed``, ``left``, ``error``) and leave the mesh."""
    try:
        if start_after is not None:
            while not start_after.wait(0.05):
                if hub.closed:
                    raise Killed()
        yield
        member.status = "ok"
    except Killed:
        member.status = "killed"
    except Departed as exc:
        member.status, member.error = "left", exc
    except BaseException as exc:
        member.status, member.error = "error", exc
    finally:
        hub.kill(member.name)


def run_member(
    hub: Hub,
    member: Member,
    *,
    opt: str,
    total: int,
    shard: bool = True,
    tiny: bool = False,
    replicas: int = 2,
    checkpoint_dir: Path | None = None,
    checkpoint_every: int = 0,
    start_after: threading.Event | None = None,
    on_step: Callable[[Member, StepReport], None] | None = None,
    trainer_kwargs: dict[str, Any] | None = None,
    before_steps: Callable[[Member], None] | None = None,
) -> None:
    """Train ``total`` steps, ``finish()`` and leave the mesh (the thread's body);
    ``trainer_kwargs`` go to ``ElasticTrainer`` on top of the defaults here, and
    ``before_steps`` runs once the trainer is built."""
    with member_thread(hub, member, start_after):
        member.mesh = mesh = FakeMesh(hub, member.name)
        model = make_model(tiny)
        settings: dict[str, Any] = {
            "quorum": "any",
            "join_settle": 0.0,
            "step_timeout": 30.0,
            "shard_optimizer": shard,
            "replicas": replicas,
            "min_peers": 1,
            "checkpoint_dir": checkpoint_dir,
            "checkpoint_every": checkpoint_every,
            **(trainer_kwargs or {}),
        }
        member.trainer = t = ElasticTrainer(
            cast(SyncMesh, mesh), model, make_optimizer(opt, model), make_sampler(), **settings
        )
        loss_fn = loss_fn_for(model)
        if before_steps is not None:
            before_steps(member)
        while t.committed < total:
            report = t.step(loss_fn)
            member.reports.append(report)
            if on_step is not None:
                on_step(member, report)
        t.finish(timeout=20.0)


def start_member(hub: Hub, member: Member, **kwargs: Any) -> None:
    t = threading.Thread(
        target=run_member, args=(hub, member), kwargs=kwargs, name=member.name, daemon=True
    )
    hub.threads.append(t)
    t.start()


def run_members(
    hub: Hub, names: Sequence[str], *, timeout: float = 45.0, **kwargs: Any
) -> dict[str, Member]:
    """Run members ``names`` (see ``run_member`` for ``kwargs``) until all have ended; on a
    hang, kill them all and fail."""
    members = {n: Member(n) for n in names}
    for m in members.values():
        start_member(hub, m, **kwargs)
    wait_all(hub, timeout)
    return members


@dataclass
class LossBeforeOneComputes:
    """The timing of a loss that catches one survivor inside step ``at``'s computation and the
    other before the step (the retry must not mix two splits): ``a_step`` (``a``'s hook at
    each inner batch) marks ``a`` inside the step, ``victim`` (``c``'s hook) waits for that
    before ``c`` dies, ``dead`` is set once it died, and ``hold_b`` (``b``'s hook after each
    committed step) holds ``b`` before step ``at`` until then."""

    at: int
    a_inside: threading.Event = field(default_factory=threading.Event)
    dead: threading.Event = field(default_factory=threading.Event)

    def a_step(self, index: int) -> None:
        if index == self.at:
            self.a_inside.set()

    def victim(self, index: int) -> None:
        if index == self.at:
            assert self.a_inside.wait(30), f"a never began step {self.at}"

    def hold_b(self, step: int) -> None:
        if step == self.at:
            assert self.dead.wait(30), "c did not die"


def wait_all(hub: Hub, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for t in list(hub.threads):
        t.join(max(deadline - time.monotonic(), 0.0))
    hung = [t.name for t in hub.threads if t.is_alive()]
    if hung:
        hub.shutdown()
        raise AssertionError(f"members {hung} did not end within {timeout}s")


# -- the loop API ----------------------------------------------------------------------------

Body = Callable[[ElasticTrainer, Step], None]


def sgd_body(t: ElasticTrainer, step: Step) -> None:
    for idx in step.indices():
        i = torch.as_tensor(idx)
        F.cross_entropy(t.model(DATA_X[i]), DATA_Y[i]).backward()  # type: ignore[no-untyped-call]
    t.optimizer.step()


def loader_body(t: ElasticTrainer, step: Step) -> None:
    for x, y in step.batches():
        F.cross_entropy(t.model(x), y).backward()  # type: ignore[no-untyped-call]
    t.optimizer.step()


def run_loop_member(
    hub: Hub,
    member: Member,
    *,
    total: int,
    body: Body = sgd_body,
    data: Callable[[], Any] = make_sampler,
    start_after: threading.Event | None = None,
    setup: Callable[[ElasticTrainer], None] | None = None,
    after_step: Callable[[Member, ElasticTrainer, Step], None] | None = None,
    read_report: bool = True,
    **settings: Any,
) -> None:
    """A member's thread (loop API): train ``total`` steps with the loop API, finish, leave
    (``read_report=False``: a loop that never looks at ``step.report``)."""
    with member_thread(hub, member, start_after):
        mesh = FakeMesh(hub, member.name)
        model = make_model()
        config = {"quorum": "any", "join_settle": 0.0, "step_timeout": 30.0, **settings}
        t = ElasticTrainer(
            cast(SyncMesh, mesh), model, make_optimizer("sgd", model), data(), **config
        )
        member.trainer = t
        try:
            if setup is not None:
                setup(t)
            for step in t.steps(total):
                with step:
                    body(t, step)
                if read_report and step.report is not None:
                    member.reports.append(step.report)
                if after_step is not None:
                    after_step(member, t, step)
            t.finish(timeout=20.0)
        finally:
            t.close()  # (a killed member's too: its threads and loader workers)


def start_loop(hub: Hub, names: str, **kwargs: Any) -> dict[str, Member]:
    members = {n: Member(n) for n in names}
    for m in members.values():
        t = threading.Thread(
            target=run_loop_member, args=(hub, m), kwargs=kwargs, daemon=True, name=m.name
        )
        hub.threads.append(t)
        t.start()
    return members


def trainer_of(m: Member) -> ElasticTrainer:
    assert m.trainer is not None, f"{m.name}: {m.status} {m.error!r}"
    return m.trainer


def all_ok(members: dict[str, Member], names: str) -> None:
    for n in names:
        assert members[n].status == "ok", f"{n}: {members[n].status} {members[n].error!r}"
