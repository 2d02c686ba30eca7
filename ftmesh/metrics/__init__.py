"""Prometheus metrics of a mesh member (optional: ``pip install ftmesh[metrics]``).

``NodeConfig(metrics_port=P)`` (``--metrics-port P``, ``connect(metrics_port=P)``,
``FTMESH_METRICS_PORT``) makes a member serve ``/metrics`` on its gossip bind address; off by
default, and then nothing here is imported. See ``collector`` for the metric families (with
prometheus_client's ``process_*`` and ``python_info``), ``probes`` for ``/healthz`` and
``/readyz``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ..errors import ConfigError

if TYPE_CHECKING:
    from ..net.node import Node


def renderer(node: Node) -> Callable[[], bytes]:
    """A function returning the node's metrics in Prometheus' text format; raises
    ``ConfigError`` if ``prometheus_client`` is not installed."""
    try:
        from prometheus_client import (
            CollectorRegistry,
            PlatformCollector,
            ProcessCollector,
            generate_latest,
        )

        from .collector import MeshCollector
    except ImportError:
        raise ConfigError(
            "metrics need prometheus_client: pip install 'ftmesh[metrics]' (or leave "
            "--metrics-port unset)"
        ) from None
    registry = CollectorRegistry(auto_describe=False)
    registry.register(MeshCollector(node))
    ProcessCollector(registry=registry)  # process_*: CPU, memory, descriptors (Linux)
    PlatformCollector(registry=registry)  # python_info

    def render() -> bytes:
        return bytes(generate_latest(registry))

    return render
