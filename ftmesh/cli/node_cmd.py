"""``ftmesh node``: run one member, print its membership events, leave on SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from typing import Any

import trio

from ..logs import event_record
from ..net.node import Node, NodeConfig, open_node
from .args import settings_from_args
from .escape import shown


def node_config_from_args(args: argparse.Namespace) -> NodeConfig:
    """Flags over ``FTMESH_*`` over the defaults (``local`` discovery), see ``ftmesh.settings``."""
    return settings_from_args(args, os.environ).node_config()


def _emit(fmt: str, record: dict[str, Any]) -> None:
    if fmt == "json":
        sys.stdout.write(json.dumps(record, separators=(",", ":")) + "\n")
        sys.stdout.flush()
    else:
        print(
            f"{record['event']:>8} {shown(record['name'])} {record['addr']}"
            f" inc={record['incarnation']}",
            file=sys.stderr,
            flush=True,
        )


async def _print_events(node: Node, fmt: str) -> None:
    async for ev in node.events(replay=True):
        # Events about ourselves (a refutation raised our incarnation) print as "self".
        kind = "self" if ev.member.node == node.node_id else ev.kind
        _emit(fmt, event_record(kind, ev.member))


async def _amain(config: NodeConfig, fmt: str) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with open_node(config) as node, trio.open_nursery() as nursery:
            me = event_record("self", node.me())
            if node.metrics_address is not None:
                me["metrics"] = "{}:{}".format(*node.metrics_address)
            _emit(fmt, me)
            nursery.start_soon(_print_events, node, fmt)
            async for _ in signals:
                break
            nursery.cancel_scope.cancel()
        if fmt == "json":
            # Last words: the drop and protocol counters, for tests and operators.
            _emit(
                fmt,
                {
                    "event": "stats",
                    "node": node.node_id,
                    "counters": node.statistics(),
                    "time": round(time.time(), 6),
                },
            )


def run_node(args: argparse.Namespace) -> int:
    config = node_config_from_args(args)
    trio.run(_amain, config, args.events)
    return 0
