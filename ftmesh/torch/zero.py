"""ZeRO-1 sharded optimizer state with ring replicas, for ``ElasticTrainer(shard_optimizer=True)``.

Theory of operation. The model's parameters, taken in registration order, form one flat
float32 vector of ``length`` elements. Under the view's ``ShardLayout`` every member holds the
optimizer state of its own shard and of its ``replicas - 1`` left neighbours' shards, as one
torch optimizer of the user's class and hyper-parameters over one flat parameter per held
shard. A step: the gradients are allreduced as in replicated mode; each member copies the
reduced gradients of its held shards in and steps its optimizer (owner and replicas compute
bitwise the same update from the same inputs); one allgather of every owner's updated shard
gives everybody the whole updated model. The user's optimizer object is never stepped: it
keeps the hyper-parameters (change its learning rate as usual; every step copies them over).

This gives the unsharded optimizer's result only for an optimizer whose update is
*element-wise*: an element's new value and state depend on that element's parameter, gradient
and state alone, and on scalars (hyper-parameters, the step count). Per-tensor norms (LAMB,
LARS), factored moments (Adafactor) or anything that looks at a tensor's shape would silently
compute another model on flat pieces, so the class must be one of
``ELEMENTWISE_OPTIMIZERS`` or declare itself element-wise (``ELEMENTWISE_FLAG``); anything else
is refused when the trainer is built. With their other settings these classes give the
unsharded result bitwise (tested). ``fused=True`` (SGD, Adam, AdamW, Adagrad) is accepted, but
its vectorised kernels may round an element differently depending on where it falls in its
tensor, so the model can differ from unsharded training by float32 rounding (the owner and
replicas of a shard step the same tensor and still agree bitwise).

What a member holds is tagged with a version (``ftmesh.training.shards``): the step and the
round that produced it. The state of the committed step is kept aside while a step's update is
pending (its allgather not yet complete), so that both can be offered in the next sync; and
after a re-shard the pieces held before it are kept, and offered, until the next update.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..collective import RingView
from ..errors import LocalUsageError
from ..state import Snapshot, State
from ..state.sharding import ShardLayout
from ..training.shards import (
    Piece,
    Segment,
    Version,
    anyone_fetches,
    holdings_record,
    on_offer,
    plan_shard_sync,
    read_holdings,
)

if TYPE_CHECKING:
    from ..mesh.blocking import SyncMesh

StateDict = dict[str, torch.Tensor]

ELEMENTWISE_OPTIMIZERS: frozenset[type[torch.optim.Optimizer]] = frozenset(
    {
        torch.optim.SGD,
        torch.optim.Adam,
        torch.optim.AdamW,
        torch.optim.Adamax,
        torch.optim.NAdam,
        torch.optim.RAdam,
        torch.optim.RMSprop,
        torch.optim.Adagrad,
        torch.optim.Adadelta,
        torch.optim.ASGD,
        torch.optim.Rprop,
    }
)
"""The torch optimizers whose update is element-wise (see the module docstring) with every
option (momentum, Nesterov, weight decay, AMSGrad, centred, maximize, foreach, fused...), as
read in torch 2.13's source (``capturable=True`` and ``differentiable=True`` fail inside
torch's own step on CPU parameters, sharded or not). Not these: Adafactor (factored moments),
Muon (orthogonalises matrices), LBFGS (dot products over all parameters), SparseAdam (sparse
gradients). Exact classes: a subclass may change the update, so it must declare itself."""

ELEMENTWISE_FLAG = "ftmesh_elementwise"
"""An optimizer class of one's own (or a subclass of an allowed one) declares that its update
is element-wise with the class attribute ``ftmesh_elementwise = True``, set on the class
itself: it is not inherited, since a subclass may add a per-tensor norm."""


@dataclass(slots=True)
class HeldPiece:
    """Optimizer state of elements ``[start, stop)``: 1-D tensors of that many elements and
    0-d scalars (such as Adam's step count)."""

    start: int
    stop: int
    state: StateDict


Held = tuple[int, int, list[HeldPiece]]
"""A version of what a member holds: ``(step, round, pieces)``."""


class ShardedOptimizer:
    """One member's shards of the optimizer state; see the module docstring."""

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        template: torch.optim.Optimizer,
        replicas: int,
        names: Sequence[str] = (),
    ) -> None:
        check_elementwise(type(template))
        if len(template.param_groups) != 1:
            raise LocalUsageError("shard_optimizer supports optimizers with one parameter group")
        if replicas < 1:
            raise LocalUsageError(f"replicas must be >= 1, got {replicas}")
        for i, p in enumerate(params):
            if p.dtype != torch.float32 or p.device.type != "cpu":
                name = names[i] if i < len(names) else f"#{i} of shape {tuple(p.shape)}"
                raise LocalUsageError(
                    f"shard_optimizer cannot hold parameter {name!r} ({p.dtype} on {p.device}): "
                    "the sharded optimizer state is one flat float32 buffer in host memory, "
                    "cut into pieces that members exchange and checkpoint. Keep float32 "
                    "parameters (and compute in lower precision with torch.autocast), or use "
                    "shard_optimizer=False"
                )
        self.params = list(params)
        self.sizes = [p.numel() for p in self.params]
        self.length = sum(self.sizes)
        self.template = template
        self.replicas = replicas
        self.layout: ShardLayout | None = None
        self._shards: list[tuple[int, int, torch.nn.Parameter]] = []
        self._opt: torch.optim.Optimizer | None = None
        self._loaded: list[HeldPiece] | None = None
        self._live: tuple[int, int] | None = None  # (step, round) of what we hold
        self._backup: Held | None = None
        self._previous: list[HeldPiece] = []  # pieces of the live version before a re-shard
        self.served: dict[str, Snapshot] = {}
        """Pieces offered in the last sync, by digest (the member's state server serves them
        until the next update: then every member has finished that sync)."""

    # -- the flat parameter vector ---------------------------------------------------------
    def flat_params(self) -> torch.Tensor:
        """The parameters as one flat vector (a copy)."""
        return torch.cat([p.detach().reshape(-1) for p in self.params])

    def load_flat_params(self, flat: torch.Tensor) -> None:
        """Write a flat vector back into the parameters."""
        with torch.no_grad():
            offset = 0
            for p, n in zip(self.params, self.sizes, strict=True):
                p.copy_(flat[offset : offset + n].view_as(p))
                offset += n

    # -- what we hold ----------------------------------------------------------------------
    def held(self) -> list[HeldPiece]:
        """The pieces of optimizer state we hold now."""
        if self._loaded is not None:
            return self._loaded
        opt = self._opt
        if opt is None:
            return []
        return [HeldPiece(a, b, opt.state.get(w, {})) for a, b, w in self._shards]

    def versions(self) -> list[Held]:
        """What we can offer in a sync: the live version, then the one kept aside."""
        out: list[Held] = []
        if self._live is not None:
            out.append((*self._live, self.held() + self._previous))
        if self._backup is not None:
            out.append(self._backup)
        return out

    @property
    def live_step(self) -> int:
        """The step of the state we hold (-1: none)."""
        return self._live[0] if self._live is not None else -1

    def load_full(self, step: int, rnd: int, state: StateDict) -> None:
        """Hold the whole buffer's state (read from a checkpoint) as version ``(step, rnd)``."""
        self._loaded = [HeldPiece(0, self.length, state)]
        self._shards, self._opt, self._backup, self._previous = [], None, None, []
        self._live = (step, rnd)

    def sync(
        self,
        mesh: SyncMesh,
        view: RingView,
        step: int,
        candidates: Sequence[int],
        wait: float | None = None,
    ) -> int:
        """Re-shard for ``view`` at the agreed ``step`` (see ``ftmesh.training.shards``):
        offer what we hold, agree on who holds what, fetch what we lack, hold our shards of
        the new layout. ``candidates``: the ranks that hold the agreed model; ``wait``: how
        long members wait for the others' fetches (default: the mesh's io_timeout). Returns
        the bytes fetched."""
        me = mesh.node_id
        layout = ShardLayout.of(view.node_ids, self.length, self.replicas)
        if step == 0:  # nobody has stepped: there is no optimizer state yet
            self.start_fresh(layout, me)
            return 0
        pieces: dict[str, HeldPiece] = {}
        served: dict[str, Snapshot] = {}
        versions = []
        max_pieces = 2 * self.replicas  # held shards, and those held before a re-shard
        for v_step, v_round, held in self.versions():
            described = []
            offer = on_offer([(p.start, p.stop) for p in held], max_pieces)
            for p in (held[i] for i in offer):
                snap = piece_snapshot(v_step, p)
                served[snap.digest], pieces[snap.digest] = snap, p
                described.append(Piece(p.start, p.stop, snap.digest))
            versions.append(Version(v_step, v_round, tuple(described)))
        self.served = served
        record = holdings_record(versions, max_pieces)
        session = mesh.session(view)
        holdings = read_holdings(session.allgather(record).output, max_pieces)
        needed = [[layout.shard_range(j) for j in layout.held_by(m)] for m in view.node_ids]
        rank = view.rank_of(me)
        plan = plan_shard_sync(holdings, step, candidates, rank, needed[rank], self.length)
        fetched = 0
        for piece, sources in plan.fetches().items():
            holders = [view.members[r].node_id for r in sources]
            snap = mesh.fetch_state(holders, step, piece.digest)
            got = State(rng=False)
            got.load_snapshot(snap)
            pieces[piece.digest] = HeldPiece(piece.start, piece.stop, got.scalars["state"])
            fetched += snap.nbytes
        if anyone_fetches(holdings, step, candidates, needed, self.length):
            # Nobody moves on (and, at the end, leaves) while others still pull from it.
            session.barrier(io_timeout=wait)
        mine = next((v for v in versions if (v.step, v.round) == (step, plan.round)), None)
        keep = [pieces[p.digest] for p in mine.pieces] if mine else []
        self.rebuild(layout, me, plan.segments, pieces, (step, plan.round), keep)
        return fetched

    def shard_digests(self) -> dict[str, str]:
        """``{"start:stop": digest}`` of the state of each held shard (holders of one shard
        compare equal)."""
        return {
            f"{p.start}:{p.stop}": piece_snapshot(self.live_step, p).digest for p in self.held()
        }

    def start_fresh(self, layout: ShardLayout, me: str) -> None:
        """Nobody has stepped yet: empty optimizer state for our shards of ``layout``."""
        self._install(layout, me, [{} for _ in layout.held_by(me)], (0, 0))

    def rebuild(
        self,
        layout: ShardLayout,
        me: str,
        segments: Sequence[Segment],
        pieces: Mapping[str, HeldPiece],
        version: tuple[int, int],
        keep: list[HeldPiece],
    ) -> None:
        """Hold our shards of ``layout``, assembled from ``segments`` (see
        ``plan_shard_sync``) whose pieces ``pieces`` maps by digest; ``keep`` (our pieces of
        ``version`` before this) stay on offer until the next update."""
        ref = pieces[segments[0].piece.digest].state if segments else {}
        states = []
        for j in layout.held_by(me):
            a, b = layout.shard_range(j)
            segs = [s for s in segments if a <= s.start and s.stop <= b]
            states.append(_assemble(segs, pieces, a, b, ref))
        self._install(layout, me, states, version)
        self._previous = keep

    def _install(
        self, layout: ShardLayout, me: str, states: list[StateDict], version: tuple[int, int]
    ) -> None:
        flat = self.flat_params()
        shards = []
        for j in layout.held_by(me):
            a, b = layout.shard_range(j)
            shards.append((a, b, torch.nn.Parameter(flat[a:b].clone())))
        # The user's optimizer class with its hyper-parameters, also passed to the constructor
        # where it takes them: some use them at once (Adagrad's initial_accumulator_value).
        cls: Any = type(self.template)
        hyper = self._hyper()
        takes = inspect.signature(cls).parameters
        kwargs = {k: v for k, v in hyper.items() if k in takes}
        opt = cls([{"params": [w for _, _, w in shards], **hyper}], **kwargs)
        for (_, _, w), state in zip(shards, states, strict=True):
            if state:
                opt.state[w] = state
        self.layout, self._shards, self._opt = layout, shards, opt
        self._loaded, self._backup, self._live, self._previous = None, None, version, []

    # -- a step ------------------------------------------------------------------------------
    def update(self, flat_grad: torch.Tensor, version: tuple[int, int]) -> None:
        """Apply one step to every held shard; what we held before is kept aside until
        ``commit()``."""
        opt = self._opt
        if opt is None or self._live is None:
            raise LocalUsageError("the sharded optimizer holds no shards: sync first")
        before = [HeldPiece(p.start, p.stop, _cloned(p.state)) for p in self.held()]
        flat = self.flat_params()
        with torch.no_grad():
            for a, b, w in self._shards:
                w.copy_(flat[a:b])
                w.grad = flat_grad[a:b]
        opt.param_groups[0].update(self._hyper())  # e.g. a learning rate changed since
        opt.step()
        self._backup = (*self._live, before)
        self._live = version
        # The gradient allreduce completed, so every member finished its sync: nobody needs
        # the pieces from before it any more.
        self._previous, self.served = [], {}

    def hold_still(self) -> None:
        """A step whose update every member skips (non-finite gradients): the held shards
        take the current parameters, unchanged, for the step's allgather."""
        if self._live is None:
            raise LocalUsageError("the sharded optimizer holds no shards: sync first")
        flat = self.flat_params()
        with torch.no_grad():
            for a, b, w in self._shards:
                w.copy_(flat[a:b])

    def commit(self) -> None:
        """The step's allgather completed: drop the state kept aside."""
        self._backup = None

    def gather_input(self, with_state: bool) -> np.ndarray:
        """Our contribution to the allgather that ends a step: our own shard's updated
        parameters and, with ``with_state`` (a checkpoint step), its optimizer state, one row
        each, padded to the longest shard."""
        layout = self.layout
        if layout is None or not self._shards:
            raise LocalUsageError("the sharded optimizer holds no shards: sync first")
        width = max(b - a for a, b in (layout.shard_range(i) for i in range(layout.n)))
        a, b, w = self._shards[0]
        rows = [w.detach()]
        if with_state:
            rows += [t for _, t in sorted(_elementwise(self._state_of(w)).items())]
        out = np.zeros((len(rows), width), dtype=np.float32)
        for i, row in enumerate(rows):
            out[i, : b - a] = row.numpy()
        return out

    def apply_gathered(self, gathered: np.ndarray, with_state: bool) -> StateDict:
        """Write the gathered parameters into the model; with ``with_state``, return the
        whole buffer's optimizer state (for a checkpoint)."""
        layout = self.layout
        assert layout is not None
        ranges = [layout.shard_range(i) for i in range(layout.n)]

        def row(i: int) -> torch.Tensor:
            parts = [gathered[r, i, : b - a] for r, (a, b) in enumerate(ranges)]
            return torch.from_numpy(np.concatenate(parts))

        self.load_flat_params(row(0))
        if not with_state:
            return {}
        own = self._state_of(self._shards[0][2])
        # 0-d values (step counts) from a shard that has them (our own may be empty)
        scalars = next((p.state for p in self.held() if p.stop > p.start and p.state), own)
        full = _cloned({k: v for k, v in scalars.items() if v.dim() == 0})
        for i, key in enumerate(sorted(_elementwise(own)), start=1):
            full[key] = row(i)
        return full

    def _hyper(self) -> dict[str, Any]:
        """The template's hyper-parameters (its one group, less its parameters)."""
        return {k: v for k, v in self.template.param_groups[0].items() if k != "params"}

    def _state_of(self, w: torch.nn.Parameter) -> StateDict:
        assert self._opt is not None
        state: dict[str, Any] = self._opt.state.get(w, {})
        for key, value in state.items():
            if (
                not isinstance(value, torch.Tensor)
                or value.dim() > 1
                or (value.dim() == 1 and value.dtype != torch.float32)
            ):
                raise LocalUsageError(
                    f"shard_optimizer needs element-wise float32 optimizer state; "
                    f"{type(self.template).__name__} keeps {key!r} as {type(value).__name__}"
                )
        return state


def check_elementwise(cls: type[torch.optim.Optimizer]) -> None:
    """Raise ``LocalUsageError`` unless ``cls``'s update is known to be element-wise (see
    ``ELEMENTWISE_OPTIMIZERS`` and ``ELEMENTWISE_FLAG``)."""
    if cls in ELEMENTWISE_OPTIMIZERS or vars(cls).get(ELEMENTWISE_FLAG) is True:
        return
    known = ", ".join(sorted(c.__name__ for c in ELEMENTWISE_OPTIMIZERS))
    raise LocalUsageError(
        f"shard_optimizer=True cannot use {cls.__module__}.{cls.__qualname__}: sharding cuts "
        f"the parameters into flat pieces, which changes the result of any update that is not "
        f"element-wise (per-tensor norms or trust ratios as in LAMB and LARS, factored moments "
        f"as in Adafactor, shape-dependent state). Element-wise torch optimizers: {known}. If "
        f"this class updates each element from that element's parameter, gradient and state "
        f"alone (and scalars such as the step count), set the class attribute "
        f"{ELEMENTWISE_FLAG} = True on it; otherwise use shard_optimizer=False."
    )


def piece_snapshot(step: int, piece: HeldPiece) -> Snapshot:
    """A held piece of optimizer state as a snapshot of its own (served to members that fetch
    it; the range is part of what the digest covers)."""
    scalars = {"start": piece.start, "stop": piece.stop, "state": piece.state}
    return State(step=step, scalars=scalars, rng=False).snapshot()


def _cloned(state: StateDict) -> StateDict:
    return {k: v.clone() for k, v in state.items()}


def _elementwise(state: StateDict) -> StateDict:
    return {k: v for k, v in state.items() if v.dim() == 1}


def _assemble(
    segs: Sequence[Segment],
    pieces: Mapping[str, HeldPiece],
    start: int,
    stop: int,
    empty: StateDict,
) -> StateDict:
    """The state of elements ``[start, stop)`` cut out of the pieces ``segs`` name (an empty
    shard gets the keys and 0-d values of ``empty``, a piece of the same version)."""
    ref = pieces[segs[0].piece.digest].state if segs else empty
    out: StateDict = {}
    for key, value in ref.items():
        if value.dim() == 0:
            out[key] = value.clone()
        elif not segs:
            out[key] = value[:0].clone()
        else:
            parts = []
            for s in segs:
                piece = pieces[s.piece.digest]
                parts.append(piece.state[key][s.start - piece.start : s.stop - piece.start])
            out[key] = torch.cat(parts)
    if segs and (segs[0].start, segs[-1].stop) != (start, stop):
        raise LocalUsageError(f"segments do not cover [{start}, {stop})")
    return out
