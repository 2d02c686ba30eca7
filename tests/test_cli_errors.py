"""Every documented misconfiguration of ``ftmesh node|status|worker|launch``
(docs/guide/running.md, "When a setting is wrong") reaches the user as one line on stderr
naming the setting, with exit status 2 and no traceback. Real processes; nothing here depends
on this host's interfaces (the lab tests cover the interface choices)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from ftmesh.cli.main import run

ROOT = Path(__file__).resolve().parent.parent
CONNECT = str(ROOT / "tests" / "scripts" / "connect_only.py")
SERVE_STATE = str(ROOT / "tests" / "scripts" / "serve_state_only.py")
MISSING = "/nonexistent/mesh.secret"

CASES = [
    # (command line, text the one line must contain)
    (["node", "--port", "70000"], "--port"),
    (["node", "--port", "abc"], "--port"),
    (["node", "--secret-file", MISSING], "--secret-file"),
    (["node", "--encrypt"], "--secret-file"),
    (["node", "--join", "nonsense"], "--join"),
    (["node", "--mesh", ""], "--mesh"),
    (["node", "--discovery", "mdns", "--interface", "203.0.113.77"], "--interface"),
    (["node", "--preset", "fast"], "--preset"),
    (["status", "--discovery", "seeds"], "--join"),
    (["status", "--secret-file", MISSING], "--secret-file"),
    (["status", "--watch", "--interval", "0"], "--interval"),
    (["status", "--watch", "--count", "-1"], "--count"),
    (["worker", "examples/no_such_script.py"], "no such script"),
    (["worker", "-m", "no_such_module_here"], "-m"),
    (["worker"], "SCRIPT"),
    (["worker", "--secret-file", MISSING, CONNECT], "--secret-file"),
    (["worker", "--join", "10.0.0.4:7946", "--bind", "127.0.0.1", CONNECT], "--bind"),
    (["worker", "--start-peers", "-1", CONNECT], "--start-peers"),
    (["worker", "--data-port", "70000", CONNECT], "--data-port"),
    (["worker", "--data-port", "7947", "--state-port", "7947", CONNECT], "--state-port"),
    (["launch", "-n", "3", "--data-port", "7947", "--state-port", "7949", CONNECT], "overlap"),
    (["launch", "-n", "0", CONNECT], "-n"),
    (["launch", "-n", "2", "--timeout", "0", CONNECT], "--timeout"),
    (["launch", "-n", "2", "examples/no_such_script.py"], "no such script"),
    (["launch", "-n", "2", "--secret-file", MISSING, CONNECT], "--secret-file"),
    (["launch", "-n", "2", "-m"], "-m"),
]


_EMPTY = tempfile.TemporaryDirectory(prefix="ftmesh-cli-errors-")  # (removed at exit)
EMPTY_REGISTRY = _EMPTY.name
"""A registry no mesh writes to: ``ftmesh status`` finds nothing there (in the default one
it would note any mesh of this host, a line more)."""


def ftmesh(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("FTMESH_")}
    clean["FTMESH_REGISTRY_DIR"] = EMPTY_REGISTRY
    return subprocess.run(
        [sys.executable, "-m", "ftmesh", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**clean, **(env or {})},
    )


def assert_one_line(res: subprocess.CompletedProcess[str], named: str) -> None:
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert named in lines[0], lines[0]


@pytest.mark.parametrize(("argv", "named"), CASES, ids=[" ".join(c[0]) for c in CASES])
def test_misconfiguration_is_one_line_and_exit_2(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # In this process (the same code as the command; a process costs a second or two here):
    # the process-level behaviour is checked on a few of them below.
    for k in [k for k in os.environ if k.startswith("FTMESH_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("FTMESH_REGISTRY_DIR", EMPTY_REGISTRY)
    monkeypatch.chdir(ROOT)
    try:
        rc = run(argv)
    except SystemExit as exc:  # argparse
        rc = int(exc.code or 0)
    err = capsys.readouterr().err
    assert_one_line(subprocess.CompletedProcess(argv, rc, "", err), named)


@pytest.mark.slow
def test_as_processes_bad_flags_and_environment_are_one_line_and_exit_2() -> None:
    assert_one_line(ftmesh("node", "--port", "70000"), "--port")
    assert_one_line(ftmesh("launch", "-n", "2", "--timeout", "0", CONNECT), "--timeout")
    assert_one_line(ftmesh("worker", CONNECT, env={"FTMESH_PORT": "abc"}), "$FTMESH_PORT")
    res = ftmesh("worker", CONNECT, env={"FTMESH_DATA_PORT": "any"})
    assert_one_line(res, "$FTMESH_DATA_PORT")
    assert_one_line(ftmesh("status", env={"FTMESH_ENCRYPT": "maybe"}), "$FTMESH_ENCRYPT")


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


@pytest.mark.slow
def test_a_port_in_use_is_one_line_from_node_and_from_a_workers_script(
    taken_port: int, tmp_path: Path
) -> None:
    port = str(taken_port)
    assert_one_line(ftmesh("node", "--port", port), "--port")
    # The worker's script fails in ftmesh.connect(): the same line, not a traceback.
    reg = ["--registry-dir", str(tmp_path)]
    res = ftmesh("worker", "--discovery", "local", *reg, "--port", port, CONNECT)
    assert_one_line(res, "--port")
    # The flag is passed on, not dropped: the worker binds the port it was given.
    ok = ftmesh("worker", "--discovery", "local", *reg, "--port", "0", "--name", "w-9", CONNECT)
    assert ok.returncode == 0 and "as w-9" in ok.stdout, ok.stderr[-2000:]


@pytest.fixture
def taken_tcp_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.slow
def test_a_data_or_state_port_in_use_is_one_line_from_a_workers_script(
    taken_tcp_port: int, tmp_path: Path
) -> None:
    """The data plane binds in ``connect()``, the state server when the script (its trainer)
    serves state: either way one line naming the flag. And a free fixed port is bound."""
    port = str(taken_tcp_port)
    base = ["worker", "--discovery", "local", "--registry-dir", str(tmp_path), "--bind"]
    base.append("127.0.0.1")
    res = ftmesh(*base, "--data-port", port, CONNECT)
    assert_one_line(res, "--data-port")
    assert "in use" in res.stderr
    res = ftmesh(*base, "--state-port", port, SERVE_STATE)
    assert_one_line(res, "--state-port")
    assert "in use" in res.stderr
    with socket.socket() as s:  # free now (the race with another process is negligible)
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    ok = ftmesh(*base, "--state-port", str(free), SERVE_STATE)
    assert ok.returncode == 0 and f"state 127.0.0.1:{free}" in ok.stdout, ok.stderr
