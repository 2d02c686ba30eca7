"""Run MdnsDiscovery in one process and print what it finds, as JSON lines on stdout.

Used by tests/test_discovery_mdns.py inside lab namespaces (never on the host's interfaces).
Lines: {"event": "started", "ip": ...}, then {"event": "found", <advert fields>} per new peer,
then {"event": "done", "stats": {...}, "threads": [...]} after a clean shutdown. Exits once
``--expect`` distinct peers were found and ``--linger`` seconds more have passed (so the others
can still resolve us), or after ``--max`` seconds, whichever comes first. With ``--browse MESH``
it prints one {"event": "browse", "adverts": [...]} line from a ``browse(MESH, --max)`` call.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import threading
import uuid

import trio

from ftmesh.discovery import Advert, MdnsDiscovery


def emit(obj: dict[str, object]) -> None:
    print(json.dumps(obj), flush=True)


async def browse(args: argparse.Namespace) -> None:
    disc = MdnsDiscovery(args.interface_ip)
    await trio.sleep(args.delay)
    adverts = await disc.browse(args.browse, args.max)
    emit({"event": "browse", "adverts": [dataclasses.asdict(a) for a in adverts]})


async def main(args: argparse.Namespace) -> None:
    if args.browse:
        await browse(args)
        return
    disc = MdnsDiscovery(args.interface_ip)
    me = Advert(
        mesh=args.mesh,
        node_id=uuid.uuid4().hex,
        name=f"{args.name}-{os.getpid()}",
        host="0.0.0.0",
        port=args.port,
    )
    seen: dict[str, Advert] = {}
    enough = trio.Event()

    def found(a: Advert) -> None:
        if a.node_id not in seen:
            seen[a.node_id] = a
            emit({"event": "found", **dataclasses.asdict(a)})
        if len(seen) >= args.expect:
            enough.set()

    with trio.move_on_after(args.max):
        async with trio.open_nursery() as nursery:
            await nursery.start(disc.run, me, found)
            emit({"event": "started", "ip": disc.advertised_ip(), "node_id": me.node_id})
            await enough.wait()
            await trio.sleep(args.linger)
            nursery.cancel_scope.cancel()
    threads = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    emit(
        {
            "event": "done",
            "stats": dataclasses.asdict(disc.statistics()),
            "threads": threads,
        }
    )


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--mesh", default="a")
    p.add_argument("--name", default="probe")
    p.add_argument("--browse", default=None, help="browse this mesh once instead of running")
    p.add_argument("--delay", type=float, default=0.0, help="seconds to wait before browsing")
    p.add_argument("--port", type=int, default=7946)
    p.add_argument("--interface-ip", default=None)
    p.add_argument("--expect", type=int, default=1)
    p.add_argument("--linger", type=float, default=3.0)
    p.add_argument("--max", type=float, default=20.0)
    trio.run(main, p.parse_args())
    sys.exit(0)
