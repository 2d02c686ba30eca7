"""``ftmesh bench ...``: dispatch to the benchmark implementations."""

from __future__ import annotations

import argparse
import json


def run_bench(args: argparse.Namespace) -> int:
    if args.bench == "membership":
        from ..sim.bench import format_report, run_membership_bench

        report = run_membership_bench(
            nodes=args.nodes,
            loss=args.loss,
            preset=args.preset,
            duration=args.duration,
            crashes=args.crashes,
            seed=args.seed,
            joins=args.joins,
        )
        print(json.dumps(report.as_dict()) if args.json else format_report(report))
        return 0
    if args.bench == "kill":
        from ..bench.kill import format_kill_report, run_kill_bench

        result = run_kill_bench(procs=args.procs, rounds=args.rounds, preset=args.preset)
        print(json.dumps(result) if args.json else format_kill_report(result))
        return 0
    raise AssertionError(args.bench)
