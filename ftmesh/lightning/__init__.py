"""Lightning Fabric on the mesh: ``FtmeshStrategy`` (``ftmesh.lightning.strategy``).

Import ``ftmesh.lightning`` anywhere: Lightning is imported only when ``FtmeshStrategy`` is
first used (``pip install ftmesh[lightning]``), so ftmesh itself never needs it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .strategy import FtmeshStrategy

__all__ = ["FtmeshStrategy"]


def __getattr__(name: str) -> Any:
    if name != "FtmeshStrategy":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        from .strategy import FtmeshStrategy
    except ModuleNotFoundError as exc:
        if exc.name is not None and exc.name.split(".")[0] == "lightning":
            raise ModuleNotFoundError(
                "ftmesh.lightning.FtmeshStrategy needs Lightning: pip install 'ftmesh[lightning]'",
                name=exc.name,
            ) from exc
        raise
    return FtmeshStrategy
