"""``ftmesh bench convergence``: time to the same test accuracy of ``examples/train_digits.py``
on slow lab links, synchronous (float32, int8) against DiLoCo rounds (float32, int8,
streaming, overlapped), in one run.

Theory of operation: one virtual LAN (``ftmesh.lab.VirtualLan``, root) of ``--procs`` hosts,
every link limited to ``--link-rate`` (tc tbf, each direction); or, with ``--sites AxB``, two
sites of A and B hosts whose only path to each other is one WAN link of rate ``--link-rate``
and one-way delay ``--delay`` (``VirtualLan(sites=...)``, ``ftmesh.lab.wan``), the hosts'
own links unlimited. For each repetition and each
mode of ``--modes`` (the order reverses from one repetition to the next so that load on the
machine hits every mode alike), every host runs the example as docs/guide/running.md shows
for a LAN, ``ftmesh worker --start-peers N examples/train_digits.py ...`` with mDNS on the
host's address and a mesh name of its own; on two sites (multicast stays within a site) as
it shows for seeds, host 0 the seed (``--discovery seeds --port P``) and the others joining
it (``--join HOST0:P``), each with its site's label (``--site a`` or ``b``: the ring plan
keeps each site's members adjacent and reduces within the sites first). The modes:

* ``sync``: synchronous steps, float32 gradients; ``sync-int8``: the same, int8 gradients
  with error feedback (``--compression int8``).
* ``diloco``: DiLoCo rounds of ``--diloco H`` inner steps, float32 outer gradients;
  ``diloco-int8``: the same, int8 outer gradients with error feedback.
* ``streaming``: streaming DiLoCo, ``--fragments F``: steps of ``H / F`` inner steps, each
  syncing one fragment of the model (float32). Without the paper's overlap of a sync with
  the next inner steps (``ftmesh.torch.diloco``) it sends the bytes of ``diloco`` in ``F``
  smaller syncs: about ``diloco``'s time, a lower peak bandwidth. On the wide model the
  fragments are uneven (its hidden layer's weight is 92 % of it, one tensor).
* ``overlap``: streaming DiLoCo with the overlap (``--overlap``): a step's fragment travels
  while the step's inner steps run, so a step takes about the longer of the two rather than
  their sum; ``overlap-int8``: the same, int8 outer gradients.

Every mode computes the same per member and step: ``--batch`` samples per member per
(inner) step, so a synchronous step's global batch is ``batch x procs`` and a round's
``batch x procs x H``; a DiLoCo mode differs only in syncing once per H steps. The model is
the example's at ``--hidden`` (one hidden layer of that width: 2.3M parameters at the
default 16384, a 9 MB float32 gradient, large enough for a 20 Mbit/s link to dominate a
step; ``--hidden 0`` is the 13.7K-parameter model).

The bench reads host 0's progress records as they arrive. Host 0 evaluates the test accuracy
every ``--eval-every`` steps of a synchronous mode and after every round of a DiLoCo mode
(its model then holds the committed global parameters; streaming: every ``F`` steps). The
clock starts one step before the first committed one (the first commit minus the run's
mean step time: process start-up and mesh formation don't count, the first step does) and
stops at the first record where the mean of the last ``SMOOTH`` evaluations reaches
``--target``; the run is then stopped (``--full``: trained to the end). Per mode: the median
time to the target, the steps (rounds) and samples it took, ms per step (round), the last
accuracy and the curve;
``ratios``: for each DiLoCo mode, each synchronous mode's time to the target divided by its
own (> 1: DiLoCo gets there sooner). Every worker computes on cores the hosts share (N hosts
on this machine's cores), so a loaded machine inflates the compute part of every step;
DiLoCo's rounds, whose H inner steps are compute, lose most from it.

``SMOOTH`` evaluations are a round apart for DiLoCo and ``--eval-every`` steps apart for a
synchronous mode: the smoothing costs DiLoCo up to ``SMOOTH - 1`` rounds of time that a
single evaluation would not (``first_hit_s``, the time of the first single evaluation at
the target, is reported beside it)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Mode:
    """One way of training: what the example is given."""

    name: str
    diloco: bool
    compression: str
    streaming: bool = False
    overlap: bool = False


MODES = {
    m.name: m
    for m in (
        Mode("sync", False, "none"),
        Mode("sync-int8", False, "int8"),
        Mode("diloco", True, "none"),
        Mode("diloco-int8", True, "int8"),
        Mode("streaming", True, "none", streaming=True),
        Mode("overlap", True, "none", streaming=True, overlap=True),
        Mode("overlap-int8", True, "int8", streaming=True, overlap=True),
    )
}
SMOOTH = 3
"""Evaluations averaged before comparing with the target: test accuracy moves by +-0.01 or
more from one evaluation to the next, so the first single evaluation above a target near the
plateau is mostly luck."""
SEED_PORT = 7946
"""With ``--sites``: the membership port of every host (host 0's is the others' seed)."""
RUN_TIMEOUT = 1200.0
"""Seconds one training run may take before the bench gives up on it."""


def _example() -> Path:
    return Path(__file__).resolve().parents[2] / "examples" / "train_digits.py"


def _reached(evals: list[tuple[float, int, float]], target: float, smooth: int) -> int | None:
    """The index of the first evaluation where the mean of the last ``smooth`` reaches
    ``target``."""
    for k in range(smooth - 1, len(evals)):
        window = [a for _, _, a in evals[k - smooth + 1 : k + 1]]
        if sum(window) / smooth >= target:
            return k
    return None


def _argv(
    mode: Mode, i: int, tag: str, lan: Any, args: argparse.Namespace, script: Path
) -> list[str]:
    n = args.procs
    argv = [sys.executable, "-m", "ftmesh", "worker", "--mesh", f"conv{tag}"]
    if args.sites:  # (multicast stays within a site: seeds, as across real sites)
        argv += ["--discovery", "seeds", "--port", str(SEED_PORT), "--start-peers", str(n)]
        argv += ["--site", "ab"[lan.site_of(i)]]
        argv += ["--join", f"{lan.host_ip(0)}:{SEED_PORT}"] if i else []
    else:
        argv += ["--discovery", "mdns", "--interface", lan.host_ip(i), "--start-peers", str(n)]
    argv += [str(script), "--step-delay", "0", "--compression", mode.compression]
    argv += ["--global-batch", str(args.batch * n), "--hidden", str(args.hidden)]
    argv += ["--lr", str(args.lr), "--epochs", str(args.epochs), "--digest-every", "0"]
    fragments = args.fragments if mode.streaming else 1
    if mode.diloco:
        argv += ["--diloco", str(args.diloco), "--outer-lr", str(args.outer_lr)]
        argv += ["--outer-momentum", str(args.outer_momentum), "--fragments", str(fragments)]
        argv += ["--overlap"] if mode.overlap else []
    # only host 0 measures accuracy (the bench reads its records): an evaluation on every
    # host would cost N times the CPU the hosts share on this machine, for nothing; DiLoCo's
    # once per H inner steps (every round; streaming: every F steps of H/F)
    every = (fragments if mode.diloco else args.eval_every) if i == 0 else 0
    return [*argv, "--eval-every", str(every)]


def _run(lan: Any, mode: Mode, tag: str, args: argparse.Namespace, script: Path) -> dict[str, Any]:
    """One training run of every host, until host 0's accuracy reaches the target (or the end
    with ``--full``); host 0's records, stamped on arrival."""
    procs = []
    logs: list[Any] = []  # --log-dir: the hosts' stderr files
    for i in range(args.procs):
        out = subprocess.PIPE if i == 0 else subprocess.DEVNULL
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        argv = _argv(mode, i, tag, lan, args, script)
        err: Any = subprocess.DEVNULL
        if args.log_dir:  # (each host's stderr, for a run that fails)
            Path(args.log_dir).mkdir(parents=True, exist_ok=True)
            err = open(Path(args.log_dir) / f"{tag}-h{i}.log", "w")  # noqa: SIM115
            logs.append(err)
        procs.append(lan.popen(i, argv, stdout=out, stderr=err, text=True, env=env))
    records: list[tuple[float, dict[str, Any]]] = []
    final: list[str] = []
    hit = threading.Event()

    def read() -> None:
        assert procs[0].stdout is not None
        evals: list[tuple[float, int, float]] = []
        for line in procs[0].stdout:
            if line.startswith("FTMESH "):
                try:
                    record = json.loads(line[len("FTMESH ") :])
                except ValueError:
                    continue
                records.append((time.monotonic(), record))
                if "accuracy" in record and "step" in record:
                    evals.append((0.0, int(record["step"]), float(record["accuracy"])))
                    if not args.full and _reached(evals, args.target, SMOOTH) is not None:
                        hit.set()
            elif line.startswith("test accuracy:"):
                final.append(line.split(":", 1)[1].strip())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + RUN_TIMEOUT
    stopped = False
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if hit.wait(0.2):
                stopped = True  # the target is reached: the rest of the run measures nothing
                break
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)
        for log in logs:
            log.close()
    reader.join(10)
    if not stopped and any(p.returncode for p in procs):
        raise SystemExit(f"a {mode.name} training run failed: {[p.returncode for p in procs]}")
    steps = [(t, r) for t, r in records if "step" in r and "done" not in r]
    if len(steps) < 2:
        raise SystemExit(f"the {mode.name} run reported {len(steps)} steps")
    # the mean step time (streaming's steps alternate between fragments of other sizes)
    per_step = (steps[-1][0] - steps[0][0]) / (len(steps) - 1)
    t0 = steps[0][0] - per_step  # the first step's start, estimated
    evals = [(t - t0, int(r["step"]), float(r["accuracy"])) for t, r in steps if "accuracy" in r]
    k = _reached(evals, args.target, SMOOTH)
    first = _reached(evals, args.target, 1)
    inner = args.diloco // (args.fragments if mode.streaming else 1) if mode.diloco else 1
    samples = args.batch * args.procs * inner
    last = steps[-1][1]
    return {
        "time_to_target_s": evals[k][0] if k is not None else None,
        "first_hit_s": evals[first][0] if first is not None else None,
        "steps_to_target": evals[k][1] if k is not None else None,
        "samples_to_target": evals[k][1] * samples if k is not None else None,
        "ms_per_step": 1000 * per_step,
        "steps": int(last["step"]),
        "last_accuracy": evals[-1][2] if evals else None,
        "final_accuracy": float(final[-1]) if final else None,
        "stopped_at_target": stopped,
        "retries": sum(int(r.get("attempts", 1)) - 1 for _, r in steps),
        "curve": [[step, round(t, 3), round(acc, 4)] for t, step, acc in evals],
    }


def _milliseconds(text: str) -> float | None:
    """``"50ms"``, ``"50"`` (ms) or ``"0.05s"`` in milliseconds (``None``: not a duration)."""
    s = text.strip().lower()
    scale = 1000.0 if s.endswith("s") and not s.endswith("ms") else 1.0
    try:
        value = float(s.removesuffix("ms").removesuffix("s")) * scale
    except ValueError:
        return None
    return value if value >= 0 else None


def _median(xs: list[float | None]) -> float | None:
    got = [x for x in xs if x is not None]
    return statistics.median(got) if len(got) == len(xs) and got else None


def main(argv: list[str] | None = None) -> int:
    doc = __doc__.split("\n")[0]
    ap = argparse.ArgumentParser(prog="ftmesh bench convergence", description=doc)
    ap.add_argument("--procs", type=int, default=4, help="lab hosts, one worker each")
    ap.add_argument(
        "--link-rate",
        default="20mbit",
        help="tc rate of every link, or with --sites of the WAN link (none: unlimited)",
    )
    ap.add_argument(
        "--sites",
        default=None,
        metavar="AxB",
        help="two sites of A and B hosts joined by one WAN link (--procs is A+B)",
    )
    ap.add_argument(
        "--delay", default="0ms", help="with --sites: the WAN link's one-way delay (50ms)"
    )
    ap.add_argument(
        "--modes",
        default=",".join(MODES),
        help=f"comma-separated, run in this order: {', '.join(MODES)}",
    )
    ap.add_argument("--target", type=float, default=0.9, help="test accuracy to reach")
    ap.add_argument("--hidden", type=int, default=16384, help="the example's --hidden")
    ap.add_argument("--batch", type=int, default=32, help="samples per member per (inner) step")
    ap.add_argument("--lr", type=float, default=0.05, help="the (inner) optimizer's lr")
    ap.add_argument("--diloco", type=int, default=8, metavar="H", help="inner steps per round")
    ap.add_argument(
        "--fragments", type=int, default=2, help="streaming: fragments (a divisor of H)"
    )
    ap.add_argument("--outer-lr", type=float, default=0.7)
    ap.add_argument("--outer-momentum", type=float, default=0.5)
    ap.add_argument("--epochs", type=int, default=30, help="the longest a run trains")
    ap.add_argument("--eval-every", type=int, default=5, help="steps between accuracy checks")
    ap.add_argument("--full", action="store_true", help="train every run to the end")
    ap.add_argument("--repeats", type=int, default=1, help="runs per mode")
    ap.add_argument("--script", default=None, help="the example (default: examples/ here)")
    ap.add_argument("--log-dir", default=None, help="write each host's stderr here")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    script = Path(args.script) if args.script else _example()
    if not script.is_file():
        ap.error(f"{script} not found: give --script PATH/train_digits.py")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        ap.error(f"--modes: unknown {unknown}; known: {', '.join(MODES)}")
    streams = {"streaming", "overlap", "overlap-int8"} & set(modes)
    if streams and (args.fragments < 1 or args.diloco % args.fragments):
        ap.error(f"--fragments {args.fragments} must divide --diloco {args.diloco}")
    rate = None if args.link_rate == "none" else args.link_rate
    delay_ms = _milliseconds(args.delay)
    if delay_ms is None:
        ap.error(f"--delay {args.delay!r}: give milliseconds, like 50ms")
    sites: list[int] = []
    if args.sites:
        try:
            sites = [int(x) for x in args.sites.lower().split("x")]
        except ValueError:
            sites = []
        if len(sites) != 2 or min(sites) < 1:
            ap.error(f"--sites {args.sites!r}: give two host counts, like 2x2")
        args.procs = sum(sites)
    elif delay_ms:
        ap.error("--delay is the WAN link's: it needs --sites")
    if any(MODES[m].diloco for m in modes) and args.batch * args.procs * args.diloco > 1437:
        ap.error("a round (--batch x --procs x --diloco) must fit the 1437 training digits")
    from ..lab.netns import VirtualLan
    from ..lab.wan import WanLink

    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    lab = (
        VirtualLan(sites=sites, wan=WanLink(rate=rate, delay_ms=delay_ms))
        if sites
        else VirtualLan(hosts=args.procs)
    )
    with lab as lan:
        for i in range(args.procs):
            if rate is not None and not sites:
                lan.set_rate(i, rate)
        for rep in range(args.repeats):
            order = modes if rep % 2 == 0 else modes[::-1]
            for name in order:
                tag = f"{os.getpid()}x{rep}{name.replace('-', '')}"
                runs[name].append(_run(lan, MODES[name], tag, args, script))
                if not args.json:
                    shown = {k: v for k, v in runs[name][-1].items() if k != "curve"}
                    print(f"{name} #{rep}: {shown}", file=sys.stderr)
    summary: dict[str, Any] = {}
    for name, rs in runs.items():
        summary[name] = {
            key: _median([r[key] for r in rs])
            for key in ("time_to_target_s", "first_hit_s", "steps_to_target", "ms_per_step")
        }
        summary[name]["runs"] = rs
    ratios: dict[str, float | None] = {}
    for name in modes:
        if not MODES[name].diloco:
            continue
        for base in modes:
            if MODES[base].diloco:
                continue
            mine, theirs = summary[name]["time_to_target_s"], summary[base]["time_to_target_s"]
            ratios[f"{name}/{base}"] = theirs / mine if mine and theirs else None
    out = {
        "benchmark": "convergence",
        "procs": args.procs,
        "link_rate": args.link_rate,
        "sites": args.sites,
        "delay_ms": delay_ms,
        "target": args.target,
        "hidden": args.hidden,
        "batch": args.batch,
        "diloco": args.diloco,
        "modes": summary,
        "ratios": ratios,
    }
    if args.json:
        print(json.dumps(out))
    else:
        for name in modes:
            s = summary[name]
            unit = "round" if MODES[name].diloco and not MODES[name].streaming else "step"
            print(
                f"{name:>12}: {s['time_to_target_s']} s to {args.target} "
                f"({s['steps_to_target']} {unit}s), {s['ms_per_step']:.0f} ms/{unit}"
            )
        for key, ratio in ratios.items():
            text = f"{ratio:.2f}x" if ratio else "n/a (a mode missed the target)"
            print(f"{key}: {text} faster to the target")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
