"""The simulator and the membership bench: deterministic, and reporting sensible figures."""

from __future__ import annotations

import json
import math

from ftmesh.membership.config import MembershipConfig
from ftmesh.membership.messages import Ack
from ftmesh.sim.bench import format_report, percentile, run_membership_bench
from ftmesh.sim.network import SimNetwork


def test_bench_small_mesh_reports_sensible_figures() -> None:
    r = run_membership_bench(nodes=30, loss=0.01, preset="local", duration=10, crashes=3, seed=1)
    print(format_report(r))
    assert r.converged_after_warmup
    assert r.crashes == 3 and r.undetected == 0
    bound = MembershipConfig.preset("local").crash_detection_bound(30)
    assert 0 < r.detect_first_p50_s <= r.detect_first_p99_s <= r.detect_all_p99_s <= bound
    assert r.detect_all_p50_s <= r.detect_all_p99_s
    assert 0 < r.join_dissemination_s < 5
    assert r.false_positive_deaths == 0
    assert r.msgs_per_member_per_s > 0 and r.bytes_per_member_per_s > 0
    d = r.as_dict()
    assert json.loads(json.dumps(d)) == d
    assert "crash detection" in format_report(r)


def test_bench_is_deterministic() -> None:
    a = run_membership_bench(nodes=20, loss=0.05, preset="local", duration=5, crashes=2, seed=7)
    b = run_membership_bench(nodes=20, loss=0.05, preset="local", duration=5, crashes=2, seed=7)
    da, db = a.as_dict(), b.as_dict()
    da.pop("wall_s")
    db.pop("wall_s")
    assert da == db


def test_same_seed_same_history() -> None:
    def history(seed: int) -> list[tuple[float, str, str, str]]:
        net = SimNetwork(seed=seed, config=MembershipConfig.preset("local"), loss=0.1)
        nodes = [net.add_node()]
        for _ in range(9):
            nodes.append(net.add_node(join=[nodes[0].addr]))
        net.run_until(2.0)
        net.crash(nodes[4])
        net.run_until(6.0)
        return [(e.time, e.observer, e.event.kind, e.event.member.node) for e in net.events]

    assert history(3) == history(3)
    assert history(3) != history(4)


def test_crashed_node_drops_and_paused_node_queues() -> None:
    net = SimNetwork(seed=1, config=MembershipConfig.preset("local"))
    a = net.add_node()
    b = net.add_node(join=[a.addr])
    net.run_until(1.0)
    assert net.converged()
    net.pause(b)
    net.inject(a, b.addr, (Ack(seq=1, source=b.swim.node_id),))
    net.run_until(1.3)
    assert b.inbox  # a's probes wait for b
    net.resume(b)
    assert not b.inbox
    net.crash(b)
    net.run_until(2.0)
    assert not b.inbox and b.crashed
    assert [n.addr for n in net.live_nodes()] == [a.addr]


def test_partition_blocks_traffic_and_push_pull() -> None:
    net = SimNetwork(seed=2, config=MembershipConfig.preset("local"))
    a = net.add_node()
    b = net.add_node()
    net.partition([[a], [b]])
    net._apply(b, b.swim.join(net.now, [a.addr]))
    net.run_until(3.0)
    assert a.swim.num_live() == 1 and b.swim.num_live() == 1
    assert b.swim.counters.get("join_failed") == 1
    net.heal()
    net._apply(b, b.swim.join(net.now, [a.addr]))
    net.run_until(4.0)
    assert net.converged() and a.swim.num_live() == 2


def test_percentile() -> None:
    assert math.isnan(percentile([], 50))
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile(list(map(float, range(1, 101))), 99) == 99.0
