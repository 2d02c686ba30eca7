"""PyTorch integration: the elastic, fault-tolerant data-parallel trainer.

Import ``ftmesh.torch`` only where torch is installed (``pip install ftmesh[torch]``).
``ElasticTrainer`` trains a model over the mesh (the loop API, ``trainer.steps()``, or the
closure API, ``trainer.step(loss_fn)``); ``TrainerConfig`` holds its settings (``DiLoCo``:
semi-synchronous rounds, ``ftmesh.torch.diloco``);
``ElasticSampler`` decides which samples each member computes at each step;
``ShardedStream`` gives it streaming data with a committed position.
"""

from __future__ import annotations

from ..stats import TrainerStatistics
from ..training.config import DiLoCo, TrainerConfig
from ..training.step import StepReport
from .loop import StateDivergedError, Step, StepAborted
from .sampler import ElasticSampler
from .stream import ShardedStream
from .trainer import ElasticTrainer

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
