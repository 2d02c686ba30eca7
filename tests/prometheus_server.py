"""A real Prometheus server on loopback for the metrics tests (Debian's ``prometheus``,
installed by ``scripts/setup.sh`` when root)."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

PROMETHEUS = shutil.which("prometheus")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PrometheusServer:
    """``prometheus`` scraping ``targets`` (``host:port`` of /metrics) every second."""

    def __init__(self, workdir: Path, targets: list[str]) -> None:
        if PROMETHEUS is None:
            raise RuntimeError("prometheus is not installed")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = workdir / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 900ms\n"
            "scrape_configs:\n  - job_name: ftmesh\n    static_configs:\n"
            f"      - targets: {json.dumps(targets)}\n"
        )
        self._log = (workdir / "prometheus.log").open("wb")
        self.proc = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={config}",
                f"--storage.tsdb.path={workdir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def query(self, expr: str) -> list[dict[str, Any]]:
        """Instant query; the result vector (``metric`` labels and ``value``)."""
        q = urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(f"{self.url}/api/v1/query?{q}", timeout=5) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return list(body["data"]["result"])

    def values(self, expr: str) -> dict[str, float]:
        """``{instance: value}`` of an instant query."""
        return {s["metric"].get("instance", ""): float(s["value"][1]) for s in self.query(expr)}

    def wait_for(self, expr: str, pred: Any, timeout: float) -> dict[str, float]:
        """Poll ``expr`` until ``pred(values)`` holds; returns those values."""
        deadline = time.monotonic() + timeout
        last: dict[str, float] | Exception = {}
        while time.monotonic() < deadline:
            try:
                last = self.values(expr)
                if pred(last):
                    return last
            except OSError as exc:  # not up yet
                last = exc
            time.sleep(0.5)
        raise AssertionError(f"{expr}: still {last!r} after {timeout}s")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()

    def __enter__(self) -> PrometheusServer:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
