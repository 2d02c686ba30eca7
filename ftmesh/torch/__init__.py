"""PyTorch integration: elastic sampler, fault-tolerant data-parallel trainer.

Import ``ftmesh.torch`` only where torch is installed (``pip install ftmesh[torch]``).
"""

from __future__ import annotations

from .sampler import ElasticSampler
from .trainer import ElasticTrainer, StepReport

__all__ = ["ElasticSampler", "ElasticTrainer", "StepReport"]
