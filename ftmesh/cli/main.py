"""Argument parsing for ``ftmesh``; each subcommand lives in its own module, the flags they
share in ``args`` (:func:`add_settings_args`, :func:`settings_from_args`).

Errors reach the user as one line on stderr with exit status 2: a bad flag (argparse, see
:class:`Parser`) and any ``FtmeshError``; a ``ConfigError`` names the setting and the fix,
any other error is prefixed with its class (``StateLostError: ...``); ``-v`` adds the
traceback.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys
import traceback

from ..errors import FtmeshError, LocalUsageError
from ..membership.config import PRESETS
from ..mesh.blocking import root_cause
from ..settings import Settings
from .args import MEMBER_FLAGS, MESH_FLAGS, Parser, add_settings_args


def installed_version() -> str:
    """The version of the installed distribution (the package's own when not installed)."""
    try:
        return importlib.metadata.version("ftmesh")
    except importlib.metadata.PackageNotFoundError:
        from .. import __version__

        return __version__


def _top_parser() -> argparse.ArgumentParser:
    """The parser of ``ftmesh`` without its subcommands: the top-level flags."""
    parser = Parser(prog="ftmesh", description="Peer-to-peer fault-tolerant training mesh.")
    parser.add_argument("-v", "--verbose", action="count", default=0)
    parser.add_argument("--version", action="version", version=f"ftmesh {installed_version()}")
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = _top_parser()
    sub = parser.add_subparsers(dest="command", required=True)

    node = sub.add_parser("node", help="run a mesh member until SIGINT/SIGTERM")
    add_settings_args(node, (*MEMBER_FLAGS, "name", "meta"), discovery="local", preset="lan")
    node.add_argument(
        "--events",
        choices=["json", "text"],
        default="text",
        help="print membership events as JSON lines on stdout, or as text",
    )

    status = sub.add_parser("status", help="find a mesh and print its members")
    add_settings_args(status, MESH_FLAGS, discovery="local")
    status.add_argument("--json", action="store_true", help="print JSON instead of a table")
    status.add_argument("--timeout", type=float, default=3.0, help="seconds to search")
    status.add_argument(
        "--watch",
        action="store_true",
        help="redraw the members' progress (step, step time, share, samples/s, world, backend,"
        " last fault) until Ctrl-C",
    )
    status.add_argument(
        "--interval", type=float, default=1.0, metavar="S", help="seconds between --watch reads"
    )
    status.add_argument(
        "--count", type=int, default=0, metavar="N", help="--watch: stop after N reads (0: never)"
    )

    from .checkpoint_cmd import add_checkpoint_parser
    from .lab_cmd import add_lab_parser
    from .launch_cmd import add_launch_parser

    add_launch_parser(sub)
    add_lab_parser(sub)
    add_checkpoint_parser(sub)

    bench = sub.add_parser("bench", help="benchmarks that print ratios against a peer")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    mem = bench_sub.add_parser("membership", help="SWIM on the deterministic simulator")
    mem.add_argument("--nodes", type=int, default=1000)
    mem.add_argument("--loss", type=float, default=0.01, help="packet loss probability")
    mem.add_argument("--preset", choices=PRESETS, default="lan")
    mem.add_argument("--duration", type=float, default=60.0, help="simulated seconds")
    mem.add_argument("--crashes", type=int, default=10, help="members crashed during the run")
    mem.add_argument("--seed", type=int, default=1)
    mem.add_argument(
        "--joins",
        choices=("batch", "storm"),
        default="batch",
        help="members start knowing each other (batch, default) or join one by one (storm)",
    )
    mem.add_argument("--json", action="store_true")
    # Listed for --help only; run() hands these to their own parsers.
    bench_sub.add_parser("allreduce", help="CPU ring allreduce vs gloo and a raw TCP ring")
    bench_sub.add_parser(
        "convergence", help="time-to-accuracy on slow lab links: sync vs DiLoCo, float32 vs int8"
    )
    bench_sub.add_parser(
        "insider", help="honest step rate with a header-lying member vs a clean run (#26)"
    )
    bench_sub.add_parser("recovery", help="kill/SIGSTOP -> next committed step, vs torchrun")
    bench_sub.add_parser(
        "stragglers", help="one slow member: equal vs proportional shares vs evicted vs default"
    )
    bench_sub.add_parser("train", help="step time of the gradient sync vs DDP on gloo")
    kill = bench_sub.add_parser("kill", help="real processes: kill -9 to the last dead event")
    kill.add_argument("--procs", type=int, default=8)
    kill.add_argument("--rounds", type=int, default=10)
    kill.add_argument("--preset", choices=PRESETS, default="local")
    kill.add_argument("--json", action="store_true")
    return parser


def command_of(argv: list[str]) -> str | None:
    """The subcommand ``argv`` names: its first word after the top-level ``-v`` flags
    (``None`` for anything else: ``--help``, ``--version``, an unknown flag)."""
    for word in argv:
        if word == "--verbose" or (len(word) > 1 and word.strip("v") == "-"):
            continue
        return None if word.startswith("-") else word
    return None


def worker_parser() -> argparse.ArgumentParser:
    """:func:`build_parser` with the ``worker`` subcommand only: what every process of
    ``ftmesh launch`` parses. The other subcommands' parsers import their modules (the lab,
    checkpoint export, the launcher and its live view), which a worker never runs and which
    would delay its first step (a joiner's start-up, issue #30); the worker's flags, help
    and errors are the same as through the whole parser."""
    from .worker_cmd import add_worker_parser

    parser = _top_parser()
    add_worker_parser(parser.add_subparsers(dest="command", required=True))
    return parser


DELEGATED_BENCHES = ("allreduce", "convergence", "insider", "recovery", "stragglers", "train")
"""Benchmarks with their own argument parsers: ``ftmesh bench NAME ...`` runs
``ftmesh.bench.NAME.main(...)`` with the rest of the command line."""


def run(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) >= 2 and argv[0] == "bench" and argv[1] in DELEGATED_BENCHES:
        import importlib

        return int(importlib.import_module(f"ftmesh.bench.{argv[1]}").main(argv[2:]))
    parser = worker_parser() if command_of(argv) == "worker" else build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command != "worker":  # a worker's script logs through its connect()
            verbose = ("info", "debug")[min(args.verbose, 2) - 1] if args.verbose else None
            logged = Settings.from_env(os.environ).replace(
                log_level=getattr(args, "log_level", None) or verbose,
                log_format=getattr(args, "log_format", None),
            )
            logged.configure_logging()
        if args.command == "node":
            from .node_cmd import run_node

            return run_node(args)
        if args.command == "status":
            from .status_cmd import run_status

            return run_status(args)
        if args.command == "launch":
            from .launch_cmd import run_launch

            return run_launch(args)
        if args.command == "worker":
            from .worker_cmd import run_worker

            return run_worker(args)
        if args.command == "lab":
            from .lab_cmd import run_lab

            return run_lab(args)
        if args.command == "bench":
            from .bench_cmd import run_bench

            return run_bench(args)
        if args.command == "checkpoint":
            from .checkpoint_cmd import run_checkpoint

            return run_checkpoint(args)
    except (FtmeshError, BaseExceptionGroup) as exc:
        cause = root_cause(exc)  # trio groups the errors of a nursery's tasks
        if not isinstance(cause, FtmeshError):
            raise
        if args.verbose:
            traceback.print_exc()
        # A setting at fault speaks for itself; any other error says what it is.
        kind = "" if isinstance(cause, LocalUsageError) else f"{type(cause).__name__}: "
        print(f"ftmesh: error: {kind}{' '.join(str(cause).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 2
