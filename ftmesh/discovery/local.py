"""Same-host discovery through a registry directory: no network, no multicast.

Theory of operation: each node writes one JSON file ``<dir>/<mesh>/<node_id>.json`` holding its
advert, its pid and its process start time, atomically (write a temporary file, then
``os.replace``), and deletes it on shutdown. Every node polls its mesh's directory every
``poll_interval`` seconds and reports the adverts it finds. A process that crashed cannot delete
its file, so every entry is checked against the process table: an entry whose pid is gone (or
was reused by a different process, detected through the start time in ``/proc``) is stale,
ignored and removed by whoever notices first. Meshes are isolated by directory.

The registry directory is ``registry_dir`` if given (``--registry-dir``,
``$FTMESH_REGISTRY_DIR`` through ``ftmesh.settings``), else ``/tmp/ftmesh-<uid>``. The
default is per user, created with mode 0700, and refused if it is a symlink or owned by
someone else (``/tmp`` is shared; another user must not be able to plant
or read adverts there). Liveness is judged by pid, so all members must share one pid namespace
(one host, not separate containers sharing a volume).

Files in the directory are input from other processes: reading is capped in count
(:data:`MAX_ENTRIES`) and size (:data:`MAX_FILE_BYTES`), and junk is counted and ignored, never
deleted (only well-formed entries of dead processes are).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from ..errors import ConfigError
from .base import (
    Advert,
    DiscoveryStatistics,
    FoundCallback,
    _Counters,
    advert_problem,
    check_mesh_name,
    check_own_advert,
)

DEFAULT_POLL_INTERVAL = 0.25
"""Seconds between scans of the registry. Lower finds peers sooner at the cost of a directory
scan (a few syscalls per entry, unchanged files are not re-read) per interval."""

DEFAULT_REFRESH_INTERVAL = 5.0
"""Seconds after which a known peer is reported again, so a join that failed is retried."""

MAX_ENTRIES = 4096
"""Directory entries examined per scan. Bounds the work a directory full of junk can cause."""

MAX_FILE_BYTES = 4096
"""Largest registry file read. A real entry is ~300 bytes; this bounds memory per entry."""

MAX_MESHES = 64
"""Mesh directories :func:`live_meshes` looks into: bounds the work of a registry full of
meshes (each scan is bounded by :data:`MAX_ENTRIES`)."""

_FORMAT = 1
"""Version of the registry file format, stored in every file as ``"format"``."""

_NAME_SUFFIX = ".json"
_TMP_MARK = ".tmp-"


def default_registry_dir() -> Path:
    """``/tmp/ftmesh-<uid>``: private to this user (checked before use)."""
    return Path("/tmp") / f"ftmesh-{os.getuid()}"


def _proc_start_ticks(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (Linux ``/proc``), or None if unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read(4096)
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    fields = data[data.rfind(b")") + 2 :].split()
    try:
        return int(fields[19])  # field 22 overall: starttime
    except (IndexError, ValueError):
        return None


def _pid_alive(pid: int, start_ticks: int | None) -> bool:
    """Whether the process that wrote an entry is still running."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, belongs to another user
    except (OverflowError, OSError):
        return False
    if start_ticks is not None:
        current = _proc_start_ticks(pid)
        if current is not None and current != start_ticks:
            return False  # the pid was reused by another process
    return True


@dataclass(frozen=True, slots=True)
class _Entry:
    advert: Advert
    pid: int
    pid_start: int | None


def _parse_entry(data: bytes, filename: str) -> _Entry:
    """Parse one registry file; raise ValueError with a reason if it is not a valid entry."""
    obj: Any = json.loads(data)
    if not isinstance(obj, dict) or obj.get("format") != _FORMAT:
        raise ValueError("not a registry entry of a known format")
    pid = obj.get("pid")
    pid_start = obj.get("pid_start")
    if isinstance(pid, bool) or not isinstance(pid, int) or not 1 <= pid < 2**31:
        raise ValueError(f"bad pid {pid!r}")
    if pid_start is not None and (isinstance(pid_start, bool) or not isinstance(pid_start, int)):
        raise ValueError("bad pid_start")
    fields = ("mesh", "node_id", "name", "host", "port", "version")
    try:
        advert = Advert(**{k: obj[k] for k in fields})
    except KeyError as e:
        raise ValueError(f"missing field {e}") from None
    problem = advert_problem(advert)
    if problem is not None:
        raise ValueError(problem)
    if filename != advert.node_id + _NAME_SUFFIX:
        raise ValueError("file name does not match node id")
    return _Entry(advert, pid, pid_start)


class _Scanner:
    """Scans one mesh directory. Runs in a worker thread; remembers parsed files by stat key so
    an unchanged file is not re-read or re-counted. Counter events are returned, not applied,
    so the trio thread owns the counters."""

    def __init__(self, mesh_dir: Path) -> None:
        self.mesh_dir = mesh_dir
        self._cache: dict[str, tuple[tuple[int, int, int], _Entry | None]] = {}

    def scan(self, skip: str) -> tuple[list[_Entry], list[tuple[str, str]], bool]:
        """Return (live entries, counter events, whether ``skip`` was present)."""
        events: list[tuple[str, str]] = []
        live: list[_Entry] = []
        seen: set[str] = set()
        skip_present = False
        try:
            it = os.scandir(self.mesh_dir)
        except FileNotFoundError:
            self._cache.clear()
            return live, events, False
        except OSError as e:
            return live, [("errors", f"cannot list {self.mesh_dir}: {e}")], True
        with it:
            for n, de in enumerate(it):
                if n >= MAX_ENTRIES:
                    events.append(("malformed", f"more than {MAX_ENTRIES} entries; rest ignored"))
                    break
                name = de.name
                if name == skip:
                    skip_present = True
                    continue
                if _TMP_MARK in name:
                    continue  # another writer's file in the middle of an atomic replace
                seen.add(name)
                entry = self._load(de, events)
                if entry is None:
                    continue
                if _pid_alive(entry.pid, entry.pid_start):
                    live.append(entry)
                    continue
                try:
                    os.unlink(de.path)
                except FileNotFoundError:
                    pass
                except OSError as e:
                    events.append(("errors", f"cannot remove stale {de.path}: {e}"))
                self._cache.pop(name, None)
                events.append(("stale", f"{name} (pid {entry.pid} is gone)"))
        for name in list(self._cache):
            if name not in seen:
                del self._cache[name]
        return live, events, skip_present

    def _load(self, de: os.DirEntry[str], events: list[tuple[str, str]]) -> _Entry | None:
        try:
            st = de.stat(follow_symlinks=False)
        except OSError:
            return None  # vanished between listing and stat
        key = (st.st_ino, st.st_size, st.st_mtime_ns)
        cached = self._cache.get(de.name)
        if cached is not None and cached[0] == key:
            return cached[1]
        entry: _Entry | None = None
        if not stat.S_ISREG(st.st_mode):
            events.append(("malformed", f"{de.name}: not a regular file"))
        elif st.st_size > MAX_FILE_BYTES:
            events.append(("malformed", f"{de.name}: larger than {MAX_FILE_BYTES} bytes"))
        else:
            try:
                with open(de.path, "rb") as f:
                    data = f.read(MAX_FILE_BYTES + 1)
                if len(data) > MAX_FILE_BYTES:
                    raise ValueError(f"larger than {MAX_FILE_BYTES} bytes")
                entry = _parse_entry(data, de.name)
            except FileNotFoundError:
                return None
            except (OSError, ValueError, TypeError, RecursionError) as e:
                events.append(("malformed", f"{de.name}: {e}"))
        self._cache[de.name] = (key, entry)
        return entry


def _write_atomic(path: Path, payload: bytes) -> None:
    tmp = path.with_name(f"{path.name}{_TMP_MARK}{os.getpid()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class LocalDiscovery:
    """Same-host discovery through a registry directory. See the module docstring.

    ``registry_dir``: where entries live (default :func:`default_registry_dir`).
    ``poll_interval``: seconds between scans. ``refresh_interval``: seconds after which known
    peers are reported again.
    """

    def __init__(
        self,
        registry_dir: Path | str | None = None,
        *,
        poll_interval: float = DEFAULT_POLL_INTERVAL,
        refresh_interval: float = DEFAULT_REFRESH_INTERVAL,
    ) -> None:
        if not 0.01 <= poll_interval <= 60:
            raise ConfigError(f"poll_interval {poll_interval!r} s must be within [0.01, 60]")
        if not 0.1 <= refresh_interval <= 3600:
            raise ConfigError(f"refresh_interval {refresh_interval!r} s must be in [0.1, 3600]")
        self._explicit = registry_dir is not None
        self.registry_dir = (
            Path(registry_dir) if registry_dir is not None else default_registry_dir()
        )
        self.poll_interval = poll_interval
        self.refresh_interval = refresh_interval
        self._counters = _Counters()

    def statistics(self) -> DiscoveryStatistics:
        """Counters since construction (reports, junk files, stale entries removed...)."""
        return self._counters.snapshot()

    def _prepare_dir(self, mesh: str) -> Path:
        base = self.registry_dir
        try:
            base.mkdir(mode=0o700, parents=True, exist_ok=True)
            if not self._explicit:
                st = os.lstat(base)
                if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
                    raise ConfigError(
                        f"registry directory {base} is not a directory owned by uid "
                        f"{os.getuid()}; pass a private registry_dir (--registry-dir, "
                        "$FTMESH_REGISTRY_DIR)"
                    )
            mesh_dir = base / mesh
            mesh_dir.mkdir(mode=0o700, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"cannot use registry directory {base}: {e}") from e
        return mesh_dir

    def _apply(self, events: list[tuple[str, str]]) -> None:
        for reason, detail in events:
            self._counters.bump(reason, detail)

    async def run(
        self,
        me: Advert,
        found: FoundCallback,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Write our entry, then report the other live entries of ``me.mesh`` until cancelled;
        our entry is removed on the way out."""
        check_own_advert(me)
        mesh_dir = await trio.to_thread.run_sync(self._prepare_dir, me.mesh)
        own = mesh_dir / f"{me.node_id}{_NAME_SUFFIX}"
        pid = os.getpid()
        payload = json.dumps(
            {
                "format": _FORMAT,
                "mesh": me.mesh,
                "node_id": me.node_id,
                "name": me.name,
                "host": me.host,
                "port": me.port,
                "version": me.version,
                "pid": pid,
                "pid_start": _proc_start_ticks(pid),
                "started": time.time(),
            }
        ).encode()
        write: Callable[[], None] = lambda: _write_atomic(own, payload)  # noqa: E731
        try:
            await trio.to_thread.run_sync(write)
            task_status.started()
            scanner = _Scanner(mesh_dir)
            last: dict[str, tuple[Advert, float]] = {}
            while True:
                live, events, own_present = await trio.to_thread.run_sync(scanner.scan, own.name)
                self._apply(events)
                if not own_present:
                    # Removed under us (tmp cleaner, a peer that misjudged us): put it back.
                    self._counters.bump("errors", f"own entry {own} vanished; rewritten")
                    await trio.to_thread.run_sync(write)
                now = trio.current_time()
                current: set[str] = set()
                for entry in live:
                    a = entry.advert
                    if a.mesh != me.mesh:
                        self._counters.bump("other_mesh", f"{a.node_id} of mesh {a.mesh!r}")
                        continue
                    if a.node_id == me.node_id:
                        continue
                    current.add(a.node_id)
                    prev = last.get(a.node_id)
                    if prev is None or prev[0] != a or now - prev[1] >= self.refresh_interval:
                        last[a.node_id] = (a, now)
                        self._counters.bump("reported")
                        found(a)
                for node_id in list(last):
                    if node_id not in current:
                        del last[node_id]
                await trio.sleep(self.poll_interval)
        finally:
            # One unlink on a local directory: quick enough to do inline even when cancelled.
            try:
                own.unlink(missing_ok=True)
            except OSError as e:
                self._counters.bump("errors", f"cannot remove own entry {own}: {e}")

    async def browse(self, mesh: str, timeout: float) -> list[Advert]:
        """The live entries of ``mesh`` now (one scan), or ``[]`` if it takes over ``timeout``."""
        check_mesh_name(mesh)
        with trio.move_on_after(timeout):
            scanner = _Scanner(self.registry_dir / mesh)
            live, events, _ = await trio.to_thread.run_sync(scanner.scan, "")
            self._apply(events)
            out = []
            for entry in live:
                if entry.advert.mesh != mesh:
                    self._counters.bump("other_mesh", f"{entry.advert.node_id}")
                    continue
                out.append(entry.advert)
            return out
        return []


def remove_entries(registry_dir: Path, mesh: str, pids: set[int]) -> None:
    """Remove the entries of ``mesh`` written by the processes ``pids`` (``ftmesh launch``,
    after its workers ended: a killed one could not remove its own), then the mesh's
    directory if nothing else is left in it."""
    mesh_dir = registry_dir / mesh
    try:
        with os.scandir(mesh_dir) as it:
            entries = list(itertools.islice(it, MAX_ENTRIES))
    except OSError:
        return
    for de in entries:
        if not de.is_file(follow_symlinks=False):
            continue
        try:
            with open(de.path, "rb") as f:
                entry = _parse_entry(f.read(MAX_FILE_BYTES + 1), de.name)
        except (OSError, ValueError, TypeError, RecursionError):
            continue
        if entry.pid in pids:
            with contextlib.suppress(OSError):
                os.unlink(de.path)
    with contextlib.suppress(OSError):  # (not empty: other members of the mesh are there)
        mesh_dir.rmdir()


def live_meshes(registry_dir: Path | None = None) -> dict[str, int]:
    """The meshes with live entries in the registry (``registry_dir`` or the default) and
    how many each has: what ``ftmesh status`` looks at when no mesh is named."""
    base = registry_dir if registry_dir is not None else default_registry_dir()
    out: dict[str, int] = {}
    try:
        with os.scandir(base) as it:
            listed = list(itertools.islice(it, MAX_MESHES))
        dirs = [de for de in listed if de.is_dir(follow_symlinks=False)]
    except OSError:
        return out
    for de in dirs:
        live, _, _ = _Scanner(Path(de.path)).scan("")
        n = sum(1 for e in live if e.advert.mesh == de.name)
        if n:
            out[de.name] = n
    return out
