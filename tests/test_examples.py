"""The examples: the minimal embedding runs for real. (The Kubernetes example:
``test_k8s_manifests.py`` and ``test_k8s_pods.py``.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

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
