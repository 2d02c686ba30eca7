"""Argument parsing for ``ftmesh``; each subcommand lives in its own module."""

from __future__ import annotations

import argparse
import logging
import sys

from ..errors import FtmeshError
from ..membership.config import PRESETS


def add_mesh_args(p: argparse.ArgumentParser) -> None:
    """Options shared by every command that finds or joins a mesh."""
    p.add_argument("--mesh", default="default", help="mesh name (default: %(default)s)")
    p.add_argument(
        "--discovery",
        choices=["local", "seeds", "mdns", "none"],
        default="local",
        help="how to find members: local (same host, no multicast), seeds (--join list), "
        "mdns (LAN multicast), none (default: %(default)s)",
    )
    p.add_argument(
        "--join",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="a member (or DNS name resolving to several) to join through; repeatable",
    )
    p.add_argument(
        "--interface",
        default="",
        metavar="IP",
        help="for mdns: IPv4 address of the interface to announce and browse on",
    )
    p.add_argument(
        "--secret-file",
        default=None,
        help="file with the mesh secret (one per line; the first signs, all verify); "
        "default: $FTMESH_SECRET, else no authentication",
    )
    p.add_argument(
        "--encrypt",
        action="store_true",
        default=None,
        help="also encrypt gossip and the data plane (AES-256-GCM; needs a secret; every "
        "member must agree); default: $FTMESH_ENCRYPT, else off",
    )
    p.add_argument("--registry-dir", default="", help=argparse.SUPPRESS)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ftmesh", description="Peer-to-peer fault-tolerant training mesh."
    )
    parser.add_argument("-v", "--verbose", action="count", default=0)
    sub = parser.add_subparsers(dest="command", required=True)

    node = sub.add_parser("node", help="run a mesh member until SIGINT/SIGTERM")
    add_mesh_args(node)
    node.add_argument("--name", default="", help="human name (default: hostname-pid)")
    node.add_argument(
        "--bind",
        default="",
        metavar="IP",
        help="address to bind (default: 127.0.0.1, or --interface for mdns)",
    )
    node.add_argument(
        "--advertise",
        default="",
        metavar="IP",
        help="address peers reach us on (default: the bind address)",
    )
    node.add_argument("--port", type=int, default=0, help="gossip port, 0 = any free port")
    node.add_argument(
        "--preset",
        choices=PRESETS,
        default="lan",
        help="membership timing preset (default: %(default)s)",
    )
    node.add_argument(
        "--meta",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="member metadata entry; repeatable",
    )
    node.add_argument(
        "--events",
        choices=["json", "text"],
        default="text",
        help="print membership events as JSON lines on stdout, or as text",
    )

    status = sub.add_parser("status", help="find a mesh and print its members")
    add_mesh_args(status)
    status.add_argument("--json", action="store_true", help="print JSON instead of a table")
    status.add_argument("--timeout", type=float, default=3.0, help="seconds to search")

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
    mem.add_argument("--json", action="store_true")
    # Listed for --help only; run() hands these to their own parsers.
    bench_sub.add_parser("allreduce", help="CPU ring allreduce vs gloo and a raw TCP ring")
    bench_sub.add_parser("recovery", help="kill/SIGSTOP -> next committed step, vs torchrun")
    bench_sub.add_parser("train", help="step time of the gradient sync vs DDP on gloo")
    kill = bench_sub.add_parser("kill", help="real processes: kill -9 to the last dead event")
    kill.add_argument("--procs", type=int, default=8)
    kill.add_argument("--rounds", type=int, default=10)
    kill.add_argument("--preset", choices=PRESETS, default="local")
    kill.add_argument("--json", action="store_true")
    return parser


DELEGATED_BENCHES = ("allreduce", "recovery", "train")
"""Benchmarks with their own argument parsers: ``ftmesh bench NAME ...`` runs
``ftmesh.bench.NAME.main(...)`` with the rest of the command line."""


def run(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) >= 2 and argv[0] == "bench" and argv[1] in DELEGATED_BENCHES:
        import importlib

        return int(importlib.import_module(f"ftmesh.bench.{argv[1]}").main(argv[2:]))
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING - 10 * min(args.verbose, 2),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    try:
        if args.command == "node":
            from .node_cmd import run_node

            return run_node(args)
        if args.command == "status":
            from .status_cmd import run_status

            return run_status(args)
        if args.command in ("launch", "worker"):
            from .launch_cmd import run_launch, run_worker

            return run_launch(args) if args.command == "launch" else run_worker(args)
        if args.command == "lab":
            from .lab_cmd import run_lab

            return run_lab(args)
        if args.command == "bench":
            from .bench_cmd import run_bench

            return run_bench(args)
        if args.command == "checkpoint":
            from .checkpoint_cmd import run_checkpoint

            return run_checkpoint(args)
    except FtmeshError as exc:
        print(f"ftmesh: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 2
