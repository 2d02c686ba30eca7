"""``ftmesh bench stragglers``: throughput of the same training with one member slowed to
1/``--slow-factor`` of its speed, under four straggler policies, in one run.

Theory of operation: ``--procs`` N local processes (multiprocessing, spawn, one torch thread
each) run every policy in turn, each on a fresh mesh of its own (same-host discovery, ``local``
preset, traffic on loopback only, ``start_peers`` N): the digits CNN of
``ftmesh.bench.workloads`` on synthetic 8x8 data with the loop API, ``--steps`` committed steps
of ``--global-batch`` samples, from the same initial weights. The global batch defaults to
2048 (512 samples a member at N=4), so that compute outweighs the step's fixed cost: with 16
a member (a global batch of 64) a member's forward and backward take about 2 ms, most of it
fixed per-call cost, against a step overhead of 10-20 ms on this 2-core host, so how the
batch is split hardly matters (proportional/equal at ``--slow-factor 4``: 1.26 at 64,
1.2-2.3 at 512, 2.06 at 2048; single runs on a loaded host). The policies are
:class:`~ftmesh.training.config.TrainerConfig` settings:

* ``equal``: ``shares="equal"``, straggler handling off;
* ``proportional``: ``shares="speed"``, straggler handling off;
* ``evicted``: ``shares="equal"``, ``max_peers=N-1``: the slow member is a hot spare from
  the first step (it applies every step but computes nothing), straggler handling off;
* ``default``: ``TrainerConfig()``, the shipped policy, nothing overridden.

("straggler handling off" is ``straggler_factor=0``.) The slow member is the view's last
rank at the first step (``step.rank == step.world_size - 1``): that is the member
``max_peers`` makes the spare, so the ``evicted`` run evicts the slow one, and the same rule
picks it in every policy.

Slowness is emulated with sleep, not CPU throttling: this bench runs N workers on a machine
of few cores, and a throttled process would still compete for them. After each micro-batch's
forward and backward the slow member sleeps ``slow_factor - 1`` times the wall time that
forward and backward took, so its compute takes ``slow_factor`` times as long and leaves the
cores to the others: the speed of a slower machine, with no extra load on this one.

Every member records, per committed step, the time (``time.monotonic()``, one clock for all
processes of the host), its share (samples it computed; 0: spare or evicted) and whether it
adopted the step. A step's time is the latest commit among the members; throughput is
samples of committed steps per second: ``samples_per_s``/``ms_per_step`` in steady state
(the steps after ``--warmup``: the time the default's straggler rule needs to see and evict
the slow member), ``whole_samples_per_s`` over the whole run (from the first step's start).
Ratios (same run, so machine load hits every policy): ``proportional_vs_equal``,
``evicted_vs_equal`` and ``default_vs_best`` (the default over the best of the other three).
The policies run one after the other, so load from other work on the host still skews them
(on a shared 2-core host a policy's throughput moves by 1.5x from one run to the next):
``--repeats K`` runs each policy K times, in ``POLICIES`` order and reversed every other
repeat, and reports medians (each run under ``runs``, each repeat's ratios under
``repeat_ratios``); the JSON carries the load average before and after. A worker that
dies, or a run past ``--timeout``, ends the bench with a one-line error and exit status 1,
every process killed. ``--plot FILE.png`` also draws, per policy, the slow member's share of
each step and each step's time (``ftmesh.bench.plots.plot_stragglers``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

from ..errors import FtmeshError
from . import host_stamp
from .plots import plot_path_error, plot_stragglers

POLICIES = ("equal", "proportional", "evicted", "default")
DATASET_STEPS = 64
"""Steps per epoch of the synthetic data set (its size is this many global batches)."""
RESULT_GRACE = 30.0
"""Seconds the processes get to exit after reporting before they are killed."""


class BenchFailed(FtmeshError):
    """A policy's run did not complete (a worker died, or it ran past ``--timeout``)."""


def policy_settings(policy: str, nprocs: int) -> dict[str, Any]:
    """The ``TrainerConfig`` overrides of ``policy`` on a mesh of ``nprocs``."""
    off: dict[str, Any] = {"straggler_factor": 0.0}
    if policy == "equal":
        return {"shares": "equal", **off}
    if policy == "proportional":
        return {"shares": "speed", **off}
    if policy == "evicted":
        return {"shares": "equal", "max_peers": nprocs - 1, **off}
    if policy == "default":
        return {}
    raise AssertionError(policy)


def _train(policy: str, mesh_name: str, cfg: dict[str, Any], x: Any, y: Any) -> dict[str, Any]:
    """One member's run of ``policy`` on a fresh mesh: its records."""
    import torch
    import torch.nn.functional as F

    import ftmesh
    from ftmesh.bench.workloads import make_model, make_optimizer
    from ftmesh.torch import ElasticSampler, ElasticTrainer
    from ftmesh.training.config import TrainerConfig

    nprocs = cfg["procs"]
    model = make_model("digits", seed=0)
    optimizer = make_optimizer(model)
    sampler = ElasticSampler(len(x), cfg["global_batch"], seed=0)
    pause = cfg["slow_factor"] - 1.0
    slow: bool | None = None
    began = 0.0
    steps: list[dict[str, Any]] = []  # one per committed step
    with ftmesh.connect(
        mesh=mesh_name,
        discovery="local",
        preset="local",
        registry_dir=cfg["registry"],
        start_peers=nprocs,
    ) as mesh:
        settings = TrainerConfig(**cfg["settings"][policy])
        trainer = ElasticTrainer(mesh, model, optimizer, sampler, config=settings)
        for step in trainer.steps(cfg["steps"]):
            with step:
                if slow is None and step.world_size == nprocs:
                    slow = step.rank == nprocs - 1
                    began = time.monotonic()
                for part in step.indices():
                    t = time.perf_counter()
                    i = torch.from_numpy(part)
                    F.cross_entropy(model(x[i]), y[i]).backward()  # type: ignore[no-untyped-call]
                    if slow:
                        time.sleep(pause * (time.perf_counter() - t))
                optimizer.step()
            r = step.report
            if r is not None:
                steps.append(
                    {
                        "step": r.step,
                        "t": time.monotonic(),
                        "share": r.share,
                        "adopted": r.adopted,
                        "attempts": r.attempts,
                        "synced": r.synced,
                    }
                )
    return {"slow": bool(slow), "began": began, "steps": steps}


def _worker(index: int, cfg: dict[str, Any], out: Any) -> None:
    """One member: every policy in turn, each on a mesh of its own (one torch import)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    from ftmesh.bench.workloads import make_data

    torch.set_num_threads(1)
    x, y = make_data("digits", DATASET_STEPS * cfg["global_batch"], seed=0)
    for policy, repeat in cfg["runs"]:
        mesh_name = f"{cfg['mesh']}-{policy}-{repeat}"
        out.put(((policy, repeat), {"index": index, **_train(policy, mesh_name, cfg, x, y)}))


def run_policies(cfg: dict[str, Any], timeout: float) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """Every run of ``cfg["runs"]`` (policy, repeat), in order: the policy and its members'
    records. The same processes run all of them (each on a fresh mesh) and are killed on
    failure or when a run takes longer than ``timeout``."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    registry = tempfile.mkdtemp(prefix="ftmesh-bench-stragglers-")
    cfg = {**cfg, "registry": registry, "mesh": f"stragglers-{os.getpid()}"}
    nprocs = cfg["procs"]
    procs = [ctx.Process(target=_worker, args=(i, cfg, q), daemon=True) for i in range(nprocs)]
    for p in procs:
        p.start()
    done = False
    try:
        for run in cfg["runs"]:
            policy = run[0]
            results: list[dict[str, Any]] = []
            deadline = time.monotonic() + timeout
            while len(results) < nprocs:
                try:
                    got, result = q.get(timeout=1.0)
                except queue.Empty:
                    dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                    if dead:
                        raise BenchFailed(f"{policy}: a worker exited with {dead[0]}") from None
                    if time.monotonic() > deadline:
                        raise BenchFailed(
                            f"{policy}: not done after --timeout {timeout:g} s"
                        ) from None
                    continue
                if tuple(got) != tuple(run):
                    raise BenchFailed(f"{policy}: a worker reported {got} first")
                results.append(result)
            yield policy, sorted(results, key=lambda r: int(r["index"]))
        done = True
    finally:
        end = time.monotonic() + (RESULT_GRACE if done else 0.0)
        for p in procs:
            p.join(max(end - time.monotonic(), 0.1))
            if p.is_alive():
                p.kill()
                p.join(5)
        shutil.rmtree(registry, ignore_errors=True)


def summarise(policy: str, members: list[dict[str, Any]], cfg: dict[str, Any]) -> dict[str, Any]:
    """Throughput and shares of one policy's run from its members' records."""
    total, warmup = cfg["steps"], cfg["warmup"]
    commit: dict[int, float] = {}
    for m in members:
        for rec in m["steps"]:
            commit[rec["step"]] = max(commit.get(rec["step"], rec["t"]), rec["t"])
    missing = [k for k in range(1, total + 1) if k not in commit]
    if missing:
        raise BenchFailed(f"{policy}: no member committed step(s) {missing[:5]}")
    slow = [m for m in members if m["slow"]]
    if len(slow) != 1:
        raise BenchFailed(f"{policy}: {len(slow)} slow members (the view never had all?)")
    samples = cfg["global_batch"]  # every step is a full one (the data is whole batches)
    began = min(m["began"] for m in members)
    steady_s = commit[total] - commit[warmup]
    shares = {rec["step"]: rec["share"] for rec in slow[0]["steps"] if not rec["adopted"]}
    steady_shares = [v for k, v in shares.items() if k > warmup]
    return {
        "samples_per_s": samples * (total - warmup) / steady_s,
        "ms_per_step": 1e3 * steady_s / (total - warmup),
        "whole_samples_per_s": samples * total / (commit[total] - began),
        "steps": len(commit),
        "slow_member": int(slow[0]["index"]),
        "slow_shares": [shares.get(k, -1) for k in range(1, total + 1)],
        "step_ms": [round(1e3 * (commit[k] - commit[k - 1]), 2) for k in range(2, total + 1)],
        "slow_mean_share": sum(steady_shares) / max(len(steady_shares), 1),
        "evicted_steps": sum(1 for v in shares.values() if v == 0),
        "retries": max(sum(rec["attempts"] - 1 for rec in m["steps"]) for m in members),
        "retried_steps": sorted(
            {rec["step"] for m in members for rec in m["steps"] if rec["attempts"] > 1}
        ),
        "synced_steps": sorted(
            {rec["step"] for m in members for rec in m["steps"] if rec["synced"]} - {1}
        ),
    }


def run_order(repeats: int) -> list[tuple[str, int]]:
    """(policy, repeat) in the order they run: ``POLICIES``, reversed every other repeat,
    so that a trend in the machine's load hits every policy alike."""
    return [(p, k) for k in range(repeats) for p in (POLICIES if k % 2 == 0 else POLICIES[::-1])]


def combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One policy's figures over its repeats: medians (the runs themselves under ``runs``)."""
    med = {
        k: statistics.median(r[k] for r in runs)
        for k in ("samples_per_s", "ms_per_step", "whole_samples_per_s", "slow_mean_share")
    }
    return {
        **med,
        "evicted_steps": min(r["evicted_steps"] for r in runs),
        "steps": min(r["steps"] for r in runs),
        "retries": sum(r["retries"] for r in runs),
        "runs": runs,
    }


def ratios(rate: dict[str, float]) -> dict[str, float]:
    """The bench's ratios from each policy's samples per second."""
    return {
        "proportional_vs_equal": rate["proportional"] / rate["equal"],
        "evicted_vs_equal": rate["evicted"] / rate["equal"],
        "default_vs_best": rate["default"] / max(rate[p] for p in POLICIES if p != "default"),
    }


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    load_before = os.getloadavg()
    base = {
        "procs": args.procs,
        "global_batch": args.global_batch,
        "slow_factor": args.slow_factor,
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
    }
    settings = {p: policy_settings(p, args.procs) for p in POLICIES}
    cfg = {**base, "settings": settings, "runs": run_order(args.repeats)}
    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in POLICIES}
    t0 = time.monotonic()
    for policy, members in run_policies(cfg, args.timeout):
        runs[policy].append({**summarise(policy, members, cfg), "wall_s": time.monotonic() - t0})
        t0 = time.monotonic()
        print(f"done {policy}: {runs[policy][-1]['samples_per_s']:.0f} samples/s", file=sys.stderr)
    out: dict[str, Any] = {"benchmark": "stragglers", **base}
    for p in POLICIES:
        out[p] = {**combine(runs[p]), "settings": settings[p]}
    out.update(ratios({p: float(out[p]["samples_per_s"]) for p in POLICIES}))
    out["repeat_ratios"] = [
        ratios({p: float(runs[p][k]["samples_per_s"]) for p in POLICIES})
        for k in range(args.repeats)
    ]
    out.update(host_stamp(load_before))
    return out


def format_table(r: dict[str, Any]) -> str:
    lines = [
        f"N={r['procs']}, one member at 1/{r['slow_factor']:g} speed, global batch "
        f"{r['global_batch']}, {r['steps']} steps (steady state after {r['warmup']}), "
        f"median of {r['repeats']} run(s)",
        f"{'policy':>12} | {'samples/s':>9} {'ms/step':>8} | {'whole run':>9} | "
        f"{'slow share':>10} {'evicted':>7}",
    ]
    for p in POLICIES:
        c = r[p]
        lines.append(
            f"{p:>12} | {c['samples_per_s']:9.0f} {c['ms_per_step']:8.1f} | "
            f"{c['whole_samples_per_s']:9.0f} | {c['slow_mean_share']:10.1f} "
            f"{c['evicted_steps']:7d}"
        )
    lines.append(
        f"proportional/equal {r['proportional_vs_equal']:.2f}, evicted/equal "
        f"{r['evicted_vs_equal']:.2f}, default/best {r['default_vs_best']:.2f}; load "
        f"{r['load_before'][0]:.1f} -> {r['load_after'][0]:.1f}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    doc = __doc__.split("\n")[0]
    ap = argparse.ArgumentParser(prog="ftmesh bench stragglers", description=doc)
    ap.add_argument("--procs", type=int, default=4, help="members, one process each")
    ap.add_argument("--slow-factor", type=float, default=4.0, help="the slow member's slowdown")
    ap.add_argument("--steps", type=int, default=150, help="committed steps per policy")
    ap.add_argument("--warmup", type=int, default=40, help="steps before the steady state")
    ap.add_argument("--global-batch", type=int, default=2048, help="samples per step")
    ap.add_argument(
        "--repeats", type=int, default=1, help="runs of each policy (medians are reported)"
    )
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument(
        "--plot", metavar="FILE.png", help="also draw each policy's slow share and step time"
    )
    args = ap.parse_args(argv)
    if problem := plot_path_error(args.plot):  # before a run that takes minutes
        ap.error(problem)
    if args.procs < 2:
        ap.error("--procs must be >= 2 (one slow member and at least one other)")
    if not args.slow_factor >= 1:
        ap.error("--slow-factor must be >= 1")
    if not 0 < args.warmup < args.steps:
        ap.error("--warmup must be > 0 and below --steps")
    if args.global_batch < args.procs:
        ap.error("--global-batch must be at least --procs")
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    if not args.timeout > 0:
        ap.error("--timeout must be > 0")
    try:
        result = run_bench(args)
    except BenchFailed as exc:
        print(f"ftmesh bench stragglers: error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result) if args.json else format_table(result))
    if args.plot:
        plot_stragglers(result, args.plot)
        print(f"plot: {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
