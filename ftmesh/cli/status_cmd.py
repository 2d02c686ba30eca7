"""``ftmesh status``: find a mesh, read its member list (as an observer) and print it.

After the members it warns (on stderr) about a mesh that did not form as its members were
told: a member that expects more members (``--start-peers``, metadata ``expect``) than the
mesh holds, and members still waiting to start. That is what a split looks like from inside
one of its parts.

Each member's devices (the ``devices`` entry a member with the GPU path enabled publishes:
``cpu`` without one, ``?`` for one that does not parse, which is also warned about) are a
column, and a last line says which backend the current view's collectives take, as every
member derives it from that metadata (``ftmesh.cli.gpu_view``): ``nccl`` when every member of
the view has a GPU and the same NCCL, else GPU buffers staged over the TCP ring, with the
reason. ``--json`` keeps its shape (a list of members: scripts read it) and gives each member
its ``devices``; ``--watch --json`` also gives each read's ``backend``.

A line (and one per site) gives the ring plan every member derives from the same metadata
(``ftmesh.collective.topology``): the sites (labels, or measured from round trips or
throughput), the ring order, whether an allreduce runs hierarchically or on the flat ring (and
why), and the plan's hash, the one that goes into the view's epoch; with several measured
sites, what the members measured of the links between them (the range of round trips and
rates their published buckets cover). ``--watch --json`` gives it as ``plan``.

``--watch`` reads the member list again every ``--interval`` seconds (``MeshReader``, still as
an observer) and redraws the table of the members' progress, as they publish it in their
metadata (``ftmesh.cli.live_view``): a ``rich`` live table on a terminal, a block of plain
lines per read otherwise (``--json``: one JSON object per read, a line each), until Ctrl-C
or ``--count`` reads. A first read that finds nobody ends it like plain ``status`` (one line,
exit status 2); after that a read nobody answers is shown and the next one tries again.

With no mesh named, local discovery reads the default mesh, or the only mesh with members on
this host if the default one has none here (``ftmesh launch`` runs its workers as mesh
``launch-PID-...``, in the default registry, and prints that name).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import trio

from ..collective.topology import RingPlan, bucket_bounds, links_of, rate_bounds
from ..discovery.local import live_meshes
from ..errors import ConfigError, FtmeshError
from ..membership.messages import MemberSnapshot, MemberState
from ..mesh.core import view_of
from ..mesh.meta import BadMetadataError, read_member, role_of
from ..settings import DEFAULT_MESH, EXPECT_KEY, Settings
from .args import settings_from_args
from .escape import shown
from .gpu_view import (
    UNREADABLE,
    ViewBackend,
    current_view,
    describe_view,
    devices_cell,
    devices_json,
)
from .live_view import (
    MemberRow,
    MeshReader,
    live_view_available,
    member_rows,
    plain_table,
    rich_table,
)


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


def devices_warnings(members: list[MemberSnapshot]) -> list[str]:
    """Members whose ``devices`` entry does not parse (shown as ``?``)."""
    out = []
    for m in sorted(members, key=lambda m: m.name):
        why = devices_json(m.meta).get("devices_problem")
        if why:
            out.append(f"{shown(m.name)}: {why}; shown as {UNREADABLE}, counted as no GPU")
    return out


def ring_plan_lines(members: list[MemberSnapshot]) -> list[str]:
    """The ring plan of the view ``members`` imply, for a person: a summary line, one line per
    site of a plan with several, and the ring order (by member name)."""
    plan = plan_json(members)
    if plan is None:
        return ["ring plan: none (no view)"]
    out = [f"ring plan: {plan['line']}"]
    if len(plan["sites"]) > 1:
        for site in plan["sites"]:
            out.append(f"  site {site['label'] or '(unlabeled)'}: {', '.join(site['members'])}")
        across = plan["across"]
        if across:
            out.append(f"  between sites (measured): {', '.join(across)}")
    out.append(f"  ring: {' -> '.join(plan['ring'])} -> (back to the first)")
    return out


def plan_json(members: list[MemberSnapshot]) -> dict[str, Any] | None:
    """The ring plan of the view ``members`` imply (members by name), or None (no view)."""
    in_view = current_view(members)
    view = view_of(in_view)
    if view is None or view.plan is None:
        return None
    plan = view.plan
    names = {m.node: shown(m.name) for m in in_view}
    return {
        "sites": [
            {"label": site.label, "members": [names[n] for n in site.members]}
            for site in plan.sites
        ],
        "ring": [names[n] for n in view.node_ids],
        "source": plan.source,
        "hierarchical": plan.hierarchical,
        "why_flat": plan.why_flat,
        "hash": plan.hash,
        "epoch": view.epoch,
        "line": plan.describe(),
        "across": _across(in_view, plan) if plan.source != "labels" else [],
    }


def _across(members: list[MemberSnapshot], plan: RingPlan) -> list[str]:
    """What the members measured of the links between the plan's sites, for a person: the
    range of round trips and of rates their published buckets cover (``[]``: none)."""
    ids = [m.node for m in members]
    rtt: list[int] = []
    rate: list[int] = []
    for m in members:
        info = read_member(m)
        for into, published in ((rtt, info.links), (rate, info.rates)):
            for peer, bucket in links_of(dict(published), ids).items():
                if plan.site_of(peer) != plan.site_of(m.node):
                    into.append(bucket)
    out = []
    if rtt:
        lo, hi = bucket_bounds(min(rtt))[0], bucket_bounds(max(rtt))[1]
        out.append(f"round trips {_range(lo * 1e3, hi * 1e3)} ms")
    if rate:
        lo, hi = rate_bounds(min(rate))[0], rate_bounds(max(rate))[1]
        out.append(f"rates {_range(lo / 1e6, hi / 1e6)} Mbit/s")
    return out


def _range(lo: float, hi: float) -> str:
    return f"{lo:.3g}-{hi:.3g}" if hi < float("inf") else f"{lo:.3g} and more"


def backend_line(view: ViewBackend | None) -> str:
    """The view's backend for a person."""
    return "view backend: none (no alive training member, no view)" if view is None else view.line()


def problem(m: MemberSnapshot) -> str:
    """Why the mesh leaves ``m`` out (its metadata does not parse), or ``""``."""
    try:
        read_member(m)
    except BadMetadataError as exc:
        return f"UNUSABLE ({exc})"
    return ""


def _table(members: list[MemberSnapshot]) -> str:
    rows = [("NAME", "ID", "ADDRESS", "STATE", "INC", "DEVICES", "META")]
    order = sorted(members, key=lambda m: (m.state, m.name))
    for m in order:
        meta = ",".join(f"{k}={v}" for k, v in sorted(m.meta.items()))
        meta = shown(f"{meta}  {problem(m)}" if problem(m) else meta)
        rows.append(
            (
                shown(m.name),
                m.node[:12],
                f"{m.addr[0]}:{m.addr[1]}",
                MemberState(m.state).name.lower(),
                str(m.incarnation),
                devices_cell(m.meta),
                meta,
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )


def _json(members: list[MemberSnapshot]) -> list[dict[str, Any]]:
    return [
        {
            "node": m.node,
            "name": m.name,
            "addr": f"{m.addr[0]}:{m.addr[1]}",
            "state": MemberState(m.state).name.lower(),
            "incarnation": m.incarnation,
            "meta": m.meta,
            **devices_json(m.meta),
            **({"problem": p} if (p := problem(m)) else {}),
        }
        for m in members
    ]


def _mesh_to_read(settings: Settings) -> str:
    """The mesh named (``--mesh``, ``$FTMESH_MESH``), else the default one; with local
    discovery and no mesh named, the only mesh on this host if the default one has no member
    here (``ftmesh launch`` names its mesh ``launch-PID-...``): more than one is an error
    that lists them."""
    if settings.mesh is not None:
        return settings.mesh
    if settings.discovery_kind("local") != "local":
        return DEFAULT_MESH
    registry = Path(settings.registry_dir) if settings.registry_dir else None
    meshes = live_meshes(registry)
    if DEFAULT_MESH in meshes or not meshes:
        return DEFAULT_MESH
    if len(meshes) == 1:
        (only,) = meshes
        print(f"note: reading mesh {only}, the only one on this host", file=sys.stderr)
        return only
    listed = ", ".join(f"{name} ({n} members)" for name, n in sorted(meshes.items()))
    raise FtmeshError(f"no mesh named and several on this host: {listed}; pick one with --mesh")


async def _amain(args: argparse.Namespace) -> int:
    settings = settings_from_args(args, os.environ)
    settings.auth()  # (every setting checked before the registry is looked at)
    mesh = _mesh_to_read(settings)
    reader = MeshReader(settings, mesh, args.timeout)
    if args.watch:
        return await _watch(args, reader, mesh)
    members = await reader.read()
    if args.json:
        print(json.dumps(_json(members), indent=2))
    else:
        print(_table(members))
        print(backend_line(describe_view(members)))
        print("\n".join(ring_plan_lines(members)))
    for warning in [*formation_warnings(members), *devices_warnings(members)]:
        print(f"warning: {warning}", file=sys.stderr)
    return 0


async def _watch(args: argparse.Namespace, reader: MeshReader, mesh: str) -> int:
    """Read and show the members every ``--interval`` seconds, ``--count`` times (0: until
    Ctrl-C). A read no member answers is shown as such; the next one tries again."""
    if not args.interval > 0:
        raise ConfigError(f"--interval must be positive, got {args.interval}")
    if args.count < 0:
        raise ConfigError(f"--count must be 0 (no limit) or more, got {args.count}")
    live = None
    with contextlib.ExitStack() as stack:
        if not args.json and sys.stdout.isatty() and live_view_available():
            from rich.live import Live

            live = stack.enter_context(Live(auto_refresh=False))
        done = 0
        while args.count == 0 or done < args.count:
            started = trio.current_time()
            try:
                members = await reader.read()
            except FtmeshError as exc:
                if done == 0:  # nothing there: like plain status (exit status 2)
                    raise
                members, error = [], str(exc)
            else:
                error = ""
            done += 1
            title = f"mesh {mesh} at {time.strftime('%H:%M:%S')}: {len(members)} members"
            rows = member_rows(members)
            view = describe_view(members)
            below = shown(error) if error else backend_line(view)
            if not error:
                below = "\n".join([below, *ring_plan_lines(members)])
            if args.json:
                backend = None if view is None else view.as_json()
                read = {
                    "time": time.time(),
                    "members": _watch_json(rows),
                    "backend": backend,
                    "plan": plan_json(members),
                }
                print(json.dumps(read))
            elif live is not None:
                from rich.console import Group
                from rich.text import Text

                live.update(Group(rich_table(rows, title), Text(below)), refresh=True)
            else:
                print(f"{title}\n{plain_table(rows)}\n{below}\n")
            sys.stdout.flush()
            if args.count == 0 or done < args.count:
                await trio.sleep_until(started + args.interval)
    return 0


def _watch_json(rows: list[MemberRow]) -> list[dict[str, Any]]:
    """``--watch --json``: each member with its validated progress."""
    out = []
    for row in rows:
        p = None if row.info is None else row.info.progress
        out.append(
            {
                "name": row.name,
                "node": row.snapshot.node,
                "state": row.state,
                "role": None if row.info is None else row.info.role,
                "progress": None if p is None else dataclasses.asdict(p),
                **devices_json(row.snapshot.meta),
                **({"problem": row.problem} if row.problem else {}),
            }
        )
    return out


def run_status(args: argparse.Namespace) -> int:
    try:
        return trio.run(_amain, args)
    except KeyboardInterrupt:  # Ctrl-C ends --watch
        if not args.watch:
            raise
        return 0
