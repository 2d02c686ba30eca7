"""Observer views escape what members publish (issue #26, item 7): a member named with a
terminal escape sequence, publishing ``[/oops]`` in its progress,
next to ``ftmesh status --watch`` on a terminal (a pty: the ``rich`` live table) and on a pipe
(plain lines), and plain ``ftmesh status``: no crash, the text shown escaped."""

from __future__ import annotations

import io
import os
import pty
import select
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from tests_support import ROOT, local_mesh_config

from ftmesh import Progress, SyncMesh
from ftmesh.cli.live_view import member_rows, rich_table
from ftmesh.mesh.meta import PROGRESS_KEY

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
NAME = "\x1b[31mevil"
FAULT = "[/oops] [bold]x"
"""(Control characters in progress text make the member's metadata unusable: ``meta.py``.)"""
RAW = ("\x1b[31mevil",)
"""What must never reach a terminal as it was published."""


def _on_a_pty(argv: list[str], env: dict[str, str], timeout: float) -> tuple[int, str]:
    """Run ``argv`` with a pseudo-terminal as its stdout and stderr: its output and status."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, env=env)
    os.close(slave)
    out = b""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            out += chunk
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
        rc = proc.wait(timeout=30)
    return rc, out.decode(errors="replace")


def test_status_watch_escapes_member_text(tmp_path: Path) -> None:
    registry = tmp_path / "registry"
    base = local_mesh_config(registry, "oops")
    config = replace(base, node=replace(base.node, name=NAME))
    env = {**os.environ, "COLUMNS": "300", "LINES": "50", "TERM": "xterm"}
    env.pop("FTMESH_MESH", None)
    status = [sys.executable, "-m", "ftmesh", "status", "--mesh", "oops",
              "--registry-dir", str(registry)]  # fmt: skip
    with SyncMesh.start(config) as m:
        m.wait_view(min_members=1, timeout=30)
        m.report_progress(Progress(3, 0.1, 4, 40.0, 1, "tcp", FAULT))
        deadline = time.monotonic() + 30
        while not str(m.call_sync(lambda: m.mesh.node.me().meta.get(PROGRESS_KEY, ""))):
            assert time.monotonic() < deadline, "progress never published"
            time.sleep(0.05)
        rc, tty = _on_a_pty([*status, "--watch", "--count", "2", "--interval", "0.2"], env, 60)
        piped = subprocess.run(
            [*status, "--watch", "--count", "1"], capture_output=True, text=True, timeout=60,
            cwd=ROOT, env=env,
        )  # fmt: skip
        table = subprocess.run(status, capture_output=True, text=True, timeout=60, env=env)
        rows = member_rows(m.members())
    # On a terminal: the rich table, no MarkupError, the text as published but escaped.
    assert rc == 0 and "Traceback" not in tty and "MarkupError" not in tty, tty[-3000:]
    assert "[/oops]" in tty and "[bold]x" in tty and "\\x1b[31mevil" in tty, tty[-3000:]
    for raw in RAW:
        assert raw not in tty, tty[-3000:]
    # On a pipe, and plain status: the same, escaped.
    assert piped.returncode == 0, piped.stderr
    assert "\\x1b[31mevil" in piped.stdout and "[/oops]" in piped.stdout, piped.stdout
    assert table.returncode == 0, table.stderr
    assert "\\x1b[31mevil" in table.stdout, table.stdout
    for raw in RAW:
        assert raw not in piped.stdout and raw not in table.stdout
    # The rich table itself renders (no markup is read from a member's text).
    console_out = io.StringIO()
    from rich.console import Console

    Console(file=console_out, width=300, force_terminal=False).print(rich_table(rows, "t [/x]"))
    text = console_out.getvalue()
    assert "[/oops]" in text and "\\x1b[31mevil" in text and "t [/x]" in text, text
