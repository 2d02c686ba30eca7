"""The examples: the minimal embedding runs for real; the Kubernetes manifests are valid and
wire seed discovery through a headless Service."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ftmesh.cli.main import build_parser

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_embed_minimal_two_members(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "FTMESH_REGISTRY_DIR": str(tmp_path),
        "FTMESH_PRESET": "local",
        "OMP_NUM_THREADS": "1",
    }
    procs = [
        subprocess.Popen(
            [sys.executable, str(ROOT / "examples" / "embed_minimal.py")],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    for out in outs:
        w = [float(v) for v in re.findall(r"w = \[([^\]]*)\]", out)[0].split(",")]
        assert w == pytest.approx([2.0, -3.0, 0.5], abs=0.05)
    assert outs[0].split(": ")[1] == outs[1].split(": ")[1]  # identical weights


def test_k8s_manifest_is_consistent() -> None:
    docs = list(yaml.safe_load_all((ROOT / "examples" / "k8s" / "ftmesh-train.yaml").read_text()))
    service = next(d for d in docs if d["kind"] == "Service")
    sts = next(d for d in docs if d["kind"] == "StatefulSet")
    assert service["spec"]["clusterIP"] == "None"  # headless
    assert sts["spec"]["serviceName"] == service["metadata"]["name"]
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in service["spec"]["selector"].items())
    container = sts["spec"]["template"]["spec"]["containers"][0]
    script = container["command"][-1]
    argv = shlex.split(script.replace("exec ", "", 1))
    assert argv[0] == "ftmesh"
    args = build_parser().parse_args(argv[1:])  # the command line must parse
    assert args.command == "worker" and args.discovery == "seeds"
    port = args.port
    assert {p["port"] for p in service["spec"]["ports"]} == {port}
    assert {p["containerPort"] for p in container["ports"]} == {port}
    assert args.join[0].startswith(f"{service['metadata']['name']}.")
    assert args.join[0].endswith(f":{port}")
