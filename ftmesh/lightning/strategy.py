"""A Lightning Fabric strategy whose training runs as ``ElasticTrainer`` steps on the mesh.

Theory of operation. A Fabric script keeps its own loop; ``Fabric(strategy=FtmeshStrategy(
data))`` changes what the loop runs on, and the loop iterates the trainer's steps instead of a
``DataLoader``::

    strategy = FtmeshStrategy(sampler_or_loader)       # data: the trainer's (global batch)
    fabric = Fabric(strategy=strategy, accelerator="cpu")
    fabric.launch()
    model, optimizer = fabric.setup(Net(), torch.optim.SGD(...))
    for step in strategy.steps(total):                 # ElasticTrainer.steps
        with step:
            for idx in step.indices():                 # (or step.batches())
                fabric.backward(loss_of(model, idx))
            fabric.clip_gradients(model, optimizer, max_norm=1.0)
            optimizer.step()
        # here: once per committed step
    strategy.teardown()                                # the trainer's hooks, our mesh

* ``fabric.setup(model, optimizer)`` (or ``setup_module`` then ``setup_optimizers``) wraps
  nothing in DDP: the strategy keeps the module and the optimizer and, at the first use of
  :attr:`FtmeshStrategy.trainer` (``steps()``, ``epochs()``), builds an ``ElasticTrainer``
  over them, the data given to the strategy and the mesh (``ftmesh.connect()`` unless one is
  given). The trainer hooks the parameters itself: gradients are averaged over each step's
  samples by its bucket allreduces, so ``fabric.backward(loss)`` is ``loss.backward()``
  through Fabric's precision plugin, and Fabric's optimizer wrapper reaches the trainer's
  guarded ``optimizer.step()``. Everything ``ftmesh.torch.loop`` says holds unchanged: a
  failed attempt is retried inside ``step.indices()``/``step.batches()``, a step is committed
  by all survivors or none, each sample of an epoch is trained exactly once, joiners fetch the
  state. ``fabric.setup(..., scheduler=s)`` and :meth:`FtmeshStrategy.register` make objects
  part of the committed state.
* ``fabric.all_reduce``, ``all_gather``, ``broadcast``, ``barrier`` (and the strategy's
  ``reduce_boolean_decision``) go through ``torch.distributed`` on the ``ftmesh`` backend
  (``ftmesh.torch.distributed``), which runs on the collective session of the current step's
  view: inside ``with step:`` they reach exactly the step's members, and a failure fails the
  attempt (the loop gets the step back with ``step.report is None``, as ``ftmesh.torch.loop``
  describes). Outside a step they raise ``OutsideStepError`` at once: between steps there is
  no agreed set of members to wait for.
* ``fabric.global_rank`` / ``world_size`` / ``is_global_zero`` are the ring's of the current
  (last) step (0 and 1 before the first): they change with the view, so use them to pick who
  logs or saves, never to split data. Each member counts as a node of its own
  (``local_rank`` 0, ``node_rank`` = ``global_rank``), so ``fabric.print`` prints on each.

Supported: one model and one optimizer; the CPU accelerator (tested) and CUDA (``cuda:0``:
``ftmesh launch`` gives each worker its own GPU; ``device=`` overrides; not yet run on a
GPU); precision ``32-true``, ``bf16-mixed`` and ``bf16-true`` (tested), ``16-true`` (let
through untested; the gradient buckets hold float32, bfloat16 and float16);
``fabric.clip_gradients`` (after the loop over micro-batches: the reduced gradients);
``optimizer.zero_grad()`` anywhere (not needed: Fabric's wrapper is routed to the trainer's,
which inside a step keeps the micro-batches' sum whatever ``set_to_none``);
``fabric.setup_dataloaders`` for evaluation loaders, which pass through unchanged (no
``DistributedSampler`` is injected: every member iterates them whole).

Refused with a clear error: a second model or optimizer; precision with a gradient scaler
(``16-mixed``), ``64-true`` or any other precision plugin; ``fabric.no_backward_sync`` (use
``micro_batch=`` of ``TrainerConfig``: the trainer accumulates micro-batches itself);
``fabric.save``/``fabric.load`` (the committed state is the trainer's: ``checkpoint_dir=``,
``checkpoint_every=``, ``ftmesh checkpoint export``; ``torch.save(model.state_dict())``
after the loop works as in any script); process groups other than the default one;
``all_gather(sync_grads=True)``; passing the training data to ``fabric.setup_dataloaders``
(iterate ``step.batches()``: the trainer hands each member its share); accelerators other
than CPU and CUDA. Batches of ``step.batches()`` come as the loader collates them: move them
with ``fabric.to_device`` on a GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.utils.data as tud
from lightning.fabric.accelerators.cpu import CPUAccelerator
from lightning.fabric.accelerators.cuda import CUDAAccelerator
from lightning.fabric.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.fabric.strategies.strategy import Strategy, TBroadcast, _BackwardSyncControl
from torch.nn import Module
from torch.optim import Optimizer

from ..errors import LocalUsageError
from ..mesh.blocking import SyncMesh, connect
from ..torch import distributed
from ..torch.distributed import OutsideStepError
from ..torch.loop import Step
from ..torch.sampler import ElasticSampler
from ..torch.trainer import ElasticTrainer
from ..training.config import TrainerConfig

__all__ = ["FtmeshStrategy", "OutsideStepError"]

_OPS = {
    "mean": dist.ReduceOp.AVG,
    "avg": dist.ReduceOp.AVG,
    "sum": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}
_PRECISIONS = (Precision, MixedPrecision, HalfPrecision)


class _NoBackwardSync(_BackwardSyncControl):
    """``fabric.no_backward_sync``: refused (the trainer accumulates micro-batches itself)."""

    def no_backward_sync(
        self, module: Module, enabled: bool
    ) -> contextlib.AbstractContextManager[Any]:
        if enabled:
            raise LocalUsageError(
                "fabric.no_backward_sync is not supported by FtmeshStrategy: the trainer "
                "reduces a step's gradients once, after its last micro-batch; for gradient "
                "accumulation pass micro_batch=M to FtmeshStrategy (TrainerConfig.micro_batch)"
            )
        return contextlib.nullcontext()


class FtmeshStrategy(Strategy):
    """See the module docstring. ``data``: the trainer's ``ElasticSampler`` or ``DataLoader``
    (its ``batch_size`` is the global batch); ``mesh``: a connected mesh (default: ``ftmesh.
    connect()`` at the trainer's creation, closed by :meth:`teardown`); ``config`` and keyword
    ``settings``: the trainer's (``TrainerConfig``); ``device``: the root device (default:
    ``cuda:0`` with the CUDA accelerator, else the CPU)."""

    def __init__(
        self,
        data: ElasticSampler | tud.DataLoader[Any] | None = None,
        *,
        mesh: SyncMesh | None = None,
        config: TrainerConfig | None = None,
        device: str | torch.device | None = None,
        on_world_change: Callable[[int, int], None] | None = None,
        **settings: Any,
    ) -> None:
        super().__init__()
        self._backward_sync_control = _NoBackwardSync()
        self._data = data
        self._mesh = mesh
        self._own_mesh: SyncMesh | None = None
        self._config = config
        self._settings = settings
        self._on_world_change = on_world_change
        self._device = torch.device(device) if device is not None else None
        self._module: Module | None = None
        self._optimizer: Optimizer | None = None
        self._registered: dict[str, Any] = {}
        self._trainer: ElasticTrainer | None = None

    # ------------------------------------------------------------------ the trainer

    @property
    def trainer(self) -> ElasticTrainer:
        """The ``ElasticTrainer`` of the model and optimizer ``fabric.setup`` was given, made
        (and the mesh connected) on first use: ``committed``, ``digest()``, ``finish()``..."""
        if self._trainer is None:
            if self._module is None or self._optimizer is None:
                raise LocalUsageError(
                    "FtmeshStrategy trains one model with one optimizer: call "
                    "`model, optimizer = fabric.setup(model, optimizer)` before the steps"
                )
            if self._data is None:
                raise LocalUsageError(
                    "FtmeshStrategy needs the training data (an ElasticSampler or the "
                    "DataLoader you would train with): FtmeshStrategy(data)"
                )
            mesh = self._mesh
            if mesh is None:
                mesh = self._own_mesh = self._mesh = connect()
            self._trainer = ElasticTrainer(
                mesh,
                self._module,
                self._optimizer,
                self._data,
                self._config,
                state=self._registered,
                on_world_change=self._on_world_change,
                **self._settings,
            )
        return self._trainer

    def steps(self, total: int | None = None) -> Iterator[Step]:
        """``ElasticTrainer.steps``: one ``Step`` per step; run its body in ``with step:``."""
        return self.trainer.steps(total)

    def epochs(self, epochs: int | Iterable[Any]) -> Iterator[Any]:
        """``ElasticTrainer.epochs``: the epochs to train, starting at the mesh's."""
        return self.trainer.epochs(epochs)

    def register(self, name: str, obj: Any) -> None:
        """``ElasticTrainer.register``: make ``obj`` part of the committed state (before the
        first step)."""
        if self._trainer is None:
            if name in self._registered:
                raise LocalUsageError(f"{name!r} is registered already")
            self._registered[name] = obj
        else:
            self._trainer.register(name, obj)

    # ------------------------------------------------------------------ ranks and devices

    @property
    def global_rank(self) -> int:
        """This member's place in the ring of the current (last) step; 0 before any."""
        t = self._trainer
        return t.rank if t is not None and t.rank >= 0 else 0

    @property
    def world_size(self) -> int:
        """Members in the ring of the current (last) step; 1 before any."""
        t = self._trainer
        return t.world_size if t is not None and t.world_size > 0 else 1

    @property
    def local_rank(self) -> int:
        return 0  # each member is a node of its own

    @property
    def node_rank(self) -> int:
        return self.global_rank

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    @property
    def distributed_sampler_kwargs(self) -> None:
        """None: Fabric injects no ``DistributedSampler`` (the trainer shares the data)."""
        return None

    @property
    def root_device(self) -> torch.device:
        if self._device is not None:
            return self._device
        if isinstance(self.accelerator, CUDAAccelerator):
            return torch.device("cuda", 0)
        return torch.device("cpu")

    def setup_environment(self) -> None:
        if not isinstance(self.accelerator, CPUAccelerator | CUDAAccelerator):
            raise LocalUsageError(
                f"FtmeshStrategy runs on the CPU or CUDA accelerators, not "
                f"{type(self.accelerator).__name__}"
            )
        super().setup_environment()

    def module_to_device(self, module: Module) -> None:
        module.to(self.root_device)

    # ------------------------------------------------------------------ set-up

    def setup_module_and_optimizers(
        self, module: Module, optimizers: list[Optimizer], scheduler: Any = None
    ) -> tuple[Module, list[Optimizer], Any]:
        if len(optimizers) != 1:
            raise LocalUsageError(
                f"FtmeshStrategy trains one model with one optimizer, got {len(optimizers)}"
            )
        module = self.setup_module(module)
        optimizers = [self.setup_optimizer(optimizers[0])]
        if scheduler is not None:
            self.register("scheduler", scheduler)
        return module, optimizers, scheduler

    def setup_module(self, module: Module) -> Module:
        if self._module is not None:
            raise LocalUsageError("FtmeshStrategy trains one model: fabric.setup was called twice")
        precision = self.precision
        if type(precision) not in _PRECISIONS or getattr(precision, "scaler", None) is not None:
            raise LocalUsageError(
                f"FtmeshStrategy does not support the precision plugin {precision!r}: use "
                "32-true, bf16-mixed, bf16-true or 16-true (not 64-true: the gradient buckets "
                "hold float32, bfloat16 and float16; not a gradient scaler, as 16-mixed has)"
            )
        self._module = module
        return module

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        if self._optimizer is not None:
            raise LocalUsageError("FtmeshStrategy trains with one optimizer")
        _route_zero_grad(optimizer)
        self._optimizer = optimizer
        return optimizer

    def process_dataloader(self, dataloader: tud.DataLoader[Any]) -> tud.DataLoader[Any]:
        if dataloader is self._data:
            raise LocalUsageError(
                "the training DataLoader belongs to FtmeshStrategy: iterate step.batches() "
                "inside `with step:` (each member gets its share of the step); "
                "fabric.setup_dataloaders is for loaders every member iterates whole"
            )
        return dataloader

    # ------------------------------------------------------------------ collectives

    def _in_step(self, what: str, group: Any = None) -> None:
        if distributed.current() is None:
            raise OutsideStepError(
                f"fabric.{what}() ran outside a step: with FtmeshStrategy, collectives run "
                "inside `with step:` (on the step's members); between steps no agreed set of "
                "members is waiting"
            )
        if group is not None and group is not dist.group.WORLD:
            raise LocalUsageError(
                f"FtmeshStrategy.{what} runs on the step's members, the default group only"
            )

    def all_reduce(
        self, tensor: torch.Tensor | Any, group: Any | None = None, reduce_op: Any = "mean"
    ) -> torch.Tensor | Any:
        """In place, like Fabric's DDP (``mean``/``avg``, ``sum``, ``max``, ``min``)."""
        if not isinstance(tensor, torch.Tensor):
            return tensor
        self._in_step("all_reduce", group)
        op = reduce_op if reduce_op is not None else "sum"
        if isinstance(op, str):
            if op.lower() not in _OPS:
                raise LocalUsageError(f"FtmeshStrategy reduces with {sorted(_OPS)}, not {op!r}")
            op = _OPS[op.lower()]
        mean_of_ints = op == dist.ReduceOp.AVG and not torch.is_floating_point(tensor)
        with torch.no_grad():
            buf = tensor if tensor.is_contiguous() else tensor.contiguous()
            dist.all_reduce(buf, op=dist.ReduceOp.SUM if mean_of_ints else op)
            if mean_of_ints:  # (as Fabric's DDP: the mean truncated into the integer tensor)
                buf.copy_(buf / dist.get_world_size())
            if buf is not tensor:
                tensor.copy_(buf)
        return tensor

    def all_gather(
        self, tensor: torch.Tensor, group: Any | None = None, sync_grads: bool = False
    ) -> torch.Tensor:
        """Shape ``(world_size, *tensor.shape)``, in rank order."""
        if sync_grads:
            raise LocalUsageError("FtmeshStrategy.all_gather does not carry gradients")
        self._in_step("all_gather", group)
        t = tensor.detach().contiguous()
        out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(out, t)
        return torch.stack(out)

    def barrier(self, name: str | None = None) -> None:
        self._in_step("barrier")
        dist.barrier()

    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        self._in_step("broadcast")
        objs = [obj]
        dist.broadcast_object_list(objs, src)
        return objs[0]

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        self._in_step("reduce_boolean_decision")
        votes = torch.tensor([1.0 if decision else 0.0])
        dist.all_reduce(votes)
        return bool(votes[0] == dist.get_world_size()) if all else bool(votes[0] > 0)

    # ------------------------------------------------------------------ refused

    def save_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        raise LocalUsageError(
            "fabric.save is not supported by FtmeshStrategy: the committed state is the "
            "trainer's (FtmeshStrategy(..., checkpoint_dir=D, checkpoint_every=N) writes and "
            "resumes it; `ftmesh checkpoint export` converts it); to keep the final weights, "
            "torch.save(model.state_dict(), path) after the loop"
        )

    def load_checkpoint(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        raise LocalUsageError(
            "fabric.load is not supported by FtmeshStrategy: the trainer resumes from its "
            "checkpoint_dir, and joiners fetch the committed state from the mesh"
        )

    def teardown(self) -> None:
        """Close the trainer (its hooks) and the mesh this strategy connected."""
        if self._trainer is not None:
            self._trainer.close()
        if self._own_mesh is not None:
            self._own_mesh.close()
            self._own_mesh = None
        super().teardown()


def _route_zero_grad(optimizer: Optimizer) -> None:
    """Fabric's optimizer wrapper subclasses the optimizer's class, so ``wrapper.zero_grad()``
    runs the class's method on the wrapper, past the trainer's instance method (inside a step
    it drops ``.grad`` and keeps the micro-batches' sum; torch's ``set_to_none=False`` would
    zero the trainer's gradient buckets). Give the optimizer a subclass whose ``zero_grad``
    goes to the wrapped optimizer's own (the trainer's, once it exists)."""
    cls = type(optimizer)

    def zero_grad(self: Any, set_to_none: bool = True) -> None:
        inner = self.__dict__.get("_optimizer")  # called on Fabric's wrapper
        if inner is not None and inner is not self:
            inner.zero_grad(set_to_none)  # the trainer's instance method, or this on inner
        else:
            cls.zero_grad(self, set_to_none)  # (the trainer's calls this outside a step)

    optimizer.__class__ = type(
        cls.__name__, (cls,), {"zero_grad": zero_grad, "__module__": cls.__module__}
    )
