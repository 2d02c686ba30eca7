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


def _sts() -> dict[str, Any]:
    (sts,) = [d for d in _docs("ftmesh-train.yaml") if d["kind"] == "StatefulSet"]
    return sts


def _job() -> dict[str, Any]:
    (job,) = [d for d in _docs("ftmesh-job.yaml") if d["kind"] == "Job"]
    return job


def _job_container() -> dict[str, Any]:
    container: dict[str, Any] = _job()["spec"]["template"]["spec"]["containers"][0]
    return container


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
MANIFESTS = ("ftmesh-train.yaml", "ftmesh-job.yaml", "ftmesh-autoscale.yaml", "podmonitor.yaml")
APPLIED_ALONE = {"ftmesh-autoscale.yaml", "ftmesh-job.yaml"}
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
    # It selects the StatefulSet's pods and the Job's, and nothing else.
    (expr,) = pm["spec"]["selector"]["matchExpressions"]
    assert (expr["key"], expr["operator"]) == ("app", "In")
    workloads = [sts, _job()]
    assert {w["spec"]["template"]["metadata"]["labels"]["app"] for w in workloads} == set(
        expr["values"]
    )
    ports = {p["name"] for p in _container()["ports"]}
    assert ports == {p["name"] for p in _job_container()["ports"]}
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
        if d["kind"] in ("StatefulSet", "Job")
        for c in d["spec"]["template"]["spec"]["containers"]
        for e in c.get("env", [])
    }
    ours = {n for n in names if n.startswith("FTMESH_")}
    assert ours and ours <= set(ENV.values())


# -- the Indexed Job (ftmesh-job.yaml) ---------------------------------------------------


def _job_docs() -> dict[str, dict[str, Any]]:
    docs = _docs("ftmesh-job.yaml")
    by_kind = {d["kind"]: d for d in docs}
    assert len(by_kind) == len(docs)
    return by_kind


def _parsed(container: dict[str, Any]) -> Any:
    from ftmesh.cli.main import build_parser
    from ftmesh.lab.pods import expand_vars

    fake = {"POD_IP": "10.0.0.7", "POD_NAMESPACE": "ns1"}
    argv = [expand_vars(str(a), fake) for a in [*container["command"], *container["args"]]]
    assert argv[:2] == ["ftmesh", "worker"], "the worker must be the container's PID 1"
    return build_parser().parse_args(argv[1:])


def _script_options(args: Any) -> Any:
    import importlib.util

    script = ROOT / args.target[0]  # relative to workingDir, where the image holds the repo
    spec = importlib.util.spec_from_file_location("train_digits_for_job_test", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build_parser().parse_args(args.target[1:])


def test_the_job_is_an_indexed_job_the_api_server_accepts() -> None:
    """What the JSON schema cannot say and the API server checks (the Job's validation):
    Indexed with completions for a successPolicy, restartPolicy Never for a
    podFailurePolicy and backoffLimitPerIndex, podReplacementPolicy Failed with a
    podFailurePolicy; and one index per worker, all at once."""
    spec = _job()["spec"]
    pod = spec["template"]["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] >= 2
    assert pod["restartPolicy"] == "Never"
    assert spec["podReplacementPolicy"] == "Failed"
    (rule,) = spec["successPolicy"]["rules"]
    assert set(rule) == {"succeededCount"}  # any index: see the exit statuses below
    assert 1 <= rule["succeededCount"] <= spec["completions"]
    assert spec["backoffLimitPerIndex"] >= 1 and "backoffLimit" not in spec
    assert 0 <= spec["maxFailedIndexes"] < spec["completions"]
    assert pod["terminationGracePeriodSeconds"] >= 30  # the StatefulSet's: a departure


def test_the_job_runs_the_statefulsets_worker_under_its_own_names() -> None:
    """Same image, env, ports, probes, resources and worker flags as the StatefulSet; the
    seeds are the Job's own headless Service, which is the pods' subdomain; the Job's pods
    and the StatefulSet's never select each other."""
    docs, job = _job_docs(), _job()
    svc, pod = docs["Service"], job["spec"]["template"]
    (sts_svc,) = [d for d in _docs("ftmesh-train.yaml") if d["kind"] == "Service"]
    ours, theirs = _job_container(), _container()
    for key in (set(ours) | set(theirs)) - {"command", "args", "volumeMounts"}:
        assert ours.get(key) == theirs.get(key), key
    # The secret's mount is the same; the StatefulSet's claims become the Job's shared one.
    assert ours["volumeMounts"][0] == theirs["volumeMounts"][0]
    assert ours["volumeMounts"][0]["name"] == "mesh-secret"
    labels = pod["metadata"]["labels"]
    assert pod["metadata"]["annotations"] == _sts()["spec"]["template"]["metadata"]["annotations"]
    assert labels["app"] != _sts()["spec"]["template"]["metadata"]["labels"]["app"]
    assert pod["spec"]["subdomain"] == svc["metadata"]["name"]
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"]
    assert svc["spec"]["selector"].items() <= labels.items()
    assert svc["spec"]["ports"] == sts_svc["spec"]["ports"]
    args, sts_args = _parsed(ours), _parsed(theirs)
    assert args.join == [f"{svc['metadata']['name']}.ns1.svc.cluster.local:{args.port}"]
    differ = {k for k, v in vars(args).items() if getattr(sts_args, k) != v}
    assert differ == {"join", "target"}, differ
    assert args.start_peers == job["spec"]["parallelism"]  # a fresh mesh: every index


def test_the_jobs_worker_exits_0_only_when_the_run_is_done() -> None:
    """No ``--idle-when-done`` (a finished worker exits 0: the Job's success); a planned
    departure exits a status the podFailurePolicy ignores (an index replaced, not counted),
    never 0 (a deleted pod that exits 0 is a succeeded index) nor 2 (argparse's usage error,
    which fails the Job at once); a disruption is ignored too. The script parses its
    arguments with its own parser."""
    job, c = _job(), _job_container()
    opts = _script_options(_parsed(c))
    assert not opts.idle_when_done
    rules = job["spec"]["podFailurePolicy"]["rules"]
    codes: dict[str, set[int]] = {}
    for rule in rules:
        if "onExitCodes" in rule:
            on = rule["onExitCodes"]
            assert on["containerName"] == c["name"] and on["operator"] == "In"
            codes.setdefault(rule["action"], set()).update(on["values"])
    assert opts.departed_exit_code in codes["Ignore"]
    assert opts.departed_exit_code not in (0, 2)
    assert codes["FailJob"] == {2}
    disruption = {"onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
    assert {"action": "Ignore", **disruption} in rules
    # The final model goes to the shared claim (every worker writes the same weights).
    docs = _job_docs()
    claim = docs["PersistentVolumeClaim"]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    volumes = {v["name"]: v for v in job["spec"]["template"]["spec"]["volumes"]}
    (mount,) = [
        m
        for m in c["volumeMounts"]
        if volumes[m["name"]].get("persistentVolumeClaim", {}).get("claimName")
        == claim["metadata"]["name"]
    ]
    assert Path(opts.save_model).is_relative_to(mount["mountPath"])


def test_the_jobs_network_policy_opens_exactly_the_members_fixed_ports() -> None:
    docs, c = _job_docs(), _job_container()
    args = _parsed(c)
    policy = docs["NetworkPolicy"]["spec"]
    labels = _job()["spec"]["template"]["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= labels.items()
    assert policy["policyTypes"] == ["Ingress"]
    members = {(args.port, "UDP"), (args.port, "TCP")}
    members |= {(args.data_port, "TCP"), (args.state_port, "TCP")}
    metrics = int({e["name"]: e.get("value") for e in c["env"]}["FTMESH_METRICS_PORT"])
    opened: dict[str, set[tuple[int, str]]] = {}
    for rule in policy["ingress"]:
        ports = {(p["port"], p["protocol"]) for p in rule["ports"]}
        if "from" in rule:
            (peer,) = rule["from"]
            assert set(peer) == {"podSelector"}
            assert peer["podSelector"]["matchLabels"].items() <= labels.items()
            opened.setdefault("members", set()).update(ports)
        else:
            opened.setdefault("anyone", set()).update(ports)
    assert opened == {"members": members, "anyone": {(metrics, "TCP")}}
    declared = {p["name"]: (p["containerPort"], p["protocol"]) for p in c["ports"]}
    assert declared["data"] == (args.data_port, "TCP")
    assert declared["state"] == (args.state_port, "TCP")
    assert declared["metrics"] == (metrics, "TCP")


def test_the_validation_catches_a_misspelled_success_policy() -> None:
    """The 1.33 schema knows successPolicy (GA there): a misspelled rule field is refused."""
    import kubernetes_validate

    job = _job()
    rule = job["spec"]["successPolicy"]["rules"][0]
    rule["succeededCnt"] = rule.pop("succeededCount")
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(job)
