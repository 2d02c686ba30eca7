"""``ftmesh node``: run one member, print its membership events, leave on SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from typing import Any

import trio

from ..errors import ConfigError
from ..membership.config import MembershipConfig
from ..membership.messages import MemberSnapshot, Meta, MetaValue
from ..net.node import Node, NodeConfig, open_node
from ..security import load_secrets


def parse_meta(items: list[str]) -> Meta:
    meta: Meta = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--meta expects KEY=VALUE, got {item!r}")
        value: MetaValue = raw
        if raw.lstrip("-").isdigit():
            value = int(raw)
        meta[key] = value
    return meta


def node_config_from_args(args: argparse.Namespace) -> NodeConfig:
    bind = args.bind
    if not bind and args.discovery == "mdns":
        # mDNS announces one interface's address: bind there (default: the default route's).
        from ..discovery import default_interface_ip

        bind = args.interface or default_interface_ip()
    return NodeConfig(
        mesh=args.mesh,
        name=args.name,
        bind=bind or "127.0.0.1",
        port=args.port,
        advertise=args.advertise,
        discovery=args.discovery,
        join=tuple(args.join),
        interface=args.interface,
        membership=MembershipConfig.preset(args.preset),
        auth=load_secrets(args.secret_file, args.encrypt),
        meta=parse_meta(args.meta),
        registry_dir=args.registry_dir,
        metrics_port=args.metrics_port,
    )


def event_record(kind: str, m: MemberSnapshot) -> dict[str, Any]:
    return {
        "event": kind,
        "node": m.node,
        "name": m.name,
        "addr": f"{m.addr[0]}:{m.addr[1]}",
        "incarnation": m.incarnation,
        "meta": m.meta,
        "time": round(time.time(), 6),
    }


def _emit(fmt: str, record: dict[str, Any]) -> None:
    if fmt == "json":
        sys.stdout.write(json.dumps(record, separators=(",", ":")) + "\n")
        sys.stdout.flush()
    else:
        print(
            f"{record['event']:>8} {record['name']} {record['addr']} inc={record['incarnation']}",
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
