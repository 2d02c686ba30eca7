"""Reading a mesh from outside it, and the table of its members' progress.

Theory of operation: an observer (``ftmesh status``, ``ftmesh launch``'s view) never joins the
mesh. It finds members through discovery, then asks one of them for its member list with an
*observer* push-pull (``fetch_members``): the member answers with its membership table,
metadata included, and does not add the observer to it. :class:`MeshReader` repeats that:
after the first answer it asks the alive members of the last list (a random one first), and
goes back to discovery only when none of them answers. What each member shows (step, step
time, share, samples/s, world, backend, last fault) is the ``progress`` it publishes in its
metadata (``ftmesh.mesh.meta.Progress``), validated by ``read_member`` like every other key:
a member whose metadata does not parse is shown as unusable, never a crash. Its devices are
its ``devices`` entry (``ftmesh.cli.gpu_view``: ``cpu`` without one, ``?`` for one that does
not parse). What members publish is shown through ``escape.shown``.
"""

from __future__ import annotations

import importlib.util
import os
import random
import sys
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

from ..discovery import make_discovery
from ..errors import ConfigError, FtmeshError, RemoteProtocolError
from ..membership.messages import Address, MemberSnapshot, MemberState, PushPull
from ..membership.wire import PacketCodec
from ..mesh.meta import BadMetadataError, MemberInfo, read_member
from ..net.frames import exchange_push_pull
from ..security import MeshAuth
from ..settings import Settings
from .escape import shown
from .gpu_view import devices_cell

if TYPE_CHECKING:
    from rich.table import Table

CLOCK_NOTE = 1.0
"""Seconds of clock difference with the member read that ``status`` mentions."""
MAX_CONTACTS = 8
"""Members tried before giving up: a few may have just died, more means no mesh is there."""


async def fetch_members(
    addrs: list[Address], mesh: str, auth: MeshAuth, timeout: float, clock_note: bool = True
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
        if clock_note and off is not None and abs(off) > CLOCK_NOTE:
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


async def find_members(settings: Settings, mesh: str, timeout: float) -> list[Address]:
    """Gossip addresses of ``mesh``'s members, as discovery finds them (shuffled)."""
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


def live_view_available() -> bool:
    """Whether ``rich`` is installed (it is a dependency; a stripped install falls back to
    plain progress lines)."""
    return importlib.util.find_spec("rich") is not None


class MeshReader:
    """Reads ``mesh``'s member list again and again, as an observer (see the module doc)."""

    def __init__(self, settings: Settings, mesh: str, timeout: float) -> None:
        self.settings = settings
        self.mesh = mesh
        self.auth = settings.auth()
        self.timeout = timeout
        self._addrs: list[Address] = []
        self._first = True

    async def read(self) -> list[MemberSnapshot]:
        """The member list of one member that answers; ``FtmeshError`` if none does."""
        members = None
        if self._addrs:
            try:
                members = await fetch_members(
                    self._addrs, self.mesh, self.auth, self.timeout, False
                )
            except FtmeshError:
                members = None
        if members is None:
            addrs = await find_members(self.settings, self.mesh, self.timeout)
            if not addrs:
                kind = self.settings.discovery_kind("local")
                raise FtmeshError(f"no member of mesh {self.mesh!r} found by {kind} discovery")
            members = await fetch_members(addrs, self.mesh, self.auth, self.timeout, self._first)
            self._first = False
        alive = [m.addr for m in members if m.state == MemberState.ALIVE]
        random.shuffle(alive)
        self._addrs = alive
        return members


class BackgroundReader:
    """A ``MeshReader`` on a daemon thread of its own (its own ``trio.run``), reading every
    ``poll_s`` seconds, for a program that is not written in trio (``ftmesh launch``):
    ``latest`` is the newest member list read (``None`` before the first), ``failed`` counts
    reads no member answered (none yet: the workers are still starting)."""

    def __init__(self, reader: MeshReader, poll_s: float) -> None:
        self.reader = reader
        self.poll_s = poll_s
        self.latest: list[MemberRow] | None = None
        self.failed = 0
        self.error: BaseException | None = None
        """What ended the reading thread, if anything but ``close`` did."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name="ftmesh-view", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def _main(self) -> None:
        try:
            trio.run(self._loop)
        except BaseException as exc:  # (kept for the owner to report: a thread has no caller)
            self.error = exc

    async def _loop(self) -> None:
        while not self._stop.is_set():
            started = trio.current_time()
            try:
                self.latest = member_rows(await self.reader.read())
            except FtmeshError:
                self.failed += 1
            await trio.sleep_until(started + self.poll_s)


@dataclass(frozen=True, slots=True)
class MemberRow:
    """One member as the live view shows it."""

    snapshot: MemberSnapshot
    info: MemberInfo | None
    """Its validated metadata; None when it does not parse (``problem`` says why)."""
    problem: str = ""

    @property
    def name(self) -> str:
        return self.snapshot.name

    @property
    def state(self) -> str:
        return MemberState(self.snapshot.state).name.lower()

    def cells(self) -> tuple[str, ...]:
        """``COLUMNS`` as text (what members publish with ``shown``: escaped)."""
        info = self.info
        role = "unusable" if info is None else info.role or "-"
        p = None if info is None else info.progress
        devices = devices_cell(self.snapshot.meta)
        if p is None:
            progress: tuple[str, ...] = ("-",) * 6 + (devices, "-")
        else:
            progress = (
                str(p.step),
                f"{p.step_s * 1000:.0f}ms",
                str(p.share),
                f"{p.sps:.1f}",
                str(p.world),
                shown(p.backend),
                devices,
                shown(p.fault) or "-",
            )
        return (shown(self.name), self.state, shown(role), *progress)


COLUMNS: tuple[str, ...] = ("NAME", "STATE", "ROLE", "STEP", "STEP TIME", "SHARE")
COLUMNS += ("SAMPLES/S", "WORLD", "BACKEND", "DEVICES", "LAST FAULT")


def member_rows(members: list[MemberSnapshot]) -> list[MemberRow]:
    """Every member, alive ones first, then by name."""
    rows = []
    for m in sorted(members, key=lambda m: (m.state, m.name)):
        try:
            rows.append(MemberRow(m, read_member(m)))
        except BadMetadataError as exc:
            rows.append(MemberRow(m, None, str(exc)))
    return rows


def plain_table(rows: list[MemberRow]) -> str:
    """``rows`` as aligned text columns."""
    cells = [COLUMNS, *(r.cells() for r in rows)]
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    lines += [f"{shown(r.name)}: UNUSABLE ({shown(r.problem)})" for r in rows if r.problem]
    return "\n".join(lines)


def rich_table(rows: list[MemberRow], title: str) -> Table:
    """``rows`` as a ``rich`` table (rich must be importable)."""
    from rich.table import Table
    from rich.text import Text

    table = Table(title=Text(shown(title)), expand=False)
    for col in COLUMNS:
        table.add_column(col.lower())
    for r in rows:
        table.add_row(*(Text(c) for c in r.cells()))  # (Text: never read as markup)
    return table
