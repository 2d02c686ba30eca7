"""The ``torch.distributed`` face: torch's collective API on the collective session of a view.

Theory of operation. Library code written for ``torch.distributed`` (a metric's
``sync_dist``: ``dist.all_reduce`` of its state; an evaluation's ``dist.all_gather_object``)
checks ``dist.is_initialized()`` and then calls the default process group. ftmesh registers
a torch backend named ``ftmesh`` whose process group runs every call on the session that is
*bound* at the time (``ViewCollectives``: the collectives of one agreed view):

* ``with bound(session):`` -- the trainer enters it around a step. On entry the default
  group is (re)initialised if it belongs to another view (``destroy_process_group`` then
  ``init_process_group("ftmesh", rank=the view's rank, world_size=its size)``, on a local
  ``HashStore``: nothing is exchanged, the view is already agreed), so ``get_rank()`` and
  ``get_world_size()`` follow the view. Inside, ``all_reduce`` (sum, avg, min, max),
  ``all_gather`` (and ``all_gather_into_tensor``), ``broadcast``, ``barrier`` and what torch
  builds on them (``all_gather_object``, ``broadcast_object_list``) run on the session, in
  the calling thread, blocking; the ``Work`` returned is already complete.
* A failure raises the session's own typed error (``RingPeerLostError``,
  ``ViewSupersededError``, ...), out of the ``dist`` call, so the step's attempt fails as for
  any collective in the step.
* Outside a step the default group stays initialised (``is_initialized()`` is true,
  ``get_rank()`` is the last view's), but every collective raises ``OutsideStepError`` at
  once: between steps no agreed set of members is waiting, so a call could only hang or
  silently run on whoever happens to call. Before the first ``bound`` the default group does
  not exist (torch's own error).
* A group kept from an older view (``dist.group.WORLD`` saved before a view change) raises
  ``StaleGroupError`` (a ``ViewSupersededError``) on every call instead of mixing members of
  two views.

One default group per process (torch's rule): ``bound`` is not reentrant and serves one
thread at a time. torch is imported only when this module is.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from ..collective.errors import ViewSupersededError
from ..collective.ring_store import ViewCollectives
from ..errors import LocalUsageError

BACKEND = "ftmesh"


class OutsideStepError(LocalUsageError):
    """A ``torch.distributed`` collective was called with no session bound (outside a step)."""


class StaleGroupError(ViewSupersededError):
    """A process group of a view that is no longer the bound one was used."""


class _Binding:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.session: ViewCollectives | None = None
        self.epoch: str | None = None
        """View epoch of the default group as initialised (``None``: not by us)."""
        self.registered = False


_BINDING = _Binding()


def register() -> None:
    """Register the ``ftmesh`` backend with torch (idempotent)."""
    with _BINDING.lock:
        if _BINDING.registered:
            return
        dist.Backend.register_backend(
            BACKEND, _create_group, extended_api=False, devices=["cpu", "cuda"]
        )
        _BINDING.registered = True


@contextlib.contextmanager
def bound(session: ViewCollectives) -> Iterator[None]:
    """Run ``torch.distributed`` calls on ``session`` inside the block (see the module doc)."""
    register()
    view = session.view
    rank = view.rank_of(session.node_id)
    with _BINDING.lock:
        if _BINDING.session is not None:
            raise LocalUsageError("torch.distributed is already bound to a session")
        _BINDING.session = session
    try:
        if not dist.is_initialized() or _BINDING.epoch != view.epoch:
            if dist.is_initialized():
                dist.destroy_process_group()
            _BINDING.epoch = view.epoch
            store = dist.HashStore()  # type: ignore[attr-defined]
            dist.init_process_group(BACKEND, store=store, rank=rank, world_size=view.size)
        yield
    finally:
        with _BINDING.lock:
            _BINDING.session = None


def release() -> None:
    """Destroy the default group if ``bound`` made it (a trainer's close; tests). While a
    session is bound (another trainer of this process is inside a step) the group is its:
    left alone, its own close releases it."""
    with _BINDING.lock:
        if _BINDING.session is not None:
            return
        mine = _BINDING.epoch is not None
        _BINDING.epoch = None
    if mine and dist.is_initialized():
        dist.destroy_process_group()


def available() -> str:
    """Why ``bound`` cannot take the default group now ("" if it can): the program
    initialised ``torch.distributed`` itself, or another session is bound (one default group
    per process)."""
    with _BINDING.lock:
        if _BINDING.session is not None:
            return "another trainer of this process holds torch.distributed"
        if dist.is_initialized() and _BINDING.epoch is None:
            return "the program initialised torch.distributed itself"
    return ""


def current() -> ViewCollectives | None:
    """The bound session, if any."""
    return _BINDING.session


def _create_group(store: Any, rank: int, size: int, timeout: Any) -> _SessionGroup:
    epoch = _BINDING.epoch
    if epoch is None:
        raise LocalUsageError(f"the {BACKEND!r} backend is initialised by ftmesh.torch.bound")
    return _SessionGroup(rank, size, epoch)


_OPS = {
    dist.ReduceOp.SUM: "sum",
    dist.ReduceOp.AVG: "avg",
    dist.ReduceOp.MIN: "min",
    dist.ReduceOp.MAX: "max",
}


def _op_name(op: Any) -> str:
    for k, v in _OPS.items():
        if op == k:
            return v
    raise LocalUsageError(f"ftmesh's torch.distributed face reduces sum/avg/min/max, not {op}")


class _DoneWork(dist.Work):  # type: ignore[misc]
    """A ``Work`` for a call that already ran (in the caller's thread)."""

    def __init__(self, result: Any) -> None:
        super().__init__()
        self._result = result

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def get_future(self) -> Any:
        fut: Any = torch.futures.Future()
        fut.set_result(self._result)
        return fut


class _SessionGroup(dist.ProcessGroup):  # type: ignore[misc]
    """The default group of one view: every call on the bound session of that view."""

    def __init__(self, rank: int, size: int, epoch: str) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]
        self._epoch = epoch

    def getBackendName(self) -> str:
        return BACKEND

    def _session(self) -> ViewCollectives:
        s = _BINDING.session
        if s is None:
            raise OutsideStepError(
                "torch.distributed collectives run inside a step (ftmesh.torch.distributed."
                "bound(session)); between steps no agreed set of members is waiting"
            )
        if s.view.epoch != self._epoch:
            raise StaleGroupError(
                f"process group of view {self._epoch} used in view {s.view.epoch}",
                epoch=self._epoch,
            )
        return s

    def allreduce(  # type: ignore[override]
        self, tensors: list[Any], opts: Any = None
    ) -> _DoneWork:
        s = self._session()
        op = _op_name(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        for t in tensors:
            s.allreduce(_contiguous(t), op)
        return _DoneWork(tensors)

    def allgather(  # type: ignore[override]
        self, outputs: list[list[Any]], inputs: list[Any], opts: Any = None
    ) -> Any:
        s = self._session()
        for outs, t in zip(outputs, inputs, strict=True):
            gathered = torch.as_tensor(s.allgather(_contiguous(t)).output)
            for i, o in enumerate(outs):
                o.copy_(gathered[i])
        return _DoneWork(outputs)

    def _allgather_base(self, output: Any, input: Any, opts: Any = None) -> Any:
        s = self._session()
        gathered = torch.as_tensor(s.allgather(_contiguous(input)).output)
        output.copy_(gathered.reshape(output.shape))
        return _DoneWork([output])

    def broadcast(  # type: ignore[override]
        self, tensors: list[Any], opts: Any = None
    ) -> _DoneWork:
        s = self._session()
        root = s.view.node_ids[opts.rootRank if opts is not None else 0]
        for t in tensors:
            s.broadcast(_contiguous(t), root)
        return _DoneWork(tensors)

    def barrier(self, opts: Any = None) -> _DoneWork:
        self._session().barrier()
        return _DoneWork(None)


def _contiguous(t: Any) -> Any:
    if not t.is_contiguous():
        raise LocalUsageError("ftmesh collectives run in place on contiguous tensors")
    return t
