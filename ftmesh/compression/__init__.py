"""Gradient compression for slow links: blockwise int8 with error feedback.

``int8`` holds the codec (the NumPy reference that #14's CUDA kernels follow bit for bit),
``feedback`` the per-stream state an allreduce with ``compression=`` carries between calls.
The compressed allreduce itself lives in ``ftmesh.collective.compressed`` (one round) and
``ftmesh.collective.shared_scale`` (two rounds, integer sums; large buffers on 3+ members).
"""

from .feedback import COMPRESSIONS, Int8Compression, as_compression, per_stream
from .int8 import DEFAULT_BLOCK_SIZE, MAX_BLOCK_SIZE, Int8Codec

__all__ = [
    "COMPRESSIONS",
    "DEFAULT_BLOCK_SIZE",
    "MAX_BLOCK_SIZE",
    "Int8Codec",
    "Int8Compression",
    "as_compression",
    "per_stream",
]
