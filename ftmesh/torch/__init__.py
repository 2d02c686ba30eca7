"""PyTorch integration: the elastic, fault-tolerant data-parallel trainer.

Import ``ftmesh.torch`` only where torch is installed (``pip install ftmesh[torch]``).
``ElasticTrainer`` trains a model over the mesh (the loop API, ``trainer.steps()``, or the
closure API, ``trainer.step(loss_fn)``); ``TrainerConfig`` holds its settings (``DiLoCo``:
semi-synchronous rounds, ``ftmesh.torch.diloco``);
``ElasticSampler`` decides which samples each member computes at each step;
``ShardedStream`` gives it streaming data with a committed position.

``ShardedStream`` is exported lazily (PEP 562): its module, like DiLoCo's, ZeRO's and the
checkpoints', loads only where it is used, not in every trainer's start-up (issue #30).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import _lazy_face
from ..stats import TrainerStatistics
from ..training.config import DiLoCo, TrainerConfig
from ..training.step import StepReport
from .loop import StateDivergedError, Step, StepAborted
from .sampler import ElasticSampler
from .trainer import ElasticTrainer

if TYPE_CHECKING:
    from .stream import ShardedStream

_EXPORTS = {"ShardedStream": ".stream"}
"""Lazily exported name -> the module that defines it."""

__getattr__, __dir__ = _lazy_face(globals(), _EXPORTS)

__all__ = [
    "DiLoCo",
    "ElasticSampler",
    "ElasticTrainer",
    "ShardedStream",
    "StateDivergedError",
    "Step",
    "StepAborted",
    "StepReport",
    "TrainerConfig",
    "TrainerStatistics",
]
