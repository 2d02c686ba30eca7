"""The Kubernetes example as a cluster would run it, in the lab (``ftmesh.lab.pods``): the
StatefulSet's worker command exactly as the manifest writes it, on four "pods" (network
namespaces on a bridge whose ``/etc/hosts`` resolves the headless Service's name to every pod
IP, each worker PID 1 of its own PID namespace, with the manifest's env, Secret and
checkpoint volume). One mesh forms; SIGTERM to one pod's PID 1 makes it leave and exit 0
within the grace period while no survivor retries a step; a fifth pod joins and trains; the
others finish, on one model; a finished pod that the StatefulSet restarts does not train
again. The Indexed Job (``ftmesh-job.yaml``) the same way: its four indexes train one
model; SIGTERM to one is a planned departure that exits the status its podFailurePolicy
ignores (not 0, which would be a succeeded index); the replacement pod of that index joins
the running mesh, fetches the state and trains; every pod exits 0 when the run is done (the
Job's success), the model on the shared claim. The pods run the image's install, not this
tree's: exactly what ``examples/k8s/Dockerfile`` installs (parsed from it), in a fresh
virtual environment, built once for both. Root only (namespaces, mounts)."""

from __future__ import annotations

import json
import secrets
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from install_support import build_wheel, dockerfile_requirements, fresh_env, run
from tests_support import ROOT

from ftmesh.lab import is_root
from ftmesh.lab.pods import PodLab, load_manifest

pytestmark = [
    pytest.mark.netns,
    pytest.mark.slow,
    pytest.mark.timeout(600),  # the image and the StatefulSet: 218 s at most, loaded
    pytest.mark.skipif(not is_root(), reason="needs root: network, PID and mount namespaces"),
]

MANIFEST = ROOT / "examples" / "k8s" / "ftmesh-train.yaml"
JOB_MANIFEST = ROOT / "examples" / "k8s" / "ftmesh-job.yaml"
DOCKERFILE = ROOT / "examples" / "k8s" / "Dockerfile"
WAIT_S = 300.0  # generous: four pods import torch at once on a shared 2-core host


def _records(lab: PodLab, i: int) -> list[dict[str, Any]]:
    out = []
    for line in lab.logs(i).splitlines():
        if line.startswith("FTMESH "):
            out.append(json.JSONDecoder().raw_decode(line[len("FTMESH ") :])[0])
    return out


def _steps(lab: PodLab, i: int) -> list[dict[str, Any]]:
    return [r for r in _records(lab, i) if "done" not in r]


def _wait(what: str, cond: Any, lab: PodLab, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        for pod in lab.pods:
            if pod.proc is not None and pod.proc.poll() not in (None, 0):
                pytest.fail(f"{pod.name} exited {pod.proc.returncode}:\n{lab.logs(pod.ordinal)}")
        if time.monotonic() > deadline:
            started = [p for p in lab.pods if p.proc is not None]
            tails = "\n".join(f"--- {p.name}\n{lab.logs(p.ordinal)[-1500:]}" for p in started)
            pytest.fail(f"timed out waiting for {what}\n{tails}")
        time.sleep(0.2)


def _nspid(pid: int) -> list[str]:
    status = Path(f"/proc/{pid}/status").read_text()
    return next(line.split()[1:] for line in status.splitlines() if line.startswith("NSpid:"))


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bin folder of an environment with exactly what the Dockerfile installs (the wheel
    is built while the fresh environment gets torch: two subprocesses, overlapped)."""
    tmp = tmp_path_factory.mktemp("image")
    with ThreadPoolExecutor(1) as pool:
        wheel = pool.submit(build_wheel, tmp)
        env = fresh_env(tmp / "image")
        reqs = dockerfile_requirements(DOCKERFILE, wheel.result())
    run(["pip", "install", "-q", *reqs], tmp, env, 300)
    return tmp / "image" / "bin"


def test_the_statefulset_as_written(image: Path) -> None:
    docs = load_manifest(MANIFEST)
    key = secrets.token_hex(16).encode()
    with PodLab(
        docs,
        image_dir=ROOT,
        image_path=[str(image)],  # the image's ftmesh
        secrets={"ftmesh-mesh-secret": {"secret": key}},
        pods=6,
    ) as lab:
        replicas = lab.replicas
        assert replicas == 4
        for i in range(replicas):
            lab.start(i)
        for i in range(replicas):  # the worker (exec'd into the script) is PID 1
            pid = lab.pid1(i)
            assert _nspid(pid)[-1] == "1", _nspid(pid)
        _wait("the pods to train", lambda: all(_steps(lab, i) for i in range(replicas)), lab)
        for i in range(replicas):
            pid = lab.pid1(i)
            cmdline = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
            assert _nspid(pid)[-1] == "1" and "examples/train_digits.py" in cmdline, cmdline
        # One mesh of four, from the first step (never a pod training alone).
        for i in range(replicas):
            assert {r["members"] for r in _steps(lab, i)} == {replicas}, _steps(lab, i)[:3]
        # Scale-out starts now: a fifth pod, which takes seconds to import torch, so it joins
        # well after the departure below (and the run must outlast that).
        lab.start(4)
        _wait("step 5", lambda: all(_steps(lab, i)[-1]["step"] >= 5 for i in range(4)), lab)
        assert not _records(lab, 4), "the fifth pod joined before the departure"

        # Scale-in: pod 1 is deleted, SIGTERM to its PID 1 (SIGKILL after the grace period).
        leaver = 1
        t0 = time.monotonic()
        rc = lab.delete(leaver)
        took = time.monotonic() - t0
        assert rc == 0, lab.logs(leaver)
        assert took < lab.grace_s
        log = lab.logs(leaver)
        assert "leaving the mesh after step" in log and "Traceback" not in log, log[-2000:]
        survivors = [0, 2, 3]

        def without_leaver(i: int) -> list[dict[str, Any]]:
            return [r for r in _steps(lab, i) if r["members"] == replicas - 1]

        _wait("the survivors' next step", lambda: all(without_leaver(i) for i in survivors), lab)
        last = max(r["step"] for r in _steps(lab, leaver))
        for i in survivors:
            steps = _steps(lab, i)
            first = without_leaver(i)[0]
            around = [r for r in steps if last <= r["step"] <= first["step"]]
            # No failed collective, no retried step, no state sync: the next step just ran.
            assert all(r["attempts"] == 1 for r in around), around
            assert not first["synced"], first
            assert [r["step"] for r in around] == list(range(last, first["step"] + 1))

        def done(i: int) -> bool:
            return any(r.get("done") for r in _records(lab, i))

        # The fifth pod joins the running mesh and trains.
        def trains(i: int) -> bool:
            return any(r["share"] > 0 and r["members"] >= 4 for r in _steps(lab, i))

        _wait("the fifth pod to train", lambda: trains(4) or done(0), lab)
        late = "the run ended before the fifth pod joined: make it longer\n"
        assert trains(4), late + lab.logs(4)[-3000:]
        members = [0, 2, 3, 4]

        def finished(i: int) -> bool:  # (a pod prints its accuracy after its final record)
            return done(i) and "test accuracy: " in lab.logs(i)

        _wait("the run to finish", lambda: all(finished(i) for i in members), lab)
        total = _steps(lab, 0)[-1]["total"]
        finals = {next(r for r in _records(lab, i) if r.get("done"))["digest"] for i in members}
        assert len(finals) == 1, finals  # one model
        for i in members:
            assert "test accuracy: 0.9" in lab.logs(i), lab.logs(i)[-500:]
            steps = [r["step"] for r in _steps(lab, i)]
            assert steps == sorted(set(steps)) and steps[-1] == total  # none repeated
        # Finished pods stay up (--idle-when-done) until SIGTERM, then exit 0.
        time.sleep(1.0)
        assert all(lab.pods[i].running for i in members)

        # The StatefulSet restarts a container that exited: pod 0 must not train again.
        lab.signal(0, signal.SIGTERM)
        assert lab.wait(0, lab.grace_s) == 0, lab.logs(0)
        lab.restart(0)
        _wait("the restarted pod", lambda: "not training again" in lab.logs(0), lab, 120)
        assert f"training finished at step {total}" in lab.logs(0)
        assert _steps(lab, 0) == []
        time.sleep(1.0)
        assert lab.pods[0].running  # idle, not in a restart loop
        # Scale-out after the end: a new pod (fresh volume) must not train a model of its own.
        lab.start(5)
        _wait("the late pod", lambda: "training finished without needing us" in lab.logs(5), lab)
        assert _steps(lab, 5) == []
        time.sleep(1.0)
        assert lab.pods[5].running  # idle as well
        members.append(5)
        for i in members:
            lab.signal(i, signal.SIGTERM)
        assert [lab.wait(i, lab.grace_s) for i in members] == [0] * len(members)


def test_the_indexed_job_as_written(image: Path) -> None:
    docs = load_manifest(JOB_MANIFEST)
    (job,) = [d for d in docs if d["kind"] == "Job"]
    rules = job["spec"]["podFailurePolicy"]["rules"]
    ignored = {
        code
        for r in rules
        if r["action"] == "Ignore" and "onExitCodes" in r
        for code in r["onExitCodes"]["values"]
    }
    key = secrets.token_hex(16).encode()
    with PodLab(
        docs,
        image_dir=ROOT,
        image_path=[str(image)],
        secrets={"ftmesh-mesh-secret": {"secret": key}},
    ) as lab:
        n = lab.replicas
        assert n == 4 == job["spec"]["completions"]
        for i in range(n):
            lab.start(i)
        _wait("the pods to train", lambda: all(_steps(lab, i) for i in range(n)), lab)
        for i in range(n):  # one mesh of four from the first step; the worker is PID 1
            assert _nspid(lab.pid1(i))[-1] == "1"
            assert {r["members"] for r in _steps(lab, i)} == {n}, _steps(lab, i)[:3]
        _wait("step 5", lambda: all(_steps(lab, i)[-1]["step"] >= 5 for i in range(n)), lab)

        # Index 1's pod is deleted (SIGTERM): a planned departure whose exit status the
        # podFailurePolicy ignores, never 0 (which would count as a succeeded index).
        leaver = 1
        rc = lab.delete(leaver)
        assert rc in ignored and rc != 0, (rc, lab.logs(leaver)[-2000:])
        assert "leaving the mesh after step" in lab.logs(leaver)
        last = max(r["step"] for r in _steps(lab, leaver))
        # The Job replaces the pod of that index: it joins the running mesh and trains.
        lab.start(leaver)

        def joined() -> bool:
            return any(r["share"] > 0 and r["members"] == n for r in _steps(lab, leaver))

        def done(i: int) -> bool:
            return any(r.get("done") for r in _records(lab, i))

        _wait("the replacement to train", lambda: joined() or done(0), lab)
        assert joined(), "the run ended before the replacement joined\n" + lab.logs(leaver)
        first = _steps(lab, leaver)[0]
        assert first["step"] > last and first["synced"] and first["fetched"] > 0, first  # peers

        # Every pod exits 0 on its own when the run is done: the Job succeeds.
        codes = [lab.wait(i, WAIT_S) for i in range(n)]
        failed = [f"--- {i}: {rc}\n{lab.logs(i)[-3000:]}" for i, rc in enumerate(codes) if rc]
        assert codes == [0] * n, "\n".join(failed)
        total = _steps(lab, 0)[-1]["total"]
        finals = {next(r for r in _records(lab, i) if r.get("done"))["digest"] for i in range(n)}
        assert len(finals) == 1, finals  # one model
        for i in range(n):
            assert "test accuracy: 0.9" in lab.logs(i), lab.logs(i)[-500:]
            steps = [r["step"] for r in _steps(lab, i)]
            assert steps == sorted(set(steps)) and steps[-1] == total
        (claim,) = [d for d in docs if d["kind"] == "PersistentVolumeClaim"]
        model = lab.shared_claim_dir(claim["metadata"]["name"]) / "model.pt"
        assert model.stat().st_size > 0
        assert [p.name for p in model.parent.iterdir()] == ["model.pt"]  # no writer's leftover
