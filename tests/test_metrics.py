"""Prometheus metrics of real members: the families a scrape returns (against a golden list),
the HTTP server's bounds, and a real Prometheus server scraping ``ftmesh node`` processes."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_server import PROMETHEUS, PrometheusServer, free_port
from tests_support import local_mesh_config

from ftmesh.lab.junk import JunkFactory, flood
from ftmesh.lab.procs import NodeGroup
from ftmesh.mesh.blocking import SyncMesh
from ftmesh.metrics import server as metrics_server
from ftmesh.metrics.collector import METRICS
from ftmesh.stats import Histogram, TrainerStatistics

GOLDEN: dict[str, tuple[str, frozenset[str]]] = {
    "ftmesh_info": ("gauge", frozenset({"mesh", "node", "name", "version"})),
    "ftmesh_members": ("gauge", frozenset({"state"})),
    "ftmesh_suspicions": ("counter", frozenset()),
    "ftmesh_gossip_packets": ("counter", frozenset({"direction"})),
    "ftmesh_gossip_bytes": ("counter", frozenset({"direction"})),
    "ftmesh_dropped": ("counter", frozenset({"reason"})),
    "ftmesh_collective_seconds": ("histogram", frozenset({"op", "backend"})),
    "ftmesh_collective_bytes": ("counter", frozenset({"op", "backend"})),
    "ftmesh_collective_aborts": ("counter", frozenset({"kind"})),
    "ftmesh_link_sent_bytes": ("counter", frozenset({"peer"})),
    "ftmesh_link_min_rtt_seconds": ("gauge", frozenset({"peer"})),
    "ftmesh_link_delivery_rate_bytes": ("gauge", frozenset({"peer"})),
    "ftmesh_link_retransmits": ("counter", frozenset({"peer"})),
    "ftmesh_train_committed_step": ("gauge", frozenset()),
    "ftmesh_train_step_seconds": ("histogram", frozenset()),
    "ftmesh_train_samples": ("counter", frozenset()),
    "ftmesh_train_steps": ("counter", frozenset()),
    "ftmesh_train_world_size": ("gauge", frozenset()),
    "ftmesh_train_share": ("gauge", frozenset()),
    "ftmesh_train_attempts": ("counter", frozenset()),
    "ftmesh_recovery_seconds": ("histogram", frozenset()),
    "ftmesh_state_transfer_bytes": ("counter", frozenset()),
    "ftmesh_checkpoint_step": ("gauge", frozenset()),
    "ftmesh_train_straggler_steps": ("counter", frozenset()),
    "ftmesh_train_failslow_pauses": ("counter", frozenset()),
    "ftmesh_train_nonfinite_steps": ("counter", frozenset()),
    "ftmesh_train_skipped_samples": ("counter", frozenset()),
    "ftmesh_train_loss": ("gauge", frozenset()),
    "process_virtual_memory_bytes": ("gauge", frozenset()),
    "process_resident_memory_bytes": ("gauge", frozenset()),
    "process_start_time_seconds": ("gauge", frozenset()),
    "process_cpu_seconds": ("counter", frozenset()),
    "process_open_fds": ("gauge", frozenset()),
    "process_max_fds": ("gauge", frozenset()),
    "python_info": (
        "gauge",
        frozenset({"implementation", "major", "minor", "patchlevel", "version"}),
    ),
}
"""Every family a member exports, as the parser names them (counters without ``_total``),
with its type and labels. Renaming or relabelling one is a visible change: dashboards,
alerts and the Kubernetes autoscaling example depend on these."""


TRAFFIC = ("tx_packets", "rx_packets")


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _families(text: str) -> dict[str, tuple[str, frozenset[str]]]:
    """Family -> (type, label names); a family without samples (no drops yet) shows the
    golden labels, since it has none to tell."""
    out = {}
    for fam in text_string_to_metric_families(text):
        labels: set[str] = set()
        for sample in fam.samples:
            labels |= set(sample.labels) - {"le"}
        out[fam.name] = (fam.type, frozenset(labels) if fam.samples else GOLDEN[fam.name][1])
    return out


def _trainer_snapshot() -> TrainerStatistics:
    steps, recoveries = Histogram(), Histogram()
    for s in (0.01, 0.02, 0.5):
        steps.observe(s)
    recoveries.observe(0.25)
    return TrainerStatistics(
        committed_step=3,
        world_size=2,
        share=16,
        samples_total=48,
        steps_total=3,
        attempts_total=4,
        step_seconds=steps.snapshot(),
        recovery_seconds=recoveries.snapshot(),
        state_transfer_bytes_total=1024,
        checkpoint_step=-1,
        loss=0.75,
    )


def test_a_scrape_holds_the_golden_families(tmp_path: Path) -> None:
    """Two real members run collectives and one registers trainer statistics: its scrape has
    exactly the golden families, with the labels promised, and numbers that add up."""
    base = local_mesh_config(tmp_path, "metrics")
    config = dataclasses.replace(base, node=dataclasses.replace(base.node, metrics_port=0))
    with SyncMesh.start(config) as a, SyncMesh.start(config) as b:
        deadline = time.monotonic() + 20
        while any((m.view() is None or m.view().size < 2) for m in (a, b)):  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "no view of two"
            time.sleep(0.05)
        view = a.view()
        assert view is not None
        b_id = b.node_id
        with ThreadPoolExecutor(2) as pool:
            outs = list(pool.map(lambda m: m.session(view).allreduce(np.ones(1000)).output, (a, b)))
        assert all(np.array_equal(o, np.full(1000, 2.0)) for o in outs)
        a.register_statistics("trainer", _trainer_snapshot)
        # The view formed by TCP joins; wait for gossip datagrams both ways (under load the
        # first probe round can come after the allreduce).
        while not all(a.call_sync(a.mesh.node.statistics).get(k) for k in TRAFFIC):
            assert time.monotonic() < deadline, "no gossip datagram sent and received"
            time.sleep(0.05)
        addr = a.mesh.node.metrics_address
        assert addr is not None
        status, text = _get(f"http://{addr[0]}:{addr[1]}/metrics")
    assert status == 200
    assert _families(text) == GOLDEN
    assert set(METRICS) == {n if GOLDEN[n][0] != "counter" else n + "_total" for n in GOLDEN}
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    alive = [s.value for s in fams["ftmesh_members"].samples if s.labels["state"] == "alive"]
    assert alive == [2.0]
    by_name = {s.name: s for s in fams["ftmesh_collective_bytes"].samples}
    assert by_name["ftmesh_collective_bytes_total"].labels == {"op": "allreduce", "backend": "tcp"}
    assert by_name["ftmesh_collective_bytes_total"].value == 8000.0
    count = [s for s in fams["ftmesh_collective_seconds"].samples if s.name.endswith("_count")]
    assert [s.value for s in count] == [1.0]
    samples = fams["ftmesh_train_step_seconds"].samples
    buckets = {s.labels["le"]: s.value for s in samples if s.name.endswith("_bucket")}
    # observed 0.01, 0.02, 0.5: cumulative counts at the bounds
    assert (buckets["0.005"], buckets["0.01"], buckets["0.025"], buckets["0.5"]) == (0, 1, 2, 3)
    assert buckets["+Inf"] == 3.0
    assert [s.value for s in samples if s.name.endswith("_sum")] == [pytest.approx(0.53)]
    assert [s.value for s in fams["ftmesh_train_loss"].samples] == [0.75]
    packets = {s.labels["direction"]: s.value for s in fams["ftmesh_gossip_packets"].samples}
    assert packets["tx"] > 0 and packets["rx"] > 0
    # the link to b: a 2-ring allreduce sends the whole input to the neighbour once (its half
    # in the reduce-scatter, its reduced half in the allgather); the kernel's round trip
    sent = {s.labels["peer"]: s.value for s in fams["ftmesh_link_sent_bytes"].samples}
    assert sent == {b_id: 8000.0}, sent
    rtt = {s.labels["peer"]: s.value for s in fams["ftmesh_link_min_rtt_seconds"].samples}
    assert set(rtt) == {b_id} and 0 < rtt[b_id] < 0.1, rtt


def test_a_training_member_exports_its_trainer_statistics(tmp_path: Path) -> None:
    """An ``ElasticTrainer`` built on a ``SyncMesh`` registers its statistics: the member's
    scrape shows the steps it committed."""
    import torch

    from ftmesh.torch import ElasticSampler, ElasticTrainer

    base = local_mesh_config(tmp_path, "metrics-train")
    config = dataclasses.replace(base, node=dataclasses.replace(base.node, metrics_port=0))
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    x, y = torch.randn(64, 4), torch.randint(0, 2, (64,))
    with SyncMesh.start(config) as mesh:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        trainer = ElasticTrainer(
            mesh, model, opt, ElasticSampler(64, 16), quorum="any", join_settle=0.0
        )
        for step in trainer.steps(3):
            with step:
                for idx in step.indices():
                    loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
                    step.record_loss(loss)
                    loss.backward()
                opt.step()
        assert trainer.last_report is not None
        last_loss = trainer.last_report.loss
        addr = mesh.mesh.node.metrics_address
        assert addr is not None
        status, text = _get(f"http://{addr[0]}:{addr[1]}/metrics")
    assert status == 200
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    assert [s.value for s in fams["ftmesh_train_committed_step"].samples] == [3.0]
    assert [s.value for s in fams["ftmesh_train_samples"].samples] == [48.0]
    assert last_loss > 0
    assert [s.value for s in fams["ftmesh_train_loss"].samples] == [pytest.approx(last_loss)]
    rss = [s.value for s in fams["process_resident_memory_bytes"].samples]
    assert len(rss) == 1 and rss[0] > 0


def test_the_server_answers_only_get_metrics_and_sheds_idle_connections(tmp_path: Path) -> None:
    base = local_mesh_config(tmp_path, "metrics-http")
    config = dataclasses.replace(base, node=dataclasses.replace(base.node, metrics_port=0))
    with SyncMesh.start(config) as m:
        addr = m.mesh.node.metrics_address
        assert addr is not None
        url = f"http://{addr[0]}:{addr[1]}"
        assert _get(url + "/nope")[0] == 404
        assert _get(url + "/")[0] == 200
        req = urllib.request.Request(url + "/metrics", data=b"x", method="POST")
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(req, timeout=5)
        assert info.value.code == 405
        idle = [socket.create_connection(addr) for _ in range(metrics_server.MAX_CONNECTIONS + 4)]
        try:
            time.sleep(0.3)
            # Beyond the cap, connections are closed at once.
            closed = 0
            for s in idle:
                s.settimeout(0.05)
                with contextlib.suppress(TimeoutError, ConnectionResetError):
                    closed += s.recv(1) == b""
            assert closed >= 4
        finally:
            for s in idle:
                s.close()
        # The idle ones that held a slot time out; the server serves again.
        deadline = time.monotonic() + metrics_server.REQUEST_TIMEOUT + 5
        while True:
            try:
                if _get(url + "/metrics")[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "metrics never served again"
            time.sleep(0.2)
        counters = m.call_sync(m.mesh.node.statistics)
        assert counters.get("metrics_refused_busy", 0) >= 4


def test_metrics_without_prometheus_client_are_a_one_line_error(tmp_path: Path) -> None:
    """``--metrics-port`` where prometheus_client is missing: one line, exit 2."""
    code = (
        "import sys; sys.modules['prometheus_client'] = None\n"
        "from ftmesh.cli import main; sys.exit(main(sys.argv[1:]))\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, "node", "--mesh", "x", "--metrics-port", "0"],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "FTMESH_REGISTRY_DIR": str(tmp_path)},
    )
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and "prometheus_client" in r.stderr, r.stderr


@pytest.mark.slow
@pytest.mark.skipif(PROMETHEUS is None, reason="needs Debian's prometheus (setup.sh as root)")
def test_a_real_prometheus_sees_members_die_and_junk_dropped(tmp_path: Path) -> None:
    ports = [free_port() for _ in range(3)]
    with NodeGroup(log_dir=tmp_path) as group:
        nodes = [group.start("--metrics-port", str(p)) for p in ports]
        group.wait_converged(nodes, timeout=30)
        targets = [f"127.0.0.1:{p}" for p in ports]
        with PrometheusServer(tmp_path, targets) as prom:
            three = prom.wait_for(
                'ftmesh_members{state="alive"}',
                lambda v: len(v) == 3 and all(x == 3 for x in v.values()),
                timeout=30,
            )
            assert set(three) == set(targets)
            nodes[2].kill()
            survivors = set(targets[:2])
            prom.wait_for(
                'ftmesh_members{state="alive"}',
                lambda v: set(v) == survivors and all(x == 2 for x in v.values()),
                timeout=30,
            )
            prom.wait_for('ftmesh_members{state="dead"}', lambda v: v.get(targets[0]) == 1, 10)
            before = prom.values(f'sum(ftmesh_dropped_total{{instance="{targets[0]}"}})')
            host, _, port = nodes[0].addr.rpartition(":")
            flood([(host, int(port))], JunkFactory("test", [], seed=1, forge=False), 500, 2.0)
            prom.wait_for(
                f'sum(ftmesh_dropped_total{{instance="{targets[0]}"}})',
                lambda v: sum(v.values()) >= sum(before.values()) + 500,
                timeout=20,
            )


@pytest.mark.slow
@pytest.mark.skipif(PROMETHEUS is None, reason="needs Debian's prometheus (setup.sh as root)")
def test_a_real_prometheus_follows_a_training_run(tmp_path: Path) -> None:
    """``ftmesh launch -n 2 --metrics-port P`` (worker k serves P+k) on the digits example: a
    real Prometheus sees both members' committed steps rise, on a world of two."""
    port = free_port()
    targets = [f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}"]
    argv = [sys.executable, "-m", "ftmesh", "launch", "-n", "2", "--metrics-port", str(port)]
    argv += ["--no-live", "--log-dir", str(tmp_path / "logs"), "examples/train_digits.py"]
    argv += ["--epochs", "4", "--step-delay", "0.05"]
    env = {**os.environ, "FTMESH_REGISTRY_DIR": str(tmp_path / "registry")}
    with (
        subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) as run,
        PrometheusServer(tmp_path, targets) as prom,
    ):
        try:
            step = "ftmesh_train_committed_step"
            first = prom.wait_for(step, lambda v: len(v) == 2 and min(v.values()) > 0, 90)
            prom.wait_for(
                step, lambda v: all(v.get(t, 0) >= first[t] + 10 for t in targets), timeout=60
            )
            world = prom.values("ftmesh_train_world_size")
            assert world == {t: 2.0 for t in targets}, world
            rate = prom.values("sum(rate(ftmesh_train_samples_total[5s]))")
            assert rate and min(rate.values()) > 0, rate
        finally:
            run.terminate()  # (launch stops its workers)
            run.communicate(timeout=60)
