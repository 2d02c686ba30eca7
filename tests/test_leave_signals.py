"""SIGTERM / SIGINT to a process that joined with ``ftmesh.connect()``: the first asks the
mesh to leave (``leave_requested()``, ``wait_leave_requested()``) and then calls the program's
own handler; a second leaves at once through normal unwinding (``SystemExit(128 + the signal
number)``, the ``finally`` blocks run); ``close()`` puts the previous handlers back;
``connect(handle_signals=False)`` leaves the host's handlers alone. Real processes, a
same-host mesh (no network beyond loopback)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tests_support import ROOT

from ftmesh.mesh.blocking import REPEAT_AFTER_S

pytestmark = pytest.mark.timeout(120)

SCRIPT = """
import signal, sys, time
import ftmesh

before = signal.getsignal(signal.SIGTERM)
with ftmesh.connect(preset="local") as mesh:
    assert not mesh.leave_requested()
    print("ready", flush=True)
    assert mesh.wait_leave_requested(timeout=60), "no leave request"
    print("leave requested", flush=True)
    if sys.argv[1] == "twice":
        try:
            time.sleep(60)  # the second signal ends us here
            print("still alive", flush=True)
        finally:
            print("unwound", flush=True)
    if sys.argv[1] == "hold":
        time.sleep(2.0)  # a second copy of the same stop arrives here: ignored
        print("still here", flush=True)
assert signal.getsignal(signal.SIGTERM) is before, "handlers not restored"
print("restored", flush=True)
"""


def _start(tmp_path: Path, mode: str) -> subprocess.Popen[str]:
    env = {
        **os.environ,
        "FTMESH_REGISTRY_DIR": str(tmp_path / "registry"),
        "FTMESH_MESH": f"signals-{os.getpid()}-{mode}",
        "PYTHONPATH": str(ROOT),
    }
    return subprocess.Popen(
        [sys.executable, "-c", SCRIPT, mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )


def _expect(proc: subprocess.Popen[str], line: str) -> None:
    assert proc.stdout is not None
    got = proc.stdout.readline().strip()
    assert got == line, (got, proc.stderr.read() if proc.poll() is not None else "")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["TERM", "INT"])
def test_a_signal_asks_to_leave_and_close_restores_the_handlers(
    tmp_path: Path, sig: signal.Signals
) -> None:
    proc = _start(tmp_path, "once")
    try:
        _expect(proc, "ready")
        proc.send_signal(sig)
        _expect(proc, "leave requested")
        _expect(proc, "restored")
        assert proc.wait(30) == 0
        assert proc.stderr is not None
        err = proc.stderr.read()
        assert f"ftmesh: {sig.name}: leaving the mesh at the next step" in err, err
        assert "Traceback" not in err, err
    finally:
        proc.kill()


def test_one_stop_delivered_twice_is_one_stop(tmp_path: Path) -> None:
    """``timeout`` signals its command and then the command's process group: a second SIGTERM
    within ``REPEAT_AFTER_S`` of the first is the same request to leave, not "again: leave
    now" (a launcher under ``timeout -s TERM`` once killed its workers instead of letting
    them depart)."""
    proc = _start(tmp_path, "hold")
    try:
        _expect(proc, "ready")
        proc.send_signal(signal.SIGTERM)
        first = time.monotonic()
        _expect(proc, "leave requested")  # (the first was handled)
        proc.send_signal(signal.SIGTERM)
        if time.monotonic() - first >= REPEAT_AFTER_S:  # (a host too loaded to send it soon:
            assert proc.wait(10) == 128 + signal.SIGTERM  # then it is "again", by the rule)
            return
        _expect(proc, "still here")
        _expect(proc, "restored")
        assert proc.wait(30) == 0
        assert proc.stderr is not None
        err = proc.stderr.read()
        assert err.count("leaving the mesh at the next step") == 1, err
        assert "again: leaving now" not in err, err
    finally:
        proc.kill()


def test_a_second_signal_exits_at_once(tmp_path: Path) -> None:
    proc = _start(tmp_path, "twice")
    try:
        _expect(proc, "ready")
        proc.send_signal(signal.SIGTERM)
        first = time.monotonic()
        _expect(proc, "leave requested")
        time.sleep(max(0.0, first + REPEAT_AFTER_S + 0.2 - time.monotonic()))
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 128 + signal.SIGTERM
        assert time.monotonic() - t0 < 5
        assert proc.stdout is not None
        out = proc.stdout.read()
        assert "still alive" not in out and "unwound" in out, out
    finally:
        proc.kill()


HOST = """
import os, signal, sys
import ftmesh

seen = []
signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
mesh = ftmesh.connect(preset="local", handle_signals=sys.argv[1] == "on")
print("ready", flush=True)
left = mesh.wait_leave_requested(timeout=3)
print(f"host handler ran: {seen == [signal.SIGTERM]}; mesh asked to leave: {left}", flush=True)
mesh.close()
"""


@pytest.mark.parametrize(
    ("mode", "left"), [("on", True), ("off", False)], ids=["chained", "handle_signals=False"]
)
def test_the_hosts_own_handler_still_runs(tmp_path: Path, mode: str, left: bool) -> None:
    """An embedding host's SIGTERM handler runs whether ftmesh handles the signal (after
    asking the mesh to leave) or not (``handle_signals=False``: the mesh is not told)."""
    env = {
        **os.environ,
        "FTMESH_REGISTRY_DIR": str(tmp_path / "registry"),
        "FTMESH_MESH": f"host-{os.getpid()}-{mode}",
        "PYTHONPATH": str(ROOT),
    }
    proc = subprocess.Popen(
        [sys.executable, "-c", HOST, mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    try:
        _expect(proc, "ready")
        proc.send_signal(signal.SIGTERM)
        _expect(proc, f"host handler ran: True; mesh asked to leave: {left}")
        assert proc.wait(30) == 0
    finally:
        proc.kill()
