"""``ftmesh bench insider``: the honest members' committed step rate while one member, patched
in its own process, lies in its step header, against a clean run of the same command (issue
#26's figure: the others keep committing at >= ``TARGET`` of their normal rate).

Theory of operation: for each fault ``--kinds`` (``ftmesh.lab.insider``: ``header-nan``,
``header-speeds``, ``header-check``, ``nan-grads``) and each of ``--repeats`` repeats, two
runs of the same command: ``--procs`` N training workers (``python -m
ftmesh.lab.train_worker``, real processes, same-host discovery on loopback, each run a fresh
mesh and registry), the last of them started with ``--fault KIND`` (installed, off). Once
every member committed a step on the full view and ``--settle`` seconds more passed, the
*insider* run turns the fault on (SIGUSR1) at ``t_on``; the *clean* run does nothing. In
both, each honest member's commits in ``[t_on, t_on + --window]`` give its step rate; a
run's honest rate is the slowest honest member's, and the kind's ``ratio`` is the insider
run's over the clean run's (medians over repeats; within a repeat the clean and insider runs
alternate order, so that a trend in the host's load hits both). ``before_ratio`` is the
insider run's rate in the window over its own rate before ``t_on`` (same processes, no
second start).

The window starts at the fault, so it holds the failed attempts, the accusation, and the
steps after the insider was left out (on a view one member smaller). ``left_out_s``: from
``t_on`` until every honest member committed a step on a view without the insider (for
``header-check`` this includes the wait for the next check step, every
``TrainerConfig.check_every`` steps: the lie is only read there). ``bound_s``: what that may
take at most by design (``bad_bytes_strikes`` attempts each followed by at most 0.4 s, twice
for slack, the accusation tracker's tick, ~1 s of gossip; for ``header-check`` plus
``check_every`` steps at the clean rate).

Besides the figures, each insider run records the properties the issue asks for: the
insider was *named* (a WARNING line of an honest member with its id: ``step header ...`` or
``non-finite gradients from ...``), it was *left out* within ``--timeout``, no honest member
exited (*crashed*), and no honest member was missing from a view an honest member committed
on after ``t_on`` (*evicted*). The insider itself may stop (``header-check``: alone with its
state, it exits with ``StateDivergedError``, by design). A run where one of these fails is
listed under ``failures`` and the bench exits 1; a ratio under ``TARGET`` is a figure
(``pass`` false in the JSON), not a failure of the run. The JSON carries the load average
before and after (``uptime``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..collective.reach import ReachConfig
from ..errors import FtmeshError
from ..lab.procs import NodeProcess
from ..mesh.reach import REACH_TICK
from ..training.config import TrainerConfig
from . import host_stamp

KINDS = ("header-nan", "header-speeds", "header-check", "nan-grads")
"""The step-header insiders of issue #26 (``ftmesh.lab.insider``)."""
TARGET = 0.80
"""The issue's bar: honest step rate with an insider over the clean rate."""
START_TIMEOUT = 90.0
"""Seconds a worker may take to import torch and print its first line (several start at
once on a small host)."""
NAMED_MARKERS = ("step header", "non-finite gradients from")
"""What an honest member's WARNING says when it names a member for its header row."""


class BenchFailed(FtmeshError):
    """A run could not be measured (a worker did not start, the view never formed)."""


def bound_s(kind: str, clean_rate: float) -> float:
    """Seconds from the fault to the first step without the insider, by design (the module
    docstring's ``bound_s``)."""
    strikes = ReachConfig().bad_bytes_strikes
    base = 2 * 0.4 * strikes + REACH_TICK + 1.0
    if kind == "header-check":
        base += TrainerConfig().check_every / max(clean_rate, 1e-9)
    return base


def run_order(kinds: Sequence[str], repeats: int) -> list[tuple[str, int, bool]]:
    """(kind, repeat, insider) in the order they run: per kind and repeat a clean and an
    insider run, the clean one first on even repeats."""
    order = []
    for k in range(repeats):
        for kind in kinds:
            pair = [(kind, k, False), (kind, k, True)]
            order += pair if k % 2 == 0 else pair[::-1]
    return order


def _worker_argv(cfg: dict[str, Any], name: str, mesh: str, registry: Path, kind: str) -> list[str]:
    argv = [sys.executable, "-m", "ftmesh.lab.train_worker", "--name", name, "--seed", "3"]
    argv += ["--step-delay", str(cfg["step_delay"]), "--mesh", mesh]
    argv += ["--discovery", "local", "--registry-dir", str(registry)]
    return argv + (["--fault", kind] if name == cfg["insider_name"] else [])


def _commits(p: NodeProcess) -> list[tuple[float, dict[str, Any]]]:
    with p._cond:
        seen = list(p.records)
    return [(s.mono, s.record) for s in seen if s.record.get("event") == "commit"]


def _rate(p: NodeProcess, since: float, until: float) -> float:
    return sum(1 for t, _ in _commits(p) if since <= t < until) / (until - since)


def _without(node: str, after: int) -> Callable[[dict[str, Any]], bool]:
    """Predicate: a commit of a step above ``after`` on a view without ``node``."""
    return lambda r: (
        r.get("event") == "commit" and int(r["step"]) > after and node not in r["members"]
    )


def _warnings(p: NodeProcess) -> list[str]:
    path = Path(str(p.stderr_path))
    text = path.read_text(errors="replace") if path.exists() else ""
    return [line for line in text.splitlines() if re.search(r"\bWARNING\b", line)]


def one_run(kind: str, insider: bool, cfg: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """One run (see the module docstring): its rates, and for an insider run the times and
    properties."""
    n = cfg["procs"]
    names = [f"h{i}" for i in range(n)]
    registry = workdir / "reg"
    mesh = f"insider-{os.getpid()}-{workdir.name}"
    procs: list[NodeProcess] = []
    try:
        for name in names:  # all started, then each awaited: they import torch in parallel
            argv = _worker_argv(cfg, name, mesh, registry, kind)
            procs.append(
                NodeProcess(
                    argv,
                    stderr_path=workdir / f"{name}.stderr",
                    start_timeout=START_TIMEOUT,
                    wait_started=False,
                )
            )
        for p in procs:
            p.wait_started()
        honest, bad = procs[:-1], procs[-1]
        everyone = {p.node_id for p in procs}
        pair = everyone - {bad.node_id}
        try:
            first = max(
                p.wait_seen(
                    lambda r: r.get("event") == "commit" and set(r["members"]) == everyone,
                    cfg["timeout"],
                ).mono
                for p in procs
            )
        except FtmeshError as exc:
            raise BenchFailed(f"{kind}: the full view never committed: {exc}") from None
        time.sleep(cfg["settle"])
        t_on = time.monotonic()
        if insider:
            bad.signal(signal.SIGUSR1)
        end = t_on + cfg["window"]
        time.sleep(max(0.0, end - time.monotonic()))
        rates = [_rate(p, t_on, end) for p in honest]
        before = [_rate(p, first, t_on) for p in honest]
        out: dict[str, Any] = {
            "kind": kind,
            "insider": insider,
            "rate": min(rates),
            "rates": [round(r, 3) for r in rates],
            "before_rate": min(before),
        }
        if not insider:
            out["crashed"] = [p.name for p in procs if p.proc.poll() is not None]
            return out
        # Left out: every honest member committed on a view without the insider.
        left: list[float] = []
        for p in honest:
            try:
                seen = p.wait_seen(
                    _without(bad.node_id, max(int(r["step"]) for t, r in _commits(p) if t < t_on)),
                    max(0.1, t_on + cfg["timeout"] - time.monotonic()),
                )
            except FtmeshError:
                break
            left.append(seen.mono)
        time.sleep(1.0)  # the named lines are written as the offences are reported
        named = [
            line
            for p in honest
            for line in _warnings(p)
            if bad.node_id in line and any(m in line for m in NAMED_MARKERS)
        ]
        evicted = sorted(
            {
                m
                for p in honest
                for t, r in _commits(p)
                if t >= t_on
                for m in pair - set(r["members"])
            }
        )
        name_of = {p.node_id: p.name for p in procs}
        out.update(
            {
                "left_out_s": max(left) - t_on if len(left) == len(honest) else None,
                "named": len(named),
                "named_example": named[0][-200:] if named else "",
                "crashed": [p.name for p in honest if p.proc.poll() is not None],
                "evicted": [name_of[m] for m in evicted],
                "insider_exit": bad.proc.poll(),
            }
        )
        return out
    finally:
        for p in procs:
            if p.proc.poll() is None:
                p.kill()
            p.stop(1.0)


def failures_of(r: dict[str, Any]) -> list[str]:
    """What went wrong in one run (the properties of the module docstring)."""
    what = f"{r['kind']} ({'insider' if r['insider'] else 'clean'} run)"
    bad = [f"{what}: {n} exited" for n in r["crashed"]]
    if r["insider"]:
        if r["left_out_s"] is None:
            bad.append(f"{what}: the insider was not left out within --timeout")
        if not r["named"]:
            bad.append(f"{what}: no honest member named the insider")
        bad += [f"{what}: honest member {n} was left out" for n in r["evicted"]]
    return bad


def summarise(kind: str, runs: list[dict[str, Any]], target: float) -> dict[str, Any]:
    clean = [r for r in runs if not r["insider"]]
    bad = [r for r in runs if r["insider"]]
    ratios = [b["rate"] / c["rate"] if c["rate"] else 0.0 for c, b in zip(clean, bad, strict=True)]
    ratio = statistics.median(ratios)
    clean_rate = statistics.median(r["rate"] for r in clean)
    left = [r["left_out_s"] for r in bad if r["left_out_s"] is not None]
    left_out = statistics.median(left) if left else None
    bound = bound_s(kind, clean_rate)
    return {
        "clean_rate": clean_rate,
        "insider_rate": statistics.median(r["rate"] for r in bad),
        "ratio": ratio,
        "repeat_ratios": ratios,
        "before_ratio": statistics.median(
            r["rate"] / r["before_rate"] if r["before_rate"] else 0.0 for r in bad
        ),
        "left_out_s": left_out,
        "bound_s": bound,
        "pass": ratio >= target and left_out is not None and left_out <= bound,
        "runs": runs,
    }


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    cfg = {
        "procs": args.procs,
        "window": args.window,
        "settle": args.settle,
        "step_delay": args.step_delay,
        "timeout": args.timeout,
        "insider_name": f"h{args.procs - 1}",
    }
    load_before = os.getloadavg()
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
    failures: list[str] = []
    root = Path(args.logs or tempfile.mkdtemp(prefix="ftmesh-bench-insider-"))
    try:
        for i, (kind, _repeat, insider) in enumerate(run_order(kinds, args.repeats)):
            workdir = root / f"run{i}"
            workdir.mkdir(parents=True)
            r = one_run(kind, insider, cfg, workdir)
            runs[kind].append(r)
            failures += failures_of(r)
            print(
                f"done {kind} {'insider' if insider else 'clean'}: {r['rate']:.2f} steps/s"
                + (f", left out after {r['left_out_s']}" if insider else ""),
                file=sys.stderr,
            )
    finally:
        if not args.logs:
            shutil.rmtree(root, ignore_errors=True)
    out: dict[str, Any] = {
        "benchmark": "insider",
        "procs": args.procs,
        "window_s": args.window,
        "repeats": args.repeats,
        "target": args.target,
    }
    for kind in kinds:
        out[kind] = summarise(kind, runs[kind], args.target)
    out["kinds"] = kinds
    out["failures"] = failures
    out.update(host_stamp(load_before))
    return out


def format_table(r: dict[str, Any]) -> str:
    lines = [
        f"N={r['procs']} (one insider), honest step rate over {r['window_s']:g} s from the "
        f"fault on vs a clean run, median of {r['repeats']}; target >= {r['target']:.2f}",
        f"{'kind':>14} | {'clean/s':>7} {'insider/s':>9} {'ratio':>6} {'vs before':>9} | "
        f"{'left out s':>10} {'bound s':>7} | pass",
    ]
    for kind in r["kinds"]:
        c = r[kind]
        left = "never" if c["left_out_s"] is None else f"{c['left_out_s']:.1f}"
        lines.append(
            f"{kind:>14} | {c['clean_rate']:7.2f} {c['insider_rate']:9.2f} {c['ratio']:6.2f} "
            f"{c['before_ratio']:9.2f} | {left:>10} {c['bound_s']:7.1f} | "
            f"{'yes' if c['pass'] else 'NO'}"
        )
    lines.append(
        f"load {r['load_before'][0]:.2f} -> {r['load_after'][0]:.2f}; failures: "
        + ("; ".join(r["failures"]) or "none")
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    doc = __doc__.split("\n")[0]
    ap = argparse.ArgumentParser(prog="ftmesh bench insider", description=doc)
    ap.add_argument("--procs", type=int, default=3, help="members, the last one the insider")
    ap.add_argument(
        "--kinds", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)}"
    )
    ap.add_argument("--window", type=float, default=20.0, help="seconds measured from the fault")
    ap.add_argument("--settle", type=float, default=3.0, help="seconds of training before it")
    ap.add_argument("--repeats", type=int, default=1, help="clean/insider pairs per kind")
    ap.add_argument("--step-delay", type=float, default=0.05, help="the workers' --step-delay")
    ap.add_argument("--target", type=float, default=TARGET, help="the ratio to pass")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds to form a view or leave")
    ap.add_argument("--logs", metavar="DIR", help="keep the workers' stderr in DIR/runI/")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    unknown = [k for k in args.kinds.split(",") if k.strip() and k.strip() not in KINDS]
    if unknown:
        ap.error(f"unknown --kinds {unknown}; choose from {KINDS}")
    if args.procs < 3:
        ap.error("--procs must be >= 3 (an honest majority of at least two)")
    if not args.window > 0 or args.settle < 0 or args.repeats < 1:
        ap.error("--window must be > 0, --settle >= 0, --repeats >= 1")
    try:
        result = run_bench(args)
    except BenchFailed as exc:
        print(f"ftmesh bench insider: error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result) if args.json else format_table(result))
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
