"""Plots of benchmark and chaos results (``--plot FILE.png``; optional: ``ftmesh[plot]``).

Theory of operation: each plot is two functions. A ``*_series`` function turns a result
(the same dict the command prints with ``--json``) into plain series — lists of numbers
keyed by label — and holds all of the logic, so tests check the data behind a plot rather
than its pixels. A ``plot_*`` function draws those series with matplotlib (imported only
there, with the non-interactive Agg backend), writes a PNG that carries the series as JSON in
a text chunk (``SERIES_KEY``; :func:`read_plot_series` reads it back) and returns them.

The commands check ``--plot`` with :func:`check_plot_path` before they start a run (a
benchmark can take many minutes): matplotlib importable, the name ending in ``.png``, its
directory there and writable; otherwise a one-line :class:`ConfigError`.

* ``ftmesh bench allreduce``: median busbw against message size, one line per implementation
  and member count (:func:`busbw_series`).
* ``ftmesh bench recovery``: per fault round, the time from the signal to the first sign a
  survivor saw it (*detection*: its collective failed, or its view dropped the victim) and to
  the first step committed without the victim (*resume*), per fault kind (kill -9, SIGTERM,
  SIGSTOP) and for torchrun's restart (resume only) (:func:`recovery_series`).
* ``ftmesh bench stragglers``: per policy, the slow member's share of each step and each
  step's time, from the first run of each (:func:`stragglers_series`).
* ``ftmesh lab chaos``: a timeline (:func:`chaos_series`): the faults as spans in one lane per
  kind (then, lighter, the time until one view again and, hatched, until a training
  workload trained again), the committed step of every host and
  its throughput (commits per second in windows), and view changes (a member joined, died
  or left) as vertical lines. Steps come from the ``commit`` records of a training workload
  (``--workload train``); a membership-only run commits nothing, so its plot has the faults
  and view changes only.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConfigError

Series = dict[str, list[tuple[float, float]]]
"""label -> points (x, y), sorted by x."""

Spans = dict[str, list[tuple[float, float]]]
"""label -> intervals (start, end), sorted by start."""

SERIES_KEY = "ftmesh-series"
"""PNG text chunk holding the series drawn, as JSON."""

THROUGHPUT_WINDOWS = 60
"""A chaos timeline's throughput is counted in about this many windows of the run (at least
one second each)."""


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install 'ftmesh[plot]'") from None
    return plt


def check_plot_path(path: str | Path) -> Path:
    """The ``--plot`` file, checked before a run: raises a one-line :class:`ConfigError`
    unless matplotlib imports and ``path`` is a ``.png`` file that can be written."""
    p = Path(path)
    if p.suffix.lower() != ".png":
        raise ConfigError(f"--plot {path}: the file name must end in .png")
    parent = p.parent
    if not parent.is_dir():
        raise ConfigError(f"--plot {path}: directory {parent} does not exist")
    if p.is_dir():
        raise ConfigError(f"--plot {path}: is a directory")
    if not os.access(parent, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise ConfigError(f"--plot {path}: not writable")
    _pyplot()
    return p


def plot_path_error(path: str | None) -> str | None:
    """For a benchmark with its own parser: the one-line message of :func:`check_plot_path`,
    or None when ``--plot`` is unset or usable."""
    try:
        if path:
            check_plot_path(path)
    except ConfigError as exc:
        return str(exc)
    return None


def _save(fig: Any, plt: Any, path: str | Path, series: Mapping[str, Any]) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={SERIES_KEY: json.dumps(series)})
    plt.close(fig)


def read_plot_series(path: str | Path) -> dict[str, Any]:
    """The series a ``plot_*`` function wrote into ``path`` (tuples come back as lists)."""
    data = Path(path).read_bytes()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ConfigError(f"{path}: not a PNG file")
    at = 8
    while at + 8 <= len(data):
        (length,) = struct.unpack(">I", data[at : at + 4])
        kind, body = data[at + 4 : at + 8], data[at + 8 : at + 8 + length]
        at += 12 + length
        key, _, rest = body.partition(b"\0")
        if key != SERIES_KEY.encode():
            continue
        if kind == b"tEXt":
            text = rest.decode("latin-1")
        elif kind == b"zTXt":
            text = zlib.decompress(rest[1:]).decode("latin-1")
        elif kind == b"iTXt":  # flag, method, language\0, translated key\0, text
            compressed, rest = rest[0], rest[2:]
            rest = rest.split(b"\0", 2)[2]
            text = (zlib.decompress(rest) if compressed else rest).decode()
        else:
            continue
        out: dict[str, Any] = json.loads(text)
        return out
    raise ConfigError(f"{path}: no {SERIES_KEY} chunk (not written by ftmesh --plot)")


# -- ftmesh bench allreduce ----------------------------------------------------------------
def busbw_series(cells: Sequence[Mapping[str, Any]]) -> Series:
    """``ftmesh bench allreduce`` cells -> median busbw (GB/s, 1e9 bytes/s) against size
    (bytes), one series per implementation and member count (``"ftmesh N=4"``)."""
    out: Series = {}
    for cell in cells:
        for impl, stats in cell["busbw"].items():
            if stats.get("median") is None:
                continue
            label = f"{impl} N={cell['procs']}"
            out.setdefault(label, []).append((float(cell["bytes"]), float(stats["median"]) / 1e9))
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
    if series:
        ax.legend(fontsize="small")
    _save(fig, plt, path, {"busbw": series})
    return series


# -- ftmesh bench recovery -----------------------------------------------------------------
RECOVERY_ROUNDS = (
    ("kill -9", "kill_to_step_s", "kill_breakdowns_s"),
    ("SIGTERM", "leave_to_step_s", "leave_breakdowns_s"),
    ("SIGSTOP", "sigstop_to_step_s", "sigstop_breakdowns_s"),
    ("torchrun kill -9", "torchrun_kill_to_step_s", ""),
)
"""Fault kinds of the recovery bench: label, key of the resume times (``samples``), key of
the per-round milestones (detection; torchrun has none)."""


def _detection(row: Mapping[str, Any]) -> float | None:
    seen = [row.get(k) for k in ("first_failure", "view_without_victim")]
    times = [float(x) for x in seen if x is not None]
    return min(times) if times else None


def recovery_series(result: Mapping[str, Any]) -> Series:
    """``ftmesh bench recovery --json`` -> per fault kind, ``"<kind> detection"`` and
    ``"<kind> resume"``: (round, seconds from the signal) for every round (1-based)."""
    out: Series = {}
    for kind, resume_key, rows_key in RECOVERY_ROUNDS:
        samples = (result.get(resume_key) or {}).get("samples") or []
        detections = [_detection(row) for row in result.get(rows_key, [])] if rows_key else []
        det = [(float(i + 1), d) for i, d in enumerate(detections) if d is not None]
        if det:
            out[f"{kind} detection"] = det
        if samples:
            out[f"{kind} resume"] = [(float(i + 1), float(s)) for i, s in enumerate(samples)]
    return out


def plot_recovery(result: Mapping[str, Any], path: str | Path) -> Series:
    """Detection and resume per round and fault kind (log seconds); returns the series."""
    series = recovery_series(result)
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = {kind: f"C{i}" for i, (kind, _, _) in enumerate(RECOVERY_ROUNDS)}
    for label, pts in series.items():
        kind, _, what = label.rpartition(" ")
        resume = what == "resume"
        ax.plot(
            [p[0] for p in pts],
            [p[1] for p in pts],
            marker="o",
            linestyle="-" if resume else "--",
            markerfacecolor=None if resume else "none",
            color=colors[kind],
            label=label,
        )
    bound = result.get("suspicion_bound_s")
    if bound and "SIGSTOP resume" in series:
        ax.axhline(float(bound) + 1.0, color=colors["SIGSTOP"], alpha=0.4, linestyle=":")
        ax.annotate("SIGSTOP bound", (1, float(bound) + 1.0), fontsize="x-small")
    if series:
        ax.set_yscale("log")
        ax.legend(fontsize="small")
    ax.set_xlabel("fault round")
    ax.set_ylabel("seconds from the signal")
    ax.set_title(f"recovery, {result.get('procs', '?')} processes: detection and resume")
    ax.grid(True, alpha=0.3, which="both")
    ax.xaxis.get_major_locator().set_params(integer=True)
    _save(fig, plt, path, {"recovery": series})
    return series


# -- ftmesh bench stragglers ---------------------------------------------------------------
def _straggler_policies(result: Mapping[str, Any]) -> list[str]:
    """The policies of a ``ftmesh bench stragglers`` result, in the order they ran: the
    entries with runs."""
    return [k for k, v in result.items() if isinstance(v, Mapping) and v.get("runs")]


def stragglers_series(result: Mapping[str, Any]) -> Series:
    """``ftmesh bench stragglers --json`` -> per policy (its first run), ``"<policy> share"``:
    (step, the slow member's share; 0 while it sits out) and ``"<policy> ms"``: (step, ms
    from the step before to it)."""
    out: Series = {}
    for policy in _straggler_policies(result):
        runs = result[policy]["runs"]
        run = runs[0]
        shares = run.get("slow_shares") or []
        out[f"{policy} share"] = [(float(k + 1), float(v)) for k, v in enumerate(shares) if v >= 0]
        step_ms = run.get("step_ms") or []
        out[f"{policy} ms"] = [(float(k + 2), float(v)) for k, v in enumerate(step_ms)]
    return out


def plot_stragglers(result: Mapping[str, Any], path: str | Path) -> Series:
    """The slow member's share (top) and the step time (bottom, log) per policy and step;
    returns the series drawn."""
    series = stragglers_series(result)
    plt = _pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for i, policy in enumerate(_straggler_policies(result)):
        for ax, what in ((top, "share"), (bottom, "ms")):
            pts = series.get(f"{policy} {what}")
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], color=f"C{i}", label=policy)
    warmup = result.get("warmup")
    for ax in (top, bottom):
        if warmup:
            ax.axvline(float(warmup), color="grey", alpha=0.4, linestyle=":")
        ax.grid(True, alpha=0.3)
    top.set_ylabel("slow member's share")
    factor = result.get("slow_factor")
    slow = f"1/{factor:g}" if isinstance(factor, int | float) else "?"
    top.set_title(
        f"stragglers: one of {result.get('procs', '?')} members at {slow} speed, "
        f"global batch {result.get('global_batch', '?')}"
    )
    if series:
        top.legend(fontsize="small")
        bottom.set_yscale("log")
    bottom.set_ylabel("ms per step")
    bottom.set_xlabel("committed step (dotted: end of warm-up)")
    _save(fig, plt, path, {"stragglers": series})
    return series


# -- ftmesh lab chaos ----------------------------------------------------------------------
@dataclass
class ChaosSeries:
    """What a chaos timeline draws (seconds since the first fault's start)."""

    faults: Spans = field(default_factory=dict)
    """kind -> (start, repair) of every fault of that kind."""
    recovering: Spans = field(default_factory=dict)
    """kind -> (repair, one view again) of every fault of that kind that settled."""
    resuming: Spans = field(default_factory=dict)
    """kind -> (one view again, the workload trains again) (``resume_s``; training only)."""
    steps: Series = field(default_factory=dict)
    """host (``"h0"``) -> (time, committed step), over all processes that ran on it."""
    throughput: Series = field(default_factory=dict)
    """host -> (window middle, commits per second in the window)."""
    view_changes: dict[str, list[float]] = field(default_factory=dict)
    """``joined`` | ``dead`` | ``left`` -> times any member first reported one."""
    window_s: float = 0.0
    workload: str = "membership"


def _host(proc: str) -> str:
    return proc.split(".", 1)[0]


def chaos_series(result: Mapping[str, Any], window: float | None = None) -> ChaosSeries:
    """``ftmesh lab chaos --json`` -> :class:`ChaosSeries`; ``window``: seconds per
    throughput window (default: the run in ``THROUGHPUT_WINDOWS``, at least 1 s)."""
    out = ChaosSeries(workload=str(result.get("workload", "membership")))
    for rec in result.get("records", []):
        start = float(rec["started_s"])
        end = start + float(rec["hold_s"])
        settled = float(rec.get("settled_at", 0.0))
        if rec.get("recovery_s") is not None and settled >= start:
            end = settled - float(rec["recovery_s"])
        out.faults.setdefault(rec["kind"], []).append((start, end))
        if settled > end:
            out.recovering.setdefault(rec["kind"], []).append((end, settled))
        if rec.get("resume_s") is not None and settled >= start:
            resumed = settled + float(rec["resume_s"])
            out.resuming.setdefault(rec["kind"], []).append((settled, resumed))
    timeline = result.get("timeline") or {}
    commits: Mapping[str, list[list[float]]] = timeline.get("commits", {})
    for proc, points in commits.items():
        out.steps.setdefault(_host(proc), []).extend((float(p[0]), float(p[1])) for p in points)
    out.steps = {h: sorted(pts) for h, pts in sorted(out.steps.items())}
    for t, kind, _who in timeline.get("views", []):
        out.view_changes.setdefault(str(kind), []).append(float(t))
    times = [float(p[0]) for pts in commits.values() for p in pts]
    if times:
        lo, hi = min(times), max(times)
        out.window_s = window or max(1.0, (hi - lo) / THROUGHPUT_WINDOWS)
        edges = np.arange(lo, hi + out.window_s, out.window_s)
        rates: dict[str, np.ndarray[Any, Any]] = {}
        for proc, points in commits.items():
            ts = np.array([p[0] for p in points], dtype=float)
            ns = np.array([p[2] for p in points], dtype=float)
            # commits strictly before each edge: n - 1 at a point's own time
            done = np.interp(edges, ts, ns - 1, left=0.0, right=ns[-1])
            host = _host(proc)
            rates[host] = rates.get(host, 0.0) + np.diff(done) / out.window_s
        mids = (edges[:-1] + edges[1:]) / 2
        out.throughput = {
            h: [(float(m), float(r)) for m, r in zip(mids, rate, strict=True)]
            for h, rate in sorted(rates.items())
        }
    return out


VIEW_COLORS = {"joined": "tab:green", "dead": "tab:red", "left": "tab:gray"}


def plot_chaos(result: Mapping[str, Any], path: str | Path) -> ChaosSeries:
    """The timeline of a chaos run (see the module docstring); returns the series drawn."""
    series = chaos_series(result)
    plt = _pyplot()
    fig, axes = plt.subplots(
        3, 1, figsize=(10, 7.5), sharex=True, gridspec_kw={"height_ratios": [1.2, 2, 2]}
    )
    lane, steps, rate = axes
    kinds = sorted(set(series.faults) | set(series.recovering))
    for i, kind in enumerate(kinds):
        color = f"C{i % 10}"
        spans = [(a, max(b - a, 0.05)) for a, b in series.faults.get(kind, [])]
        lane.broken_barh(spans, (i - 0.4, 0.8), color=color)
        after = [(a, b - a) for a, b in series.recovering.get(kind, [])]
        lane.broken_barh(after, (i - 0.4, 0.8), color=color, alpha=0.3)
        resume = [(a, b - a) for a, b in series.resuming.get(kind, [])]
        lane.broken_barh(resume, (i - 0.25, 0.5), facecolor="none", edgecolor=color, hatch="//")
    lane.set_yticks(range(len(kinds)), kinds, fontsize="small")
    lane.set_ylim(-0.6, max(len(kinds), 1) - 0.4)
    resumed = "; hatched: until training resumed" if series.resuming else ""
    lane.set_title(
        f"chaos: {result.get('hosts', '?')} hosts, seed {result.get('seed', '?')}, "
        f"workload {series.workload} (faults; lighter: until one view{resumed})"
    )
    for host, pts in series.steps.items():
        steps.plot([p[0] for p in pts], [p[1] for p in pts], label=host, linewidth=1)
    for host, pts in series.throughput.items():
        rate.plot([p[0] for p in pts], [p[1] for p in pts], label=host, linewidth=1)
    steps.set_ylabel("committed step")
    windows = f" ({series.window_s:.1f} s windows)" if series.window_s else ""
    rate.set_ylabel(f"commits/s{windows}")
    if series.steps:
        steps.legend(fontsize="x-small", ncol=4, loc="upper left")
    else:
        for ax in (steps, rate):
            ax.text(
                0.5,
                0.5,
                "no training steps (membership workload)",
                ha="center",
                transform=ax.transAxes,
                color="gray",
            )
    for kind, times in series.view_changes.items():
        for ax in axes:
            for t in times:
                ax.axvline(t, color=VIEW_COLORS.get(kind, "black"), alpha=0.35, linewidth=0.7)
    rate.set_xlabel("seconds since the first fault (vertical lines: joined / dead / left)")
    for ax in axes:
        ax.grid(True, alpha=0.3)
    _save(fig, plt, path, {"chaos": asdict(series)})
    return series
