"""LocalDiscovery: same-host registry directory, no network."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import trio

from ftmesh.discovery import Advert, LocalDiscovery, default_registry_dir, make_discovery
from ftmesh.discovery.local import MAX_FILE_BYTES, _proc_start_ticks
from ftmesh.errors import ConfigError

POLL = 0.02


def advert(mesh: str = "m", name: str = "n", port: int = 7000) -> Advert:
    return Advert(mesh=mesh, node_id=uuid.uuid4().hex, name=name, host="127.0.0.1", port=port)


def entry_json(a: Advert, pid: int, pid_start: int | None = None) -> str:
    return json.dumps(
        {
            "format": 1,
            "mesh": a.mesh,
            "node_id": a.node_id,
            "name": a.name,
            "host": a.host,
            "port": a.port,
            "version": a.version,
            "pid": pid,
            "pid_start": pid_start,
            "started": 0.0,
        }
    )


class Collector:
    def __init__(self) -> None:
        self.seen: dict[str, Advert] = {}
        self.calls = 0
        self._event = trio.Event()

    def __call__(self, a: Advert) -> None:
        self.calls += 1
        self.seen[a.node_id] = a
        self._event.set()

    async def wait_for(self, node_id: str, timeout: float = 5.0) -> Advert:
        with trio.fail_after(timeout):
            while node_id not in self.seen:
                await self._event.wait()
                self._event = trio.Event()
        return self.seen[node_id]


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


async def test_two_instances_see_each_other_and_withdraw(tmp_path: Path) -> None:
    a, b = advert(name="a", port=7001), advert(name="b", port=7002)
    da = LocalDiscovery(tmp_path, poll_interval=POLL)
    db = LocalDiscovery(tmp_path, poll_interval=POLL)
    ca, cb = Collector(), Collector()
    async with trio.open_nursery() as nursery:
        scope_a = trio.CancelScope()
        a_done = trio.Event()

        async def run_a(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            with scope_a:
                await da.run(a, ca, task_status=task_status)
            a_done.set()

        await nursery.start(run_a)
        await nursery.start(db.run, b, cb)
        assert await ca.wait_for(b.node_id) == b
        assert await cb.wait_for(a.node_id) == a
        assert a.node_id not in ca.seen and b.node_id not in cb.seen  # never ourselves
        assert {x.node_id for x in await db.browse("m", 2.0)} == {a.node_id, b.node_id}

        scope_a.cancel()  # withdraw a
        with trio.fail_after(2):
            await a_done.wait()
        assert not (tmp_path / "m" / f"{a.node_id}.json").exists()
        assert [x.node_id for x in await db.browse("m", 2.0)] == [b.node_id]
        nursery.cancel_scope.cancel()
    assert list((tmp_path / "m").iterdir()) == []
    assert da.statistics().reported >= 1 and da.statistics().malformed == 0


async def test_stale_entry_of_dead_pid_is_ignored_and_removed(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    ghost = advert(name="ghost")
    ghost_file = tmp_path / "m" / f"{ghost.node_id}.json"
    ghost_file.write_text(entry_json(ghost, dead_pid()))
    # A live pid whose start time does not match: the pid was reused by another process.
    reused = advert(name="reused")
    reused_file = tmp_path / "m" / f"{reused.node_id}.json"
    start = _proc_start_ticks(os.getpid())
    reused_file.write_text(entry_json(reused, os.getpid(), None if start is None else start + 1))
    live = advert(name="live")
    (tmp_path / "m" / f"{live.node_id}.json").write_text(
        entry_json(live, os.getpid(), _proc_start_ticks(os.getpid()))
    )

    disc = LocalDiscovery(tmp_path, poll_interval=POLL)
    found = Collector()
    async with trio.open_nursery() as nursery:
        await nursery.start(disc.run, advert(), found)
        await found.wait_for(live.node_id)
        await trio.sleep(POLL * 3)
        nursery.cancel_scope.cancel()
    assert ghost.node_id not in found.seen
    assert not ghost_file.exists()
    if start is not None:  # /proc available: reuse detected
        assert reused.node_id not in found.seen
        assert not reused_file.exists()
        assert disc.statistics().stale == 2
    else:
        assert disc.statistics().stale == 1


async def test_junk_files_are_counted_and_ignored(tmp_path: Path) -> None:
    d = tmp_path / "m"
    d.mkdir()
    ids = [uuid.uuid4().hex for _ in range(4)]
    junk = {
        "notes.txt": "hello",
        f"{ids[0]}.json": "{not json",
        f"{ids[1]}.json.": "[]",
        "big.json": "x" * (MAX_FILE_BYTES + 1),
        f"{ids[2]}.json": json.dumps({"format": 1, "pid": 1}),
        "wrong-name.json": entry_json(advert(), os.getpid()),
        f"{ids[3]}.json": entry_json(advert(), 0),  # pid 0 would signal our process group
        f"{'0' * 32}.json": entry_json(advert(), os.getpid()).replace('"port": 7000', '"port": 0'),
    }
    for name, text in junk.items():
        (d / name).write_text(text)
    (d / "subdir").mkdir()
    (d / f"{'1' * 32}.json").symlink_to("/etc/passwd")
    real = advert(name="real")
    (d / f"{real.node_id}.json").write_text(entry_json(real, os.getpid()))

    disc = LocalDiscovery(tmp_path, poll_interval=POLL)
    found = Collector()
    async with trio.open_nursery() as nursery:
        await nursery.start(disc.run, advert(), found)
        await found.wait_for(real.node_id)
        await trio.sleep(POLL * 5)  # several scans: each junk file is counted once
        nursery.cancel_scope.cancel()
    assert set(found.seen) == {real.node_id}
    assert disc.statistics().malformed == len(junk) + 2
    for name in junk:
        assert (d / name).exists()  # junk is never deleted


async def test_meshes_are_isolated(tmp_path: Path) -> None:
    a, b = advert(mesh="alpha"), advert(mesh="beta")
    # An entry of mesh "beta" planted in alpha's directory is ignored as well.
    (tmp_path / "alpha").mkdir()
    planted = advert(mesh="beta")
    (tmp_path / "alpha" / f"{planted.node_id}.json").write_text(entry_json(planted, os.getpid()))
    da, db = (
        LocalDiscovery(tmp_path, poll_interval=POLL),
        LocalDiscovery(tmp_path, poll_interval=POLL),
    )
    ca, cb = Collector(), Collector()
    async with trio.open_nursery() as nursery:
        await nursery.start(da.run, a, ca)
        await nursery.start(db.run, b, cb)
        await trio.sleep(POLL * 10)
        nursery.cancel_scope.cancel()
    assert ca.seen == {} and cb.seen == {}
    assert da.statistics().other_mesh >= 1


async def test_known_peers_are_reported_again_after_refresh_interval(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    peer = advert()
    (tmp_path / "m" / f"{peer.node_id}.json").write_text(entry_json(peer, os.getpid()))
    disc = LocalDiscovery(tmp_path, poll_interval=POLL, refresh_interval=0.1)
    found = Collector()
    async with trio.open_nursery() as nursery:
        await nursery.start(disc.run, advert(), found)
        await trio.sleep(0.45)
        nursery.cancel_scope.cancel()
    assert 3 <= found.calls <= 6


async def test_own_entry_rewritten_if_removed(tmp_path: Path) -> None:
    me = advert()
    disc = LocalDiscovery(tmp_path, poll_interval=POLL)
    own = tmp_path / "m" / f"{me.node_id}.json"
    async with trio.open_nursery() as nursery:
        await nursery.start(disc.run, me, Collector())
        assert json.loads(own.read_text())["pid"] == os.getpid()
        own.unlink()
        with trio.fail_after(2):
            while not own.exists():
                await trio.sleep(POLL)
        nursery.cancel_scope.cancel()
    assert not own.exists()


def test_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        LocalDiscovery(tmp_path, poll_interval=0)
    with pytest.raises(ConfigError, match="unknown discovery kind"):
        make_discovery("carrier-pigeon")
    assert isinstance(make_discovery("local", registry_dir=tmp_path), LocalDiscovery)

    async def bad_advert() -> None:
        bad = Advert(mesh="../etc", node_id=uuid.uuid4().hex, name="x", host="127.0.0.1", port=1)
        await LocalDiscovery(tmp_path).run(bad, Collector())

    with pytest.raises(ConfigError, match="mesh"):
        trio.run(bad_advert)
    with pytest.raises(ConfigError):
        trio.run(LocalDiscovery(tmp_path).browse, "a/b", 1.0)


def test_default_registry_dir_ignores_the_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # The environment is read at the edge (ftmesh.settings), never by the library.
    monkeypatch.setenv("FTMESH_REGISTRY_DIR", str(tmp_path))
    assert default_registry_dir() == Path(f"/tmp/ftmesh-{os.getuid()}")
    assert LocalDiscovery().registry_dir == default_registry_dir()
    assert LocalDiscovery(tmp_path).registry_dir == tmp_path
