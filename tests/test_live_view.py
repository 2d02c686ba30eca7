"""The live view from the mesh itself (issue #16): members publish their progress in their
metadata (``report_progress``, rate limited), ``ftmesh status --watch`` shows it, and
``ftmesh launch`` drives its view, ``--kill-at`` and ``--join-at`` from it, with a training
script that prints nothing (``tests/scripts/silent_worker.py``)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

import pytest
from tests_support import ROOT, local_mesh_config

from ftmesh import Progress, SyncMesh
from ftmesh.collective.backend import DEVICES_KEY
from ftmesh.mesh.meta import PROGRESS_KEY, read_member
from ftmesh.torch.driver import joinable

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
SILENT = str(ROOT / "tests" / "scripts" / "silent_worker.py")
T = TypeVar("T")


def _until(what: Callable[[], T | None], timeout: float, why: str) -> T:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = what()
        if got is not None:
            return got
        time.sleep(0.02)
    raise AssertionError(f"not within {timeout}s: {why}")


def _published(mesh: SyncMesh) -> str:
    return str(mesh.call_sync(lambda: mesh.mesh.node.me().meta.get(PROGRESS_KEY, "")))


def test_report_progress_is_rate_limited_and_status_watch_shows_it(tmp_path: Path) -> None:
    registry = tmp_path / "registry"
    base = local_mesh_config(registry, "watch")
    interval = base.progress_interval
    a_cfg, b_cfg = (replace(base, node=replace(base.node, name=n)) for n in ("m0", "m1"))
    with SyncMesh.start(a_cfg) as a, SyncMesh.start(b_cfg) as b:
        a.wait_view(min_members=2, timeout=30)
        a.report_progress(Progress(1, 0.01, 4, 400.0, 2))
        _until(lambda: _published(a).startswith("1|") or None, 5, "the first report, at once")
        t_first = time.monotonic()
        wakes = []  # the mesh thread is woken about once per interval, not once per report
        wake = a.mesh.wake_progress

        def counted_wake() -> None:
            wakes.append(1)
            wake()

        a.mesh.wake_progress = counted_wake  # type: ignore[method-assign]
        for step in range(2, 51):  # a burst within the interval: only the last one counts
            a.report_progress(Progress(step, 0.01, 4, 400.0, 2))
            time.sleep(0.001)
        burst_s = time.monotonic() - t_first
        if time.monotonic() - t_first < interval / 2:
            time.sleep(0.05)
            assert _published(a).startswith("1|"), "published again within the interval"
        _until(
            lambda: _published(a).startswith("50|") or None,
            interval + 3,
            "the latest report, at the end of the interval",
        )
        time.sleep(interval * 1.2)
        assert a.mesh.progress_published == 2, a.mesh.progress_published
        most = 1 if burst_s < interval else 2  # (one more if the burst outlasted the interval)
        assert 1 <= len(wakes) <= most, f"{len(wakes)} wake-ups of the mesh thread, 49 reports"
        # b learns it through gossip, validated like every other key.
        b.report_progress(Progress(7, 0.02, 4, 200.0, 2, "tcp", "peer lost 3f2a"))

        def a_seen_by_b(step: int) -> Progress | None:
            m0 = [read_member(m) for m in b.members() if m.name == "m0"]
            p = m0[0].progress if m0 else None
            return p if p is not None and p.step == step else None

        assert _until(lambda: a_seen_by_b(50), 10, "m1 sees m0's progress").world == 2
        res = subprocess.run(
            [sys.executable, "-m", "ftmesh", "status", "--watch", "--count", "2",
             "--interval", "0.5", "--mesh", "watch", "--registry-dir", str(registry)],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )  # fmt: skip
        as_json = subprocess.run(
            [sys.executable, "-m", "ftmesh", "status", "--watch", "--count", "1", "--json",
             "--mesh", "watch", "--registry-dir", str(registry)],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )  # fmt: skip
        (read,) = [json.loads(line) for line in as_json.stdout.splitlines()]
        by_name = {m["name"]: m for m in read["members"]}
        assert by_name["m0"]["progress"]["step"] == 50 and by_name["m0"]["role"] == "train"
        assert by_name["m1"]["progress"]["fault"] == "peer lost 3f2a"
        # The running page's command as written (the mesh from the environment) runs until Ctrl-C.
        env = {**os.environ, "FTMESH_MESH": "watch", "FTMESH_REGISTRY_DIR": str(registry)}
        watch = subprocess.Popen(
            [sys.executable, "-m", "ftmesh", "status", "--watch"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=env,
        )
        guard = threading.Timer(60, watch.kill)  # (a read that never comes ends the test)
        guard.start()
        try:
            assert watch.stdout is not None
            first = ""
            while (line := watch.stdout.readline()) not in ("", "\n"):  # one read's block
                first += line
            watch.send_signal(signal.SIGINT)
            _, err = watch.communicate(timeout=30)
        finally:
            guard.cancel()
        # A step reported while throttled, just before leaving, is not lost: it goes out
        # with the leave.
        a.report_progress(Progress(51, 0.01, 4, 400.0, 2))
        a.report_progress(Progress(52, 0.01, 4, 400.0, 2))
        a.close()
        last = _until(lambda: (p := a_seen_by_b(52)) and p, 10, "m0's last step, as it left")
        assert last.step == 52
    assert watch.returncode == 0 and "Traceback" not in err, (watch.returncode, err)
    assert first.startswith("mesh watch at ") and "m0  " in first and "m1  " in first, first
    assert res.returncode == 0, res.stdout + res.stderr
    blocks = [b for b in res.stdout.split("\n\n") if b.strip()]
    assert len(blocks) == 2, res.stdout
    for block in blocks:
        assert block.startswith("mesh watch at ") and ": 2 members" in block, block
        rows = {line.split()[0]: line.split() for line in block.splitlines()[1:]}
        assert rows["NAME"][:4] == ["NAME", "STATE", "ROLE", "STEP"], block
        assert rows["m0"][:4] == ["m0", "alive", "train", "50"], block
        assert rows["m0"][6:10] == ["400.0", "2", "tcp", "cpu"], block
        assert rows["m1"][:4] == ["m1", "alive", "train", "7"], block
        assert " ".join(rows["m1"][10:]) == "peer lost 3f2a", block


def _set_devices(mesh: SyncMesh, entry: str) -> None:
    """Publish ``entry`` as this member's devices, as ``enable_gpu`` does with its own."""
    node = mesh.mesh.node
    mesh.call_sync(lambda: node.update_meta({**node.me().meta, DEVICES_KEY: entry}))


def _status(registry: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ftmesh", "status", "--mesh", "gpus",
         "--registry-dir", str(registry), *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )  # fmt: skip


def _before_the_plan(out: str) -> list[str]:
    """``status``'s lines up to the ring plan's (``ring plan: ...`` and its site and ring
    lines come last: ``test_ring_plan_mesh.py`` reads them)."""
    lines = out.splitlines()
    at = [i for i, ln in enumerate(lines) if ln.startswith("ring plan: ")]
    assert len(at) == 1, out
    return lines[: at[0]]


def test_status_shows_devices_and_the_view_backend(tmp_path: Path) -> None:
    """Three members: one advertises a GPU with NCCL 2.21.5, one publishes a devices entry
    that does not parse, one none. ``status`` shows each member's devices (``?`` for the
    bad one, warned about) and the view's backend as the members derive it: staged, with
    why; once all three advertise the same NCCL, nccl."""
    registry = tmp_path / "registry"
    base = local_mesh_config(registry, "gpus")
    cfgs = [replace(base, node=replace(base.node, name=n)) for n in ("g0", "g1", "g2")]
    with (
        SyncMesh.start(cfgs[0]) as g0,
        SyncMesh.start(cfgs[1]) as g1,
        SyncMesh.start(cfgs[2]) as g2,
    ):
        g0.wait_view(min_members=3, timeout=30)
        _set_devices(g0, "cuda=1,nccl=22105")
        _set_devices(g1, "cuda=1;nccl=22105")

        def entries() -> dict[str, object] | None:
            """The entries every member sees, if they all see the same (status may ask any)."""
            seen = [{m.name: m.meta.get(DEVICES_KEY) for m in g.members()} for g in (g0, g1, g2)]
            return seen[0] if all(s == seen[0] for s in seen) else None

        want = {"g0": "cuda=1,nccl=22105", "g1": "cuda=1;nccl=22105", "g2": None}
        _until(lambda: entries() == want or None, 10, "every member sees both entries")
        table = _status(registry)
        as_json = _status(registry, "--json")
        watch = _status(registry, "--watch", "--count", "1")
        watch_json = _status(registry, "--watch", "--count", "1", "--json")
        _set_devices(g1, "cuda=2,nccl=22105")
        _set_devices(g2, "cuda=1,nccl=22105")
        done = {"g0": "cuda=1,nccl=22105", "g1": "cuda=2,nccl=22105", "g2": "cuda=1,nccl=22105"}
        _until(lambda: entries() == done or None, 10, "every member sees every GPU")
        nccl = _status(registry)
    for res in (table, as_json, watch, watch_json, nccl):
        assert res.returncode == 0 and "Traceback" not in res.stderr, res.stdout + res.stderr
    staged = (
        "view backend (3 members): tcp ring (host buffers; GPU buffers staged: "
        "g1: devices entry does not parse; g2: no GPU)"
    )
    # Plain status: a DEVICES column, the backend line last before the ring plan's lines, the
    # bad entry warned about.
    lines = _before_the_plan(table.stdout)
    header = lines[0].split()
    assert header[5:] == ["DEVICES", "META"], table.stdout
    cells = {ln.split()[0]: ln.split()[5] for ln in lines[1:-1]}
    assert cells == {"g0": "cuda=1,nccl=2.21.5", "g1": "?", "g2": "cpu"}, table.stdout
    assert lines[-1] == staged, table.stdout
    assert "warning: g1: devices does not parse: 'cuda=1;nccl=22105'" in table.stderr
    # --json: still a list of members, each with its devices.
    by_name = {m["name"]: m for m in json.loads(as_json.stdout)}
    assert by_name["g0"]["devices"] == {"cuda": 1, "nccl": 22105, "nccl_version": "2.21.5"}
    assert by_name["g1"]["devices"] is None and "does not parse" in by_name["g1"]["devices_problem"]
    assert by_name["g2"]["devices"] is None and "devices_problem" not in by_name["g2"]
    # --watch: the DEVICES column (before LAST FAULT) and the backend line under the table.
    block = _before_the_plan(watch.stdout.strip())
    watch_rows = {ln.split()[0]: ln.split() for ln in block[1:-1]}
    columns = watch_rows["NAME"][10:]  # (the header's STEP TIME is two words)
    assert columns == ["DEVICES", "LAST", "FAULT"], watch.stdout
    got = {n: watch_rows[n][9] for n in ("g0", "g1", "g2")}
    assert got == {"g0": "cuda=1,nccl=2.21.5", "g1": "?", "g2": "cpu"}, watch.stdout
    assert block[-1] == staged, watch.stdout
    # --watch --json: each member's devices and the read's backend.
    (read,) = [json.loads(line) for line in watch_json.stdout.splitlines()]
    backend = read["backend"]
    assert backend["gpu_buffers"] == "staging" and backend["host_buffers"] == "tcp"
    assert sorted(backend["members"]) == ["g0", "g1", "g2"] and backend["line"] == staged
    assert backend["staged_because"] == ["g1: devices entry does not parse", "g2: no GPU"]
    watch_by_name = {m["name"]: m for m in read["members"]}
    assert watch_by_name["g0"]["devices"]["nccl_version"] == "2.21.5"
    assert "devices_problem" in watch_by_name["g1"]
    # Every member on NCCL 2.21.5: the view takes it for GPU buffers.
    assert _before_the_plan(nccl.stdout)[-1] == (
        "view backend (3 members): nccl (NCCL 2.21.5 on every member; host buffers: tcp ring)"
    ), nccl.stdout
    assert "devices" not in nccl.stderr, nccl.stderr


def _records(path: Path) -> dict[str, dict[int, int]]:
    """Each worker's own records: step -> world size (a killed worker's last line may be cut
    short: it is not a record)."""
    out: dict[str, dict[int, int]] = {}
    for f in path.glob("w*.jsonl"):
        out[f.stem] = {}
        for line in f.read_text().splitlines():
            if line.endswith("}"):
                r = json.loads(line)
                out[f.stem][r["step"]] = r["world"]
    return out


def test_launch_view_kill_and_join_of_a_script_that_prints_nothing(tmp_path: Path) -> None:
    records = tmp_path / "records"
    records.mkdir()
    env = {**os.environ, "SILENT_RECORDS": str(records), "SILENT_STEPS": "44"}
    res = subprocess.run(
        [sys.executable, "-m", "ftmesh", "launch", "--no-live", "--log-dir", str(tmp_path / "logs"),
         "-n", "3", "--kill-at", "8", "--join-at", "12", SILENT],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
        env=env,
    )  # fmt: skip
    out = res.stdout
    assert res.returncode == 0, out[-3000:] + res.stderr[-3000:]
    for log in (tmp_path / "logs").glob("w*.log"):
        assert "FTMESH " not in log.read_text(), f"{log} printed progress records"
    own = _records(records)
    assert sorted(own) == ["w0", "w1", "w2", "w3"], out[-3000:]
    # The kill fired once the members' published steps reached 8, not before.
    kill = re.search(r"step (\d+): kill -9 (w\d) \(at its step (\d+)\)", out)
    assert kill, out[-3000:]
    at, victim = int(kill.group(1)), kill.group(2)
    assert 8 <= at <= 20 and victim in ("w0", "w1", "w2"), kill.group(0)
    assert 8 <= max(own[victim]) <= at + 12, (at, max(own[victim]))
    # The joiner was started at 12 (or a little later) and "joins" at its own first committed step.
    started = re.search(r"step (\d+): w3 started to join", out)
    joined = re.search(r"step (\d+): w3 joins \(world (\d+)\)", out)
    assert started and joined, out[-3000:]
    first, at_join = min(own["w3"]), int(joined.group(1))
    assert int(started.group(1)) >= 12 and first >= int(started.group(1)), (started, first)
    # (the first step it published; the launcher reads a few times a second: at most a few
    # steps later under load)
    assert first <= at_join <= first + 8, (first, joined.group(0))
    assert int(joined.group(2)) == own["w3"][at_join] == 3
    # Every world size the view showed is the one that member recorded for that step.
    shown = re.findall(r"(w\d) (\d+)/(\d+)", out)
    assert len(shown) >= 10, out[-3000:]
    for name, step, world in shown:
        assert own[name][int(step)] == int(world), (name, step, world, own[name])
    worlds = [int(w) for w in re.findall(r"^  step \d+  world (\d+)", out, re.M)]
    assert 3 in worlds and 2 in worlds, worlds  # before the kill, after it (and the join)
    # Every exit is reported, in the view and in the summary.
    summary = out.split("\nworkers:\n")[1]
    for name in ("w0", "w1", "w2", "w3"):
        assert re.search(rf"\] {name} ended: ", out), name
        line = re.search(rf"^  {name} \(pid \d+\): (.*) at step (\d+)", summary, re.M)
        assert line, summary
        if name == victim:
            assert line.group(1) == "killed by the launcher (signal SIGKILL)", line.group(0)
        else:
            assert line.group(1) == "exit code 0", line.group(0)
    assert "never fired" not in out


def test_published_progress_does_not_keep_membership_awake(tmp_path: Path) -> None:
    """A joiner waits for membership to be quiet (``wait_quiet``) before it enters the ring;
    the progress training members publish about once a second must not count as activity,
    or a joiner would wait out its whole timeout (it did: ``bench recovery``'s replacement
    never joined)."""
    base = local_mesh_config(tmp_path / "registry", "quiet")
    settle = base.progress_interval * 1.5
    with SyncMesh.start(base) as a, SyncMesh.start(base) as b:
        a.wait_view(min_members=2, timeout=30)
        stop = threading.Event()

        def publish() -> None:
            step = 0
            while not stop.wait(0.1):
                step += 1
                a.report_progress(Progress(step, 0.1, 4, 40.0, 2))

        t = threading.Thread(target=publish, daemon=True)
        t.start()
        try:
            time.sleep(base.progress_interval * 2)  # (some of it published)
            started = time.monotonic()
            b.wait_quiet(settle, timeout=30.0)
            waited = time.monotonic() - started
        finally:
            stop.set()
            t.join(5)
        assert _published(a), "nothing was published"
    assert waited < 20.0, f"wait_quiet ran to its timeout ({waited:.1f}s)"


def test_a_joiner_stops_settling_once_it_sees_a_training_mesh(tmp_path: Path) -> None:
    """``Settle`` (the driver's ``wait_quiet`` with ``until``) ends as soon as the member sees
    a training mesh (a ``train`` member advertising a committed state), however long the
    settle: a joiner does not wait for quiet membership (issue #30). The member that only
    starts (no state advertised) does not end it: that is a cold start."""
    base = local_mesh_config(tmp_path / "registry", "joiner")
    settle = 6.0
    with SyncMesh.start(base) as a, SyncMesh.start(base) as b:
        a.wait_view(min_members=1, timeout=30)
        a.set_role("train")
        _until(lambda: any(m.node == a.node_id for m in b.members()) or None, 30, "b sees a")
        # a trains but has no committed state: not a mesh to join; b settles the whole time
        # (at most its timeout, here shorter than the settle).
        started = time.monotonic()
        b.wait_quiet(settle, timeout=1.0, until=joinable)
        assert time.monotonic() - started >= 0.9
        a.advertise_state(1000)  # (as after its first committed step)
        started = time.monotonic()
        b.wait_quiet(settle, timeout=30.0, until=joinable)
        waited = time.monotonic() - started
    assert waited < settle / 2, f"b settled {waited:.1f}s beside a training mesh"
