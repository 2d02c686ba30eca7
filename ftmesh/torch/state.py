"""Everything a trainer keeps in step across the mesh, registered once: ``TrainingState``.

Theory of operation. The model and the optimizer are always part of it; the user adds LR
schedulers, a ``GradScaler``, EMA weights, any object with ``state_dict()`` /
``load_state_dict()`` (``ElasticTrainer.register``), and plain values in the
``ElasticTrainer.scalars`` dict (kept in the ``State``'s own scalars); the data position is
the committed step itself (the sampler turns it into the epoch and the place in it). All of
it is one ``ftmesh.state.State``: one snapshot for syncs, joiners and checkpoints, one digest.

*When* each part is read matters, because the committed state of step ``s`` must be the same
on every member, and a member that adopts ``s`` goes on from the same point of the user's
program as the members that computed it: the end of step ``s``'s body. Code between two steps
(at the end of an epoch: ``scheduler.step()``, a test pass) runs on every member after every
step it commits or adopts. So:

* modules and optimizers (large) are read live, whenever the state is needed (a sync, a
  checkpoint, a check). Change them only inside a step's body;
* every other registered object, and ``scalars``, is *captured* (a deep copy of its
  ``state_dict()``, small) at the end of every step's body, and that copy is what the state
  holds until the next step ends. Stepping a scheduler once per epoch, between steps, is
  therefore safe: a member that adopts the epoch's last step runs the same code after it.

Loading a snapshot (a joiner, a member that was behind, a checkpoint) applies every part to the
live objects and makes the loaded copies the captured ones.

Part check values (``check_values``) are 16 bits of each part's digest; the trainer compares
them across members every ``check_every`` steps (``ftmesh.training.protocol``).
"""

from __future__ import annotations

import copy
import hashlib
from typing import Any

import torch

from ..errors import LocalUsageError
from ..state import Snapshot, State
from ..state.state import _Encoder
from ..training.protocol import check_value
from ..training.shards import LAYOUT_BITS

RESERVED = ("model", "optimizer", "scalars")
"""Part names the trainer uses itself."""


class Captured:
    """A registered object whose state is captured at the end of every step (see the module
    docstring); the ``State`` holds this wrapper."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj
        self._copy: dict[str, Any] | None = None

    def capture(self) -> None:
        """Copy the object's state now (the end of a step)."""
        self._copy = copy.deepcopy(self.obj.state_dict())

    def state_dict(self) -> dict[str, Any]:
        """The captured copy (what the committed state holds)."""
        # Before the first step ends, the live state (the starting point).
        return self._copy if self._copy is not None else dict(self.obj.state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Apply ``state`` to the object and make it the captured copy."""
        self.obj.load_state_dict(copy.deepcopy(state))
        self._copy = copy.deepcopy(state)


class TrainingState:
    """The registered state of one trainer; see the module docstring."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.scalars: dict[str, Any] = {}
        """The user's plain values, live; the ``State``'s own ``scalars`` hold the copy
        captured at the end of the last step."""
        self._captured: dict[str, Captured] = {}
        self._kinds: dict[str, str] = {"model": "module", "optimizer": "optimizer"}
        self._kinds["scalars"] = "scalars"
        self.state = State(model=model, optimizer=optimizer, rng=False)
        self.frozen = False
        """Set at the first step: the layout is then part of what members compare."""

    def register(self, name: str, obj: Any, *, note: str = "") -> None:
        """Add ``obj`` under ``name`` (see ``ElasticTrainer.register``); ``note`` joins its
        kind in ``layout`` (settings its meaning depends on: members must agree on them)."""
        if self.frozen:
            raise LocalUsageError(
                f"register {name!r} before the first step: every member must hold the same "
                "parts from the start"
            )
        if name in RESERVED or name in self._kinds:
            raise LocalUsageError(f"{name!r} is already registered (or reserved: {RESERVED})")
        if not (
            callable(getattr(obj, "state_dict", None))
            and callable(getattr(obj, "load_state_dict", None))
        ):
            raise LocalUsageError(
                f"{name!r}: register objects with state_dict() and load_state_dict() "
                f"(a {type(obj).__name__} has not both); put plain values in trainer.scalars"
            )
        if isinstance(obj, torch.nn.Module | torch.optim.Optimizer):
            self.state.register(name, obj)  # read live, like the model
            kind = "module" if isinstance(obj, torch.nn.Module) else "optimizer"
        else:
            _Encoder().encode(obj.state_dict(), name)  # what cannot be stored fails now
            wrapper = Captured(obj)
            self._captured[name] = wrapper
            self.state.register(name, wrapper)
            kind = "captured"
        self._kinds[name] = f"{kind}:{type(obj).__module__}.{type(obj).__qualname__}{note}"

    @property
    def names(self) -> list[str]:
        """The registered parts, in the order of the check slots."""
        return sorted(self._kinds)

    @property
    def layout(self) -> int:
        """A hash of the registered names and kinds (every member must register alike)."""
        text = ";".join(f"{n}={self._kinds[n]}" for n in self.names)
        digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big") >> (64 - LAYOUT_BITS)

    def capture(self) -> None:
        """The end of a step's body: capture the captured parts (see the module docstring)."""
        for wrapper in self._captured.values():
            wrapper.capture()
        if self.scalars or self.state.scalars:
            _Encoder().encode(self.scalars, "scalars")  # what cannot be stored fails here
            self.state.scalars.clear()
            self.state.scalars.update(copy.deepcopy(self.scalars))

    def commit(self, step: int) -> Snapshot:
        """The committed state of ``step`` as the snapshot served to members behind."""
        return self.state.commit(step=step)

    def load(self, snap: Snapshot, *, extra: tuple[str, ...] = ()) -> dict[str, Any]:
        """Apply ``snap`` to every part; returns the values of ``extra`` names found in its
        scalars (not the user's: see ``with_extra``)."""
        self.state.load_snapshot(snap)
        found = {k: self.state.scalars.pop(k) for k in extra if k in self.state.scalars}
        self.scalars.clear()
        self.scalars.update(copy.deepcopy(self.state.scalars))
        return found

    def part_digests(self) -> dict[str, str]:
        """A digest of each part, in ``names`` order."""
        digests = self.state.part_digests()
        digests["scalars"] = self.state.scalars_digest()
        return {name: digests[name] for name in self.names}

    def check_values(self) -> list[int]:
        """One check value per part, in ``names`` order."""
        digests = self.part_digests()
        return [check_value(digests[name]) for name in self.names]

    def live_digest(self, step: int) -> str:
        """Content hash of the state as it is now (one full copy)."""
        self.state.step = step
        return self.state.live_digest()

    def with_extra(self, step: int, **scalars: Any) -> Snapshot:
        """A snapshot of the same parts with ``scalars`` added to the captured scalars
        (sharded checkpoints keep the gathered optimizer state there), not committed."""
        extra = State(scalars={**self.state.scalars, **scalars}, rng=False)
        for name, obj in self.state.objects.items():
            extra.register(name, obj)
        extra.step = step
        return extra.snapshot()
