"""``ftmesh bench convergence``: time-to-accuracy of ``examples/train_digits.py`` on slow lab
links, with and without int8 gradient compression, in one run.

Theory of operation: one virtual LAN (``ftmesh.lab.VirtualLan``, root) of ``--procs`` hosts,
every link limited to ``--link-rate`` (tc tbf). For each repetition and each mode (``none``,
``int8``; the order alternates between repetitions so that load on the machine hits both),
every host runs the example as docs/guide/running.md shows for a LAN, ``ftmesh worker
--start-peers N examples/train_digits.py ...`` with mDNS on the host's address, a mesh name of
its own and ``--compression MODE --eval-every K --step-delay 0``. The bench reads host 0's
progress records as they arrive: the clock starts at its first committed step (so process
start-up and mesh formation don't count) and stops at the first record where the mean test
accuracy of the last ``SMOOTH`` evaluations reaches ``--target``. We report, per mode, the median
time-to-accuracy, ms per step, the final accuracy and the accuracy curve, and ``speedup`` =
uncompressed time-to-accuracy / compressed (> 1: compression gets there sooner), and
``step_speedup``, the same for ms per step. Each worker computes on a core it shares with the
others (N hosts on this machine's cores), so a loaded machine inflates the compute part of
a step for both modes and shrinks both ratios."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

MODES = ("none", "int8")
SMOOTH = 3
"""Evaluations averaged before comparing with the target: test accuracy of this small model
moves by +-0.01 from one evaluation to the next, so the first single evaluation above a
target near the plateau is mostly luck."""
RUN_TIMEOUT = 900.0
"""Seconds one training run may take before the bench gives up on it."""


def _example() -> Path:
    return Path(__file__).resolve().parents[2] / "examples" / "train_digits.py"


def _run(lan: Any, mode: str, tag: str, args: argparse.Namespace, script: Path) -> dict[str, Any]:
    """One training run of every host; host 0's records, stamped on arrival."""
    n = args.procs
    procs = []
    for i in range(n):
        argv = [sys.executable, "-m", "ftmesh", "worker", "--mesh", f"conv{tag}"]
        argv += ["--discovery", "mdns", "--interface", lan.host_ip(i), "--start-peers", str(n)]
        argv += [str(script), "--step-delay", "0", "--compression", mode]
        # only host 0 measures accuracy (the bench reads its records): an evaluation on every
        # host would cost N times the CPU the hosts share on this machine, for nothing
        evals = args.eval_every if i == 0 else 0
        argv += ["--epochs", str(args.epochs), "--eval-every", str(evals)]
        argv += ["--digest-every", "0"]
        out = subprocess.PIPE if i == 0 else subprocess.DEVNULL
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        procs.append(lan.popen(i, argv, stdout=out, stderr=subprocess.DEVNULL, text=True, env=env))
    records: list[tuple[float, dict[str, Any]]] = []
    final: list[str] = []

    def read() -> None:
        assert procs[0].stdout is not None
        for line in procs[0].stdout:
            if line.startswith("FTMESH "):
                try:
                    records.append((time.monotonic(), json.loads(line[len("FTMESH ") :])))
                except ValueError:
                    continue
            elif line.startswith("test accuracy:"):
                final.append(line.split(":", 1)[1].strip())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + RUN_TIMEOUT
    try:
        for p in procs:
            p.wait(max(deadline - time.monotonic(), 1.0))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    reader.join(10)
    if any(p.returncode for p in procs):
        raise SystemExit(f"a {mode} training run failed: {[p.returncode for p in procs]}")
    steps = [(t, r) for t, r in records if "step" in r and "done" not in r]
    if not steps:
        raise SystemExit(f"the {mode} run reported no step")
    t0, first = steps[0]
    evals = [(t - t0, int(r["step"]), float(r["accuracy"])) for t, r in steps if "accuracy" in r]
    reached = None
    for k in range(len(evals)):  # the mean of the last SMOOTH evaluations reaches the target
        window = [a for _, _, a in evals[max(0, k - SMOOTH + 1) : k + 1]]
        if len(window) == SMOOTH and sum(window) / SMOOTH >= args.target:
            reached = evals[k][0]
            break
    t_end, last = steps[-1]
    per_step = (t_end - t0) / max(int(last["step"]) - int(first["step"]), 1)
    return {
        "time_to_accuracy_s": reached,
        "ms_per_step": 1000 * per_step,
        "steps": int(last["step"]),
        "final_accuracy": float(final[-1]) if final else None,
        "retries": sum(int(r.get("attempts", 1)) - 1 for _, r in steps),
        "curve": [[step, round(t, 3), acc] for t, step, acc in evals],
    }


def _median(xs: list[float | None]) -> float | None:
    got = [x for x in xs if x is not None]
    return statistics.median(got) if len(got) == len(xs) and got else None


def main(argv: list[str] | None = None) -> int:
    doc = __doc__.split("\n")[0]
    ap = argparse.ArgumentParser(prog="ftmesh bench convergence", description=doc)
    ap.add_argument("--procs", type=int, default=4, help="lab hosts, one worker each")
    ap.add_argument("--link-rate", default="20mbit", help="tc rate of every link (none: unlimited)")
    ap.add_argument("--target", type=float, default=0.95, help="test accuracy to reach")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--eval-every", type=int, default=5, help="steps between accuracy checks")
    ap.add_argument("--repeats", type=int, default=1, help="runs per mode")
    ap.add_argument("--script", default=None, help="the example (default: examples/ here)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    script = Path(args.script) if args.script else _example()
    if not script.is_file():
        ap.error(f"{script} not found: give --script PATH/train_digits.py")
    from ..lab.netns import VirtualLan

    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    with VirtualLan(hosts=args.procs) as lan:
        for i in range(args.procs):
            if args.link_rate != "none":
                lan.set_rate(i, args.link_rate)
        for rep in range(args.repeats):
            order = MODES if rep % 2 == 0 else MODES[::-1]
            for mode in order:
                runs[mode].append(_run(lan, mode, f"{os.getpid()}x{rep}{mode}", args, script))
                if not args.json:
                    print(f"{mode} #{rep}: {runs[mode][-1]}", file=sys.stderr)
    summary: dict[str, Any] = {}
    for mode, rs in runs.items():
        summary[mode] = {
            "time_to_accuracy_s": _median([r["time_to_accuracy_s"] for r in rs]),
            "ms_per_step": _median([r["ms_per_step"] for r in rs]),
            "final_accuracy": _median([r["final_accuracy"] for r in rs]),
            "runs": rs,
        }
    none_t, int8_t = (summary[m]["time_to_accuracy_s"] for m in MODES)
    out = {
        "benchmark": "convergence",
        "procs": args.procs,
        "link_rate": args.link_rate,
        "target": args.target,
        **summary,
        "speedup": none_t / int8_t if none_t and int8_t else None,
        "step_speedup": summary["none"]["ms_per_step"] / summary["int8"]["ms_per_step"],
    }
    if args.json:
        print(json.dumps(out))
    else:
        for mode in MODES:
            s = summary[mode]
            print(
                f"{mode:>5}: {s['time_to_accuracy_s']} s to {args.target}, "
                f"{s['ms_per_step']:.1f} ms/step, final accuracy {s['final_accuracy']}"
            )
        print(f"speedup (time to accuracy, none/int8): {out['speedup']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
