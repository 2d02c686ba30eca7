"""``ftmesh status``: find a mesh, read its member list (as an observer) and print it.

After the members it warns (on stderr) about a mesh that did not form as its members were
told: a member that expects more members (``--start-peers``, metadata ``expect``) than the
mesh holds, and members still waiting to start. That is what a split looks like from inside
one of its parts.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import trio

from ..discovery import make_discovery
from ..errors import ConfigError, FtmeshError, RemoteProtocolError
from ..membership.messages import Address, MemberSnapshot, MemberState, PushPull
from ..membership.wire import PacketCodec
from ..mesh_meta import BadMetadataError, read_member, role_of
from ..net.frames import exchange_push_pull
from ..security import MeshAuth
from ..settings import DEFAULT_MESH, EXPECT_KEY, Settings
from .main import settings_from_args

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


async def _find(settings: Settings, mesh: str, timeout: float) -> list[Address]:
    kind = settings.discovery_kind("local")
    if kind in ("seeds", "none") and not settings.seeds():
        raise ConfigError(
            f"status with {kind} discovery needs a member to ask: pass --join HOST:PORT"
        )
    discovery = make_discovery(
        "seeds" if kind == "none" else kind,
        seeds=settings.seeds(),
        interface_ip=settings.mdns_interface() if kind == "mdns" else None,
        registry_dir=settings.registry_dir,
    )
    found = [(a.host, a.port) for a in await discovery.browse(mesh, timeout)]
    random.shuffle(found)
    return found


def formation_warnings(members: list[MemberSnapshot]) -> list[str]:
    """What ``ftmesh status`` warns about: members expecting more members than there are,
    members still waiting to start."""
    alive = [m for m in members if m.state == MemberState.ALIVE]
    out = []
    for m in alive:
        expect = m.meta.get(EXPECT_KEY)
        if type(expect) is int and expect > len(alive):
            out.append(
                f"{m.name} was told to expect {expect} members (start_peers) but this mesh has "
                f"{len(alive)}: the others are not running, cannot reach it or formed a mesh "
                "of their own; check their logs and discovery settings"
            )
    starting = sorted(m.name for m in alive if role_of(m) == "starting")
    if starting:
        out.append(f"waiting to start (start_peers not reached yet): {', '.join(starting)}")
    return out


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
    settings = settings_from_args(args, os.environ)
    mesh = settings.mesh if settings.mesh is not None else DEFAULT_MESH
    auth = settings.auth()
    addrs = await _find(settings, mesh, args.timeout)
    if not addrs:
        raise FtmeshError(
            f"no member of mesh {mesh!r} found by {settings.discovery_kind('local')} discovery"
        )
    members = await fetch_members(addrs, mesh, auth, args.timeout)
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
    for warning in formation_warnings(members):
        print(f"warning: {warning}", file=sys.stderr)
    return 0


def run_status(args: argparse.Namespace) -> int:
    return trio.run(_amain, args)
