"""The operator's side of ``examples/k8s/``, checked without a cluster: the probes hit paths
the member serves, on the port it serves them; (more below as the example grows).

``test_k8s_manifests.py`` holds the manifests to the CLI and the images; this file holds
them to the metrics server (``ftmesh.metrics``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from ftmesh.metrics import server as metrics_server

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "examples" / "k8s"


def _docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def _container() -> dict[str, Any]:
    (sts,) = [d for d in _docs("ftmesh-train.yaml") if d["kind"] == "StatefulSet"]
    container: dict[str, Any] = sts["spec"]["template"]["spec"]["containers"][0]
    return container


@pytest.mark.parametrize(
    ("probe", "path"),
    [("startupProbe", "/healthz"), ("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")],
)
def test_the_probes_ask_the_member_on_its_metrics_port(probe: str, path: str) -> None:
    c = _container()
    got = c[probe]["httpGet"]
    assert got["path"] == path
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert got["port"] == "metrics" and ports["metrics"] == int(env["FTMESH_METRICS_PORT"])
    # The member answers that path (a path it does not serve would be a 404: never ready).
    head = f"GET {path} HTTP/1.1\r\n\r\n".encode()
    answer = metrics_server._answer(head, lambda: b"", None)
    assert not answer.startswith(b"HTTP/1.1 404"), answer
    # Liveness must not kill a worker still importing torch: the startup probe covers it.
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 60
    assert c[probe]["timeoutSeconds"] <= c[probe]["periodSeconds"]
