"""One logging setup: text or JSON lines on stderr, for the CLI and for ``connect()``."""

from __future__ import annotations

import io
import json
import logging
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ftmesh import logs
from ftmesh.errors import ConfigError


def test_json_records_are_one_object_per_line() -> None:
    out = io.StringIO()
    logger = logs.configure("info", "json", out)
    logs.configure("info", "json", out)  # again: still one handler
    assert len([h for h in logger.handlers if h.get_name() == "ftmesh"]) == 1
    logging.getLogger("ftmesh.node").info("hello %s", "mesh")
    logging.getLogger("ftmesh.node").debug("not shown")
    try:
        raise KeyError("x")
    except KeyError:
        logging.getLogger("ftmesh.torch").exception("failed")
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    first, second = (json.loads(line) for line in lines)
    assert first["message"] == "hello mesh" and first["level"] == "info"
    assert first["logger"] == "ftmesh.node" and first["time"] > 0
    assert "KeyError" in second["exc"]
    logs.configure()  # back to the default for other tests


def test_bad_settings_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="log format"):
        logs.configure("info", "yaml")
    with pytest.raises(ConfigError, match="log level"):
        logs.configure("loud", "text")


def test_the_cli_logs_json_lines(tmp_path: Path) -> None:
    """``ftmesh node --log-format json``: a junk datagram's warning arrives as JSON."""
    argv = ["node", "--log-format", "json", "--mesh", "logs", "--events", "json"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "ftmesh", *argv, "--registry-dir", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        me = json.loads(proc.stdout.readline())
        host, _, port = me["addr"].rpartition(":")
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.sendto(b"junk", (host, int(port)))
        time.sleep(0.5)
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=10)
    records = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    dropped = [r for r in records if "dropped input" in r["message"]]
    assert dropped and dropped[0]["level"] == "warning", err
    assert all(line.startswith("{") for line in err.splitlines()), err
