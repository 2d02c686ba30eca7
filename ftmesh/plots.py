"""Plots of benchmark and chaos results (``--plot FILE.png``; optional: ``ftmesh[plot]``).

Theory of operation: each plot is two functions. A ``*_series`` function turns a result
(the same dict the command prints with ``--json``) into plain series — lists of numbers
keyed by label — and holds all of the logic, so tests check the data behind a plot rather
than its pixels. A ``plot_*`` function draws those series with matplotlib (imported only
there, with the non-interactive Agg backend) and writes a PNG.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .errors import ConfigError

Series = dict[str, list[tuple[float, float]]]
"""label -> points (x, y), sorted by x."""


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install 'ftmesh[plot]'") from None
    return plt


def busbw_series(cells: Sequence[Mapping[str, Any]]) -> Series:
    """``ftmesh bench allreduce`` cells -> median busbw (GB/s) against size (bytes), one
    series per implementation and member count (``"ftmesh N=4"``)."""
    out: Series = {}
    for cell in cells:
        for impl, stats in cell["busbw"].items():
            if stats.get("median") is None:
                continue
            label = f"{impl} N={cell['procs']}"
            out.setdefault(label, []).append((float(cell["bytes"]), float(stats["median"])))
    return {k: sorted(v) for k, v in sorted(out.items())}


def plot_allreduce(cells: Sequence[Mapping[str, Any]], path: str | Path) -> Series:
    """Busbw against size per implementation; returns the series drawn."""
    series = busbw_series(cells)
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, pts in series.items():
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("busbw (GB/s, median)")
    ax.set_title("allreduce bus bandwidth")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return series
