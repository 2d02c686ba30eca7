"""What a cluster would catch in ``examples/k8s/``, checked without one: the manifests parse
and agree with each other (names, labels, ports, volumes, env), with the Dockerfiles, and
with the CLI: the worker's command is parsed by ``ftmesh worker``'s own parser and the
script's arguments by the script's, so a flag that does not exist fails here. The pod
behaviour itself (DNS, PID 1, SIGTERM, joins, restarts) runs in ``test_k8s_pods.py``.

Not checked here: that a worker serves the metrics the autoscaler reads. That is issue #16's
exporter (``FTMESH_METRICS_PORT``); this test only holds the HPA, the adapter rule and the
pod template to the metric names agreed in that issue and to one port.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from ftmesh.cli.main import build_parser
from ftmesh.lab.pods import expand_vars
from ftmesh.torch.driver import DEPARTURE_CLOSE_S

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "examples" / "k8s"

AGREED_METRICS = {  # issue #16, "Metrics": the training series
    "ftmesh_train_committed_step",
    "ftmesh_train_step_seconds",
    "ftmesh_train_samples_total",
    "ftmesh_train_world_size",
    "ftmesh_train_share",
    "ftmesh_train_attempts_total",
}
HISTOGRAM_SERIES = ("_sum", "_count", "_bucket")


def _docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def _kind(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = [d for d in docs if d["kind"] == kind]
    return found


@pytest.fixture(scope="module")
def train() -> dict[str, Any]:
    docs = _docs("ftmesh-train.yaml")
    sts = _kind(docs, "StatefulSet")
    pod = sts["spec"]["template"]["spec"]
    return {
        "service": _kind(docs, "Service"),
        "pdb": _kind(docs, "PodDisruptionBudget"),
        "policy": _kind(docs, "NetworkPolicy"),
        "sts": sts,
        "pod": pod,
        "container": pod["containers"][0],
    }


def _env(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container["env"]}


def _worker_args(train: dict[str, Any]) -> Any:
    c = train["container"]
    fake = {"POD_IP": "10.0.0.7", "POD_NAMESPACE": "ns1"}
    argv = [expand_vars(a, fake) for a in [*c["command"], *c["args"]]]
    assert argv[:2] == ["ftmesh", "worker"], "the worker must be the container's PID 1"
    return build_parser().parse_args(argv[1:])


def test_service_statefulset_and_budget_select_the_same_pods(train: dict[str, Any]) -> None:
    svc, sts, pdb = train["service"], train["sts"], train["pdb"]
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["clusterIP"] == "None"  # headless: DNS names every pod
    assert svc["spec"]["publishNotReadyAddresses"] is True  # seeds before readiness
    assert sts["spec"]["serviceName"] == svc["metadata"]["name"]
    for selector in (svc["spec"]["selector"], sts["spec"]["selector"]["matchLabels"]):
        assert selector.items() <= labels.items()
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pdb["spec"]["maxUnavailable"] == 1


def test_the_worker_command_parses_and_agrees_with_the_manifest(train: dict[str, Any]) -> None:
    args = _worker_args(train)
    c, svc, pod = train["container"], train["service"], train["pod"]
    env = _env(c)
    assert args.command == "worker" and args.discovery == "seeds"
    assert args.bind == "10.0.0.7"
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    # Seeds: the Service's cluster name, on the gossip port every part agrees on.
    assert args.join == [f"{svc['metadata']['name']}.ns1.svc.cluster.local:{args.port}"]
    assert {(p["port"], p["protocol"]) for p in svc["spec"]["ports"]} == {
        (args.port, "UDP"),
        (args.port, "TCP"),
    }
    gossip = {(p["containerPort"], p["protocol"]) for p in c["ports"] if "gossip" in p["name"]}
    assert gossip == {(args.port, "UDP"), (args.port, "TCP")}
    # The secret file is a key of the Secret volume, made from a file as the header says.
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    secret_mount = next(m for m in mounts.values() if m["name"] in volumes)
    secret = volumes[secret_mount["name"]]["secret"]["secretName"]
    key = Path(args.secret_file).relative_to(secret_mount["mountPath"]).as_posix()
    assert secret_mount.get("readOnly") is True
    header = (K8S / "ftmesh-train.yaml").read_text()
    assert f"kubectl create secret generic {secret} --from-file={key}=" in header
    assert args.start_peers == train["sts"]["spec"]["replicas"]
    # Nothing depends on the number of replicas: scaling restarts no pod.
    assert not {"WORLD_SIZE", "RANK", "LOCAL_RANK"} & set(env)


def test_the_network_policy_opens_exactly_the_members_fixed_ports(train: dict[str, Any]) -> None:
    """Gossip (UDP and TCP), data plane and state server, between the StatefulSet's pods and
    from nowhere else; the metrics port from anywhere (scrapes, probes); nothing else. The
    ports are the worker's own flags (fixed, not random), so the rule is the one that holds."""
    args = _worker_args(train)
    policy, c = train["policy"]["spec"], train["container"]
    labels = train["sts"]["spec"]["template"]["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= labels.items()
    assert policy["policyTypes"] == ["Ingress"]
    members = {(args.port, "UDP"), (args.port, "TCP")}
    members |= {(args.data_port, "TCP"), (args.state_port, "TCP")}
    assert all(p for p, _ in members) and len({p for p, _ in members}) == 3  # fixed, distinct
    metrics = int(_env(c)["FTMESH_METRICS_PORT"]["value"])
    opened: dict[str, set[tuple[int, str]]] = {}
    for rule in policy["ingress"]:
        ports = {(p["port"], p["protocol"]) for p in rule["ports"]}
        if "from" in rule:
            (peer,) = rule["from"]
            assert set(peer) == {"podSelector"}  # this namespace's pods, no other
            assert peer["podSelector"]["matchLabels"].items() <= labels.items()
            opened.setdefault("members", set()).update(ports)
        else:
            opened.setdefault("anyone", set()).update(ports)
    assert opened == {"members": members, "anyone": {(metrics, "TCP")}}
    # The container declares the same ports, by name.
    declared = {p["name"]: (p["containerPort"], p["protocol"]) for p in c["ports"]}
    assert declared["data"] == (args.data_port, "TCP")
    assert declared["state"] == (args.state_port, "TCP")


def test_the_script_arguments_parse_and_checkpoint_to_the_claim(train: dict[str, Any]) -> None:
    args = _worker_args(train)
    c, sts = train["container"], train["sts"]
    script = ROOT / args.target[0]  # relative to workingDir, where the image holds the repo
    assert script.is_file(), script
    spec = importlib.util.spec_from_file_location("train_digits_for_test", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    opts = module.build_parser().parse_args(args.target[1:])
    claims = {t["metadata"]["name"] for t in sts["spec"]["volumeClaimTemplates"]}
    (claim_path,) = [m["mountPath"] for m in c["volumeMounts"] if m["name"] in claims]
    for path in (opts.checkpoint_dir, opts.save_model):  # on the pod's own volume
        assert Path(path).is_relative_to(claim_path), path
    # The finite run (see the header): the last step is a checkpoint step, so a restarted
    # finished pod finds it, and finished pods idle instead of exiting.
    total = opts.epochs * (len(module.load_data(opts.seed)[0]) // opts.global_batch)
    assert opts.checkpoint_every > 0 and total % opts.checkpoint_every == 0, total
    assert opts.idle_when_done


def test_the_grace_period_covers_a_planned_departure(train: dict[str, Any]) -> None:
    grace = train["pod"]["terminationGracePeriodSeconds"]
    # A departure takes the rest of the step in flight, at most one more step (this
    # example's take milliseconds), DEPARTURE_CLOSE_S to leave, and the process' exit.
    assert grace >= DEPARTURE_CLOSE_S + 10


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.gpu"])
def test_the_images_hold_what_the_manifest_runs(train: dict[str, Any], name: str) -> None:
    text = (K8S / name).read_text()
    (workdir,) = re.findall(r"^WORKDIR (\S+)$", text, re.M)
    assert workdir == train["container"]["workingDir"]
    assert re.search(r"^COPY examples \./examples$", text, re.M)
    assert re.search(r"^COPY ftmesh \./ftmesh$", text, re.M)
    assert re.search(r"^COPY native \./native$", text, re.M)  # the kernel sources, packaged
    torch_pin = re.search(
        r"^torch==([\d.]+)$", (ROOT / "scripts/constraints.txt").read_text(), re.M
    )
    assert torch_pin and f"torch=={torch_pin.group(1)}" in text  # the build CI tests
    assert f"docker build -f examples/k8s/{name} " in text
    # What the manifest runs: the examples' imports, and the metrics it serves
    assert re.search(r'"\.\[torch,(gpu,)?metrics,examples\]"', text)
    if name == "Dockerfile.gpu":
        assert re.search(r"^FROM nvidia/cuda:\S+$", text, re.M)
        assert "[torch,gpu," in text


def test_the_autoscaler_reads_an_agreed_metric_served_on_the_pods_port(
    train: dict[str, Any],
) -> None:
    hpa = _kind(_docs("ftmesh-autoscale.yaml"), "HorizontalPodAutoscaler")["spec"]
    adapter = yaml.safe_load((K8S / "prometheus-adapter-values.yaml").read_text())
    sts = train["sts"]
    ref = hpa["scaleTargetRef"]
    assert (ref["apiVersion"], ref["kind"], ref["name"]) == (
        sts["apiVersion"],
        sts["kind"],
        sts["metadata"]["name"],
    )
    assert hpa["minReplicas"] <= sts["spec"]["replicas"] <= hpa["maxReplicas"]
    (metric,) = hpa["metrics"]
    served = {r["name"]["as"]: r for r in adapter["rules"]["custom"]}
    rule = served[metric["pods"]["metric"]["name"]]
    queried = set(re.findall(r"\bftmesh_\w+", rule["seriesQuery"] + rule["metricsQuery"]))
    for series in queried:
        base = next((series[: -len(s)] for s in HISTOGRAM_SERIES if series.endswith(s)), series)
        assert base in AGREED_METRICS, series
    assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}
    # One metrics port: the exporter's setting, the container port, the scrape annotation.
    c = train["container"]
    port = int(_env(c)["FTMESH_METRICS_PORT"]["value"])
    assert {p["containerPort"] for p in c["ports"] if p["name"] == "metrics"} == {port}
    annotations = sts["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == port
