"""``ftmesh status``: find a mesh, read its member list (as an observer) and print it."""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import trio

from ..discovery import make_discovery
from ..errors import FtmeshError, RemoteProtocolError
from ..membership.messages import Address, MemberSnapshot, MemberState, PushPull
from ..membership.wire import PacketCodec
from ..mesh_meta import BadMetadataError, read_member
from ..net.frames import exchange_push_pull
from ..net.node import parse_hostport
from ..security import MeshAuth, load_secrets

CLOCK_NOTE = 1.0
"""Seconds of clock difference with the member read that ``status`` mentions."""
MAX_CONTACTS = 8
"""Members tried before giving up: a few may have just died, more means no mesh is there."""


async def fetch_members(
    addrs: list[Address], mesh: str, auth: MeshAuth, timeout: float
) -> list[MemberSnapshot]:
    """The member list of the first reachable address, read without joining."""
    codec = PacketCodec(mesh, auth)
    me = PushPull(source=os.urandom(16).hex(), members=(), observer=True)
    errors = []
    for addr in addrs[:MAX_CONTACTS]:
        try:
            reply = await exchange_push_pull(addr, codec, me, timeout, time.time)
        except (OSError, trio.TooSlowError, RemoteProtocolError, trio.BrokenResourceError) as exc:
            errors.append(f"{addr[0]}:{addr[1]}: {exc!r}")
            continue
        off = reply.clock_offset
        if off is not None and abs(off) > CLOCK_NOTE:
            side = "ahead of" if off > 0 else "behind"
            print(
                f"note: the clock of {addr[0]}:{addr[1]} is {abs(off):.1f} s {side} this "
                "machine's (the mesh copes; logs are easier to compare with synced clocks)",
                file=sys.stderr,
            )
        return list(reply.push_pull.members)
    raise FtmeshError(
        f"no member of mesh {mesh!r} answered" + (f" ({'; '.join(errors)})" if errors else "")
    )


async def _find(args: argparse.Namespace) -> list[Address]:
    addrs = [parse_hostport(j) for j in args.join]
    if args.discovery in ("local", "mdns"):
        discovery = make_discovery(
            args.discovery,
            interface_ip=args.interface or None,
            registry_dir=args.registry_dir or None,
        )
        adverts = await discovery.browse(args.mesh, args.timeout)
        found = [(a.host, a.port) for a in adverts]
        random.shuffle(found)
        addrs += found
    return addrs


def problem(m: MemberSnapshot) -> str:
    """Why the mesh leaves ``m`` out (its metadata does not parse), or ``""``."""
    try:
        read_member(m)
    except BadMetadataError as exc:
        return f"UNUSABLE ({exc})"
    return ""


def _table(members: list[MemberSnapshot]) -> str:
    rows = [("NAME", "ID", "ADDRESS", "STATE", "INC", "META")]
    order = sorted(members, key=lambda m: (m.state, m.name))
    for m in order:
        meta = ",".join(f"{k}={v}" for k, v in sorted(m.meta.items()))
        meta = f"{meta}  {problem(m)}" if problem(m) else meta
        rows.append(
            (
                m.name,
                m.node[:12],
                f"{m.addr[0]}:{m.addr[1]}",
                MemberState(m.state).name.lower(),
                str(m.incarnation),
                meta,
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )


async def _amain(args: argparse.Namespace) -> int:
    addrs = await _find(args)
    if not addrs:
        raise FtmeshError(f"no member of mesh {args.mesh!r} found by {args.discovery} discovery")
    members = await fetch_members(
        addrs, args.mesh, load_secrets(args.secret_file, args.encrypt), args.timeout
    )
    if args.json:
        print(
            json.dumps(
                [
                    {
                        "node": m.node,
                        "name": m.name,
                        "addr": f"{m.addr[0]}:{m.addr[1]}",
                        "state": MemberState(m.state).name.lower(),
                        "incarnation": m.incarnation,
                        "meta": m.meta,
                        **({"problem": p} if (p := problem(m)) else {}),
                    }
                    for m in members
                ],
                indent=2,
            )
        )
    else:
        print(_table(members))
    return 0


def run_status(args: argparse.Namespace) -> int:
    return trio.run(_amain, args)
