"""The operator's side of ``examples/k8s/``, checked without a cluster: the probes hit paths
the member serves, on the port it serves them; every manifest validates against the
Kubernetes schemas (kubernetes-validate, offline; the PodMonitor, a custom resource, gets a
structural check); the kustomization lists the example's resources (and builds, where
kubectl is installed); the Grafana dashboard's queries read only golden metrics
(``test_metrics.GOLDEN``); the manifests' ``FTMESH_*`` variables are settings'.

``test_k8s_manifests.py`` holds the manifests to the CLI and the images; this file holds
them to the metrics server (``ftmesh.metrics``)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
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


# -- the schemas -------------------------------------------------------------------------

KUBERNETES = "1.33"
"""The Kubernetes version the manifests are validated against (kubernetes-validate bundles
its schemas: no cluster, no network)."""
CRD_GROUPS = ("monitoring.coreos.com/",)
"""API groups of custom resources, which kubernetes-validate has no schema for: checked by
``test_the_podmonitor_scrapes_the_pods_metrics_port`` instead."""
MANIFESTS = ("ftmesh-train.yaml", "ftmesh-autoscale.yaml", "podmonitor.yaml")
APPLIED_ALONE = {"ftmesh-autoscale.yaml"}
"""Manifests the kustomization leaves out on purpose (its header says why and how)."""


def _validate(doc: dict[str, Any]) -> None:
    import kubernetes_validate

    kubernetes_validate.validate(doc, KUBERNETES, strict=True)


@pytest.mark.parametrize("name", MANIFESTS)
def test_every_manifest_validates_against_the_kubernetes_schemas(name: str) -> None:
    docs = _docs(name)
    assert docs
    for doc in docs:
        if not doc["apiVersion"].startswith(CRD_GROUPS):
            _validate(doc)


def test_the_validation_catches_a_misspelled_field() -> None:
    """The check above can fail: a probe field misspelled is refused (strict mode)."""
    import kubernetes_validate

    (sts,) = [d for d in _docs("ftmesh-train.yaml") if d["kind"] == "StatefulSet"]
    probe = sts["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]
    probe["periodSecond"] = probe.pop("periodSeconds")
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(sts)


# -- the PodMonitor (a custom resource: a structural check) ------------------------------

_DURATION = re.compile(r"[0-9]+(ms|s|m|h)")
_POD_MONITOR_SPEC = {"selector", "podMetricsEndpoints", "namespaceSelector", "jobLabel"}
_ENDPOINT = {"port", "path", "interval", "scrapeTimeout", "scheme", "relabelings"}


def _seconds(duration: str) -> float:
    assert _DURATION.fullmatch(duration), duration
    n = float(re.sub(r"[a-z]+$", "", duration))
    return n * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[re.sub(r"^[0-9]+", "", duration)]


def test_the_podmonitor_scrapes_the_pods_metrics_port() -> None:
    (pm,) = _docs("podmonitor.yaml")
    assert (pm["apiVersion"], pm["kind"]) == ("monitoring.coreos.com/v1", "PodMonitor")
    assert set(pm["spec"]) <= _POD_MONITOR_SPEC
    (sts,) = [d for d in _docs("ftmesh-train.yaml") if d["kind"] == "StatefulSet"]
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert pm["spec"]["selector"]["matchLabels"].items() <= labels.items()
    ports = {p["name"] for p in _container()["ports"]}
    for ep in pm["spec"]["podMetricsEndpoints"]:
        assert set(ep) <= _ENDPOINT
        assert ep["port"] in ports and ep["port"] == "metrics"
        head = f"GET {ep['path']} HTTP/1.1\r\n\r\n".encode()
        assert metrics_server._answer(head, lambda: b"", None).startswith(b"HTTP/1.1 200 ")
        assert _seconds(ep["scrapeTimeout"]) <= _seconds(ep["interval"])


# -- the kustomization -------------------------------------------------------------------


def test_the_kustomization_lists_the_examples_resources() -> None:
    (k,) = _docs("kustomization.yaml")
    assert (k["apiVersion"], k["kind"]) == ("kustomize.config.k8s.io/v1beta1", "Kustomization")
    resources = set(k["resources"])
    assert all((K8S / r).is_file() for r in resources)
    assert resources == set(MANIFESTS) - APPLIED_ALONE
    text = (K8S / "kustomization.yaml").read_text()
    assert all(f"kubectl apply -f examples/k8s/{name}" in text for name in APPLIED_ALONE)
    (gen,) = k["configMapGenerator"]
    assert gen["files"] == ["grafana-dashboard.json"] and (K8S / gen["files"][0]).is_file()


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="needs kubectl (kustomize built in)")
def test_the_kustomization_builds_and_every_resource_validates() -> None:
    out = subprocess.run(
        ["kubectl", "kustomize", str(K8S)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == [
        "ConfigMap",
        "NetworkPolicy",
        "PodDisruptionBudget",
        "PodMonitor",
        "Service",
        "StatefulSet",
    ]
    for doc in docs:
        if not doc["apiVersion"].startswith(CRD_GROUPS):
            _validate(doc)
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap"]
    assert json.loads(cm["data"]["grafana-dashboard.json"])["uid"] == "ftmesh"


# -- the dashboard -----------------------------------------------------------------------

_NOT_NAMES = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and"}
_NOT_NAMES |= {"or", "unless", "offset", "Inf", "NaN", "inf", "nan"}


def _metric_names(expr: str) -> set[str]:
    """The series an expression reads: identifiers that are not functions (followed by
    ``(``), keywords, label names (in ``{...}``, ``by (...)``, Grafana's ``label_values``)
    or strings."""
    expr = re.sub(r'"(\\.|[^"\\])*"', '""', expr)
    expr = re.sub(r"label_values\(([^,]*),\s*\w+\s*\)", r"\1", expr)  # (Grafana's)
    expr = re.sub(r"\{[^}]*\}", "", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    found = re.finditer(r"(?<![\w.])([A-Za-z_:][\w:]*)(\s*\()?", expr)
    return {m.group(1) for m in found if not m.group(2) and m.group(1) not in _NOT_NAMES}


def _golden_series() -> set[str]:
    from test_metrics import GOLDEN

    out: set[str] = set()
    for name, (kind, _) in GOLDEN.items():
        if kind == "counter":
            out.add(name + "_total")
        elif kind == "histogram":
            out |= {name + s for s in ("_bucket", "_sum", "_count")}
        else:
            out.add(name)
    return out


def _queries(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("expr", "definition", "query") and isinstance(value, str):
                yield value
            else:
                yield from _queries(value)
    elif isinstance(node, list):
        for item in node:
            yield from _queries(item)


def test_the_dashboards_queries_read_only_golden_metrics() -> None:
    dash = json.loads((K8S / "grafana-dashboard.json").read_text())
    queries = [q for q in _queries(dash) if q != "prometheus"]  # (the datasource type)
    assert len(queries) > 20
    used = set().union(*(_metric_names(q) for q in queries))
    assert used - _golden_series() == set()
    # It shows what an operator asked for: loss, progress, membership, processes.
    assert {"ftmesh_train_loss", "ftmesh_train_committed_step", "ftmesh_members"} <= used
    assert {"process_resident_memory_bytes", "process_cpu_seconds_total"} <= used
    # The parser finds names (and so can fail): a made-up one is caught.
    assert _metric_names('rate(ftmesh_nope_total{pod=~"a"}[1m]) > on (pod) x') == {
        "ftmesh_nope_total",
        "x",
    }
    assert _metric_names('label_values(ftmesh_info{namespace=~"$n"}, pod)') == {"ftmesh_info"}


# -- agreement with the CLI --------------------------------------------------------------


def test_the_manifests_environment_is_the_clis() -> None:
    """Every ``FTMESH_*`` variable the manifests set is a setting's variable (a misspelled
    one would be ignored, silently)."""
    from ftmesh.settings import ENV

    names = {
        e["name"]
        for name in MANIFESTS
        for d in _docs(name)
        if d["kind"] == "StatefulSet"
        for c in d["spec"]["template"]["spec"]["containers"]
        for e in c.get("env", [])
    }
    ours = {n for n in names if n.startswith("FTMESH_")}
    assert ours and ours <= set(ENV.values())
