"""``/healthz`` and ``/readyz`` of real members on loopback (``ftmesh.metrics.probes``): a
member in another process is not ready while it joins, becomes ready as it enters the ring
(a view it shares with a member of this process), and is not ready again once it is done."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests_support import local_mesh_config

from ftmesh.mesh.blocking import SyncMesh
from ftmesh.metrics import server as metrics_server
from ftmesh.metrics.probes import Readiness

MEMBER = """
import sys
import ftmesh
with ftmesh.connect(mesh=sys.argv[1], discovery="local", registry_dir=sys.argv[2],
                    preset="local", metrics_port=0, role="joining",
                    handle_signals=False) as mesh:
    host, port = mesh.mesh.node.metrics_address
    print(f"{host}:{port}", flush=True)
    for line in sys.stdin:  # the test says which role to take next; EOF: leave
        mesh.set_role(line.strip())
        print("ok", flush=True)
"""
DEADLINE_S = 30.0
"""Longest wait for an answer to change (gossip on the ``local`` preset takes well under a
second); the test fails at it instead of hanging."""


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _wait_for(url: str, status: int, proc: subprocess.Popen[str]) -> str:
    """Polls ``url`` until it answers ``status`` (bounded by ``DEADLINE_S``); the body."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        got, body = _get(url)
        if got == status:
            return body
        assert proc.poll() is None, "the member exited"
        assert time.monotonic() < deadline, f"{url} still answers {got}: {body!r}"
        time.sleep(0.05)


@pytest.fixture
def member(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """A member in its own process, role ``joining``; yields it and its metrics URL."""
    proc = subprocess.Popen(
        [sys.executable, "-c", MEMBER, "readyz", str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "FTMESH_LOG_LEVEL": "warning"},
    )
    try:
        assert proc.stdout is not None
        addr = proc.stdout.readline().strip()
        assert addr, "the member did not start"
        yield proc, f"http://{addr}"
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _set_role(proc: subprocess.Popen[str], role: str) -> None:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(role + "\n")
    proc.stdin.flush()
    assert proc.stdout.readline().strip() == "ok"


def test_readyz_flips_as_a_member_enters_the_ring_and_when_it_is_done(
    tmp_path: Path, member: tuple[subprocess.Popen[str], str]
) -> None:
    proc, url = member
    config = local_mesh_config(tmp_path, "readyz")  # a training member here
    with SyncMesh.start(config) as here:
        status, body = _get(url + "/healthz")
        assert (status, body.startswith("ok")) == (200, True)
        status, body = _get(url + "/readyz")
        assert status == 503 and body.startswith("not ready: joining"), body
        assert body.count("\n") == 1
        _set_role(proc, "train")
        body = _wait_for(url + "/readyz", 200, proc)
        assert body.startswith("ready: in the ring"), body
        # ... the ring this process computes too: the view of both members.
        deadline = time.monotonic() + DEADLINE_S
        while (view := here.view()) is None or view.size < 2:
            assert time.monotonic() < deadline, "no view of two here"
            time.sleep(0.05)
        _set_role(proc, "done")
        body = _wait_for(url + "/readyz", 503, proc)
        assert body.startswith("not ready: done"), body
        assert _get(url + "/healthz")[0] == 200  # done is alive: it idles, not restarts
        # HEAD (some probes use it) gets the status without the body.
        req = urllib.request.Request(url + "/healthz", method="HEAD")
        with urllib.request.urlopen(req, timeout=5) as r:
            assert (r.status, r.read()) == (200, b"")


def test_a_server_without_a_mesh_is_live_but_never_ready() -> None:
    """The answers themselves (no socket): without a readiness source (no mesh) ``/readyz``
    is 503, and a reason is always one line."""
    render = lambda: b"m 1\n"  # noqa: E731
    ok = metrics_server._answer(b"GET /healthz HTTP/1.1\r\n\r\n", render, None)
    assert ok.startswith(b"HTTP/1.1 200 OK\r\n")
    no = metrics_server._answer(b"GET /readyz HTTP/1.1\r\n\r\n", render, None)
    assert no.startswith(b"HTTP/1.1 503 ") and no.endswith(b"not ready: no mesh on this node\n")
    odd = Readiness(False, "two\nlines")
    got = metrics_server._answer(b"GET /readyz?x=1 HTTP/1.1\r\n\r\n", render, lambda: odd)
    assert got.endswith(b"\r\n\r\nnot ready: two lines\n")
