"""Argument parsing for ``ftmesh``; each subcommand lives in its own module.

Every command that finds or joins a mesh adds its flags with :func:`add_settings_args` and
reads them with :func:`settings_from_args`, so ``--port`` (say) means the same everywhere and
the environment (``FTMESH_PORT``) fills what the flags leave out (``ftmesh.settings``).
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
from collections.abc import Mapping
from typing import Any, NoReturn

from ..errors import FtmeshError, LocalUsageError
from ..logs import LOG_FORMATS, LOG_LEVELS
from ..membership.config import PRESETS
from ..mesh.blocking import root_cause
from ..settings import DISCOVERY_KINDS, Settings, parse_meta


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line (argparse prints the usage first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


_FLAGS: dict[str, dict[str, Any]] = {
    "mesh": {"metavar": "NAME", "help": "mesh name (default: default)"},
    "discovery": {
        "choices": DISCOVERY_KINDS,
        "help": "how to find members: local (same host, no multicast), seeds (the --join "
        "list), mdns (LAN multicast), none (default: %s; seeds with --join)",
    },
    "join": {
        "action": "append",
        "metavar": "HOST:PORT",
        "help": "a member (or a DNS name resolving to several) to join through; repeatable",
    },
    "interface": {
        "metavar": "IP|NAME",
        "help": "for mdns: the interface to announce and browse on (default: the one behind "
        "the default route); otherwise the address to bind",
    },
    "bind": {
        "metavar": "IP",
        "help": "address to bind gossip, data plane and state server to (default: the mDNS "
        "interface; for seeds the LAN address, loopback when every seed is loopback; for "
        "local 127.0.0.1); 0.0.0.0 binds all and advertises the default",
    },
    "advertise": {"metavar": "IP", "help": "address peers reach us on (default: the bound one)"},
    "port": {"type": int, "metavar": "PORT", "help": "gossip port, UDP and TCP (default: any)"},
    "preset": {"choices": PRESETS, "help": "membership timing preset (default: %s)"},
    "secret_file": {
        "metavar": "FILE",
        "help": "file with the mesh secret (one per line; the first signs, all verify); "
        "default: $FTMESH_SECRET, else no authentication",
    },
    "encrypt": {
        "action": argparse.BooleanOptionalAction,
        "help": "also encrypt gossip and the data plane (AES-256-GCM; needs a secret; every "
        "member must agree)",
    },
    "registry_dir": {"help": argparse.SUPPRESS},
    "name": {"metavar": "NAME", "help": "human name (default: hostname-pid)"},
    "meta": {"action": "append", "metavar": "KEY=VALUE", "help": "member metadata; repeatable"},
    "start_peers": {
        "type": int,
        "metavar": "N",
        "help": "a fresh mesh takes its first step once N members are ready; after "
        "--start-timeout more than half of them start, fewer exit with an error (default: %s)",
    },
    "start_timeout": {
        "type": float,
        "metavar": "S",
        "help": "seconds to wait for the start peers (default: 60)",
    },
    "metrics_port": {
        "type": int,
        "metavar": "PORT",
        "help": "serve Prometheus metrics at http://BIND:PORT/metrics (0: any free port; "
        "needs ftmesh[metrics]; launch: worker k gets PORT+k); default: off",
    },
    "log_level": {
        "choices": LOG_LEVELS,
        "help": "level of ftmesh's log on stderr (default: warning; -v info, -vv debug)",
    },
    "log_format": {
        "choices": LOG_FORMATS,
        "help": "log as text (default), or json: one object per line, for log collectors",
    },
}
"""The flag of every user setting (``ftmesh.settings.Settings``); ``%s`` in a help text is
filled with the command's default."""

MESH_FLAGS = (
    "mesh", "discovery", "join", "interface", "secret_file", "encrypt", "registry_dir",
    "log_level", "log_format",
)  # fmt: skip
"""What every command that talks to a mesh takes."""
MEMBER_FLAGS = (*MESH_FLAGS, "bind", "advertise", "port", "preset", "metrics_port")
"""What a member of a mesh takes besides."""


def add_settings_args(p: argparse.ArgumentParser, names: tuple[str, ...], **defaults: Any) -> None:
    """Add the flags of settings ``names``; ``defaults`` fill the ``%s`` of their help."""
    for name in names:
        spec = dict(_FLAGS[name])
        if "%s" in spec.get("help", ""):
            spec["help"] = spec["help"] % defaults.get(name, "none")
        p.add_argument(f"--{name.replace('_', '-')}", dest=name, default=None, **spec)


def settings_from_args(
    args: argparse.Namespace, environ: Mapping[str, str], **defaults: Any
) -> Settings:
    """The command's ``defaults``, then the environment, then the flags given."""
    explicit: dict[str, Any] = {}
    for name in _FLAGS:
        value = getattr(args, name, None)
        if name == "meta" and value is not None:
            value = parse_meta(value)
        explicit[name] = value
    return Settings(**defaults).over(Settings.from_env(environ)).replace(**explicit)


def installed_version() -> str:
    """The version of the installed distribution (the package's own when not installed)."""
    try:
        return importlib.metadata.version("ftmesh")
    except importlib.metadata.PackageNotFoundError:
        from .. import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="ftmesh", description="Peer-to-peer fault-tolerant training mesh.")
    parser.add_argument("-v", "--verbose", action="count", default=0)
    parser.add_argument("--version", action="version", version=f"ftmesh {installed_version()}")
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
    mem.add_argument("--json", action="store_true")
    # Listed for --help only; run() hands these to their own parsers.
    bench_sub.add_parser("allreduce", help="CPU ring allreduce vs gloo and a raw TCP ring")
    bench_sub.add_parser(
        "convergence", help="time-to-accuracy on slow lab links, with and without int8"
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


DELEGATED_BENCHES = ("allreduce", "convergence", "recovery", "stragglers", "train")
"""Benchmarks with their own argument parsers: ``ftmesh bench NAME ...`` runs
``ftmesh.bench.NAME.main(...)`` with the rest of the command line."""


def run(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) >= 2 and argv[0] == "bench" and argv[1] in DELEGATED_BENCHES:
        import importlib

        return int(importlib.import_module(f"ftmesh.bench.{argv[1]}").main(argv[2:]))
    args = build_parser().parse_args(argv)
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
