"""``ftmesh bench membership``: SWIM + Lifeguard at scale on the deterministic simulator.

The run: ``nodes`` members start and settle for a warm-up period; then, over ``duration``
simulated seconds, ``crashes`` members are crashed at random times and one new member joins in
the middle. Reported, all in simulated seconds:

* detection: crash -> first member declares it dead, and crash -> every live member has
  (p50/p99 over the crashes);
* dissemination: the joiner's first contact -> every live member knows it;
* false positives: deaths declared of members that were running (suspicions are reported too,
  as events and as members suspected: they are harmless while refuted; at 10,000 members a
  probe of a live member fails now and then under 1% loss, and its suspicion reaches all);
* cost: messages (datagrams and push-pulls) and bytes sent per member per second.

How the members start (``joins``): ``"batch"`` (the default) starts them knowing each other, as
from one member list handed to all (``SimNetwork.add_settled``: the state a join storm settles
into once its rumours have drained); ``"storm"`` has each join through a random earlier member,
all at once, and the storm's O(n^2 log n) rumour transmissions are simulated (minutes at 1,000
members, out of reach at 10,000), some of them still in flight in the measured window. Either
way the measured window starts from a converged mesh (``converged_after_warmup``), and the
crashes and the joiner in the window are detected and spread by the protocol alone.
"""

from __future__ import annotations

import gc
import math
import time
from dataclasses import asdict, dataclass
from typing import Any

from ..errors import LocalUsageError
from ..membership.config import MembershipConfig
from .network import SeenEvent, SimNetwork, SimNode


def percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    idx = min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))
    return ordered[idx]


@dataclass
class MembershipReport:
    nodes: int
    joins: str
    loss: float
    preset: str
    duration_s: float
    seed: int
    converged_after_warmup: bool
    crashes: int
    detect_first_p50_s: float
    detect_first_p99_s: float
    detect_all_p50_s: float
    detect_all_p99_s: float
    undetected: int
    join_dissemination_s: float
    false_positive_deaths: int
    suspicions_of_live_members: int
    live_members_suspected: int
    msgs_per_member_per_s: float
    bytes_per_member_per_s: float
    wall_s: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_membership_bench(
    *,
    nodes: int,
    loss: float,
    preset: str,
    duration: float,
    crashes: int,
    seed: int,
    warmup: float | None = None,
    joins: str = "batch",
) -> MembershipReport:
    try:
        return _run(
            nodes=nodes,
            loss=loss,
            preset=preset,
            duration=duration,
            crashes=crashes,
            seed=seed,
            warmup=warmup,
            joins=joins,
        )
    finally:
        gc.unfreeze()  # what _run froze is garbage again once unreachable


def _run(
    *,
    nodes: int,
    loss: float,
    preset: str,
    duration: float,
    crashes: int,
    seed: int,
    warmup: float | None = None,
    joins: str = "batch",
) -> MembershipReport:
    started = time.perf_counter()
    config = MembershipConfig.preset(preset)
    # Events are tallied as they happen (on_event) instead of recorded: a join storm of n
    # members alone makes n^2 of them. Bytes are only counted in the measured window.
    net = SimNetwork(seed=seed, config=config, loss=loss, record_events=False, count_bytes=False)
    if joins == "batch":
        members = net.add_settled(nodes)
    elif joins == "storm":
        members = [net.add_node()]
        for _ in range(nodes - 1):
            members.append(net.add_node(join=[net.rng.choice(members).addr]))
    else:
        raise LocalUsageError(f"joins must be 'batch' or 'storm', not {joins!r}")
    # The members' tables live as long as the run: out of the garbage collector's sight,
    # so that its full collections do not walk 10^8 references each time.
    gc.freeze()
    # Warm up until every member knows every other (bounded), so the measured window starts
    # from a settled mesh.
    limit = warmup if warmup is not None else 60 * config.probe_interval
    step = 2 * config.probe_interval
    net.run_until(step)
    while not (converged := net.converged()) and net.now < limit:
        net.run_until(net.now + step)

    crashed_at: dict[str, float] = {}
    first_dead: dict[str, float] = {}
    dead_seen: dict[str, set[str]] = {}
    last_dead: dict[str, float] = {}
    last_joined: dict[str, float] = {}
    joined_seen: dict[str, set[str]] = {}
    false_deaths = 0
    false_suspects = 0
    suspected_alive: set[str] = set()

    def on_event(seen: SeenEvent) -> None:
        nonlocal false_deaths, false_suspects
        node = seen.event.member.node
        kind = seen.event.kind
        if kind == "dead":
            if node in crashed_at:
                first_dead.setdefault(node, seen.time)
                dead_seen.setdefault(node, set()).add(seen.observer)
                last_dead[node] = seen.time
            else:
                false_deaths += 1
        elif kind == "suspect" and node not in crashed_at:
            false_suspects += 1
            suspected_alive.add(node)
        elif kind == "joined":
            joined_seen.setdefault(node, set()).add(seen.observer)
            last_joined[node] = seen.time

    net.count_bytes = True
    net.on_event = on_event
    msgs0 = sum(n.msgs_sent for n in net.nodes.values())
    bytes0 = sum(n.bytes_sent for n in net.nodes.values())
    t0 = net.now
    plan: list[tuple[float, str]] = [
        (t0 + net.rng.uniform(0.05, 0.8) * duration, "crash") for _ in range(crashes)
    ]
    plan.append((t0 + duration / 2, "join"))
    plan.sort()
    joiner: SimNode | None = None
    join_time = 0.0
    # Crash detection needs time after the last crash: keep running until detection settles.
    tail = config.crash_detection_bound(nodes) + 5 * config.probe_interval
    candidates = list(members[1:])
    net.rng.shuffle(candidates)
    for when, what in plan:
        net.run_until(when)
        if what == "crash" and candidates:
            victim = candidates.pop()
            net.crash(victim)
            crashed_at[victim.swim.node_id] = net.now
        elif what == "join":
            live = [n for n in net.live_nodes()]
            joiner = net.add_node(join=[net.rng.choice(live).addr])
            join_time = net.now
    net.run_until(t0 + duration)
    # Then run on until every crash is seen by every live member (the joiner aside, which may
    # never have known the victim), or the detection bound. (A count of observers stopped one
    # short when the joiner had seen a death and a member had not: it was then reported as
    # "not seen by all" although it was about to be.)
    deadline = max(crashed_at.values(), default=t0) + tail
    live_ids = {n.swim.node_id for n in net.live_nodes()}
    observers = live_ids - {joiner.swim.node_id if joiner else ""}
    while net.now < deadline and any(not observers <= dead_seen.get(n, set()) for n in crashed_at):
        net.run_until(net.now + config.probe_interval)

    detect_first: list[float] = []
    detect_all: list[float] = []
    undetected = 0
    for node, t_crash in crashed_at.items():
        if node not in first_dead:
            undetected += 1
            continue
        detect_first.append(first_dead[node] - t_crash)
        if observers <= dead_seen.get(node, set()):
            detect_all.append(last_dead[node] - t_crash)
        else:
            undetected += 1
    join_diss = math.nan
    if joiner is not None:
        jid = joiner.swim.node_id
        knowers = joined_seen.get(jid, set())
        if (live_ids - {jid}) <= knowers:
            join_diss = last_joined[jid] - join_time
    elapsed = net.now - t0
    total_msgs = sum(n.msgs_sent for n in net.nodes.values()) - msgs0
    total_bytes = sum(n.bytes_sent for n in net.nodes.values()) - bytes0
    return MembershipReport(
        nodes=nodes,
        joins=joins,
        loss=loss,
        preset=preset,
        duration_s=duration,
        seed=seed,
        converged_after_warmup=converged,
        crashes=len(crashed_at),
        detect_first_p50_s=percentile(detect_first, 50),
        detect_first_p99_s=percentile(detect_first, 99),
        detect_all_p50_s=percentile(detect_all, 50),
        detect_all_p99_s=percentile(detect_all, 99),
        undetected=undetected,
        join_dissemination_s=join_diss,
        false_positive_deaths=false_deaths,
        suspicions_of_live_members=false_suspects,
        live_members_suspected=len(suspected_alive),
        msgs_per_member_per_s=total_msgs / nodes / elapsed,
        bytes_per_member_per_s=total_bytes / nodes / elapsed,
        wall_s=time.perf_counter() - started,
    )


def format_report(r: MembershipReport) -> str:
    return "\n".join(
        [
            f"membership bench: {r.nodes} members ({r.joins} joins), preset {r.preset}, "
            f"loss {r.loss:.1%}, "
            f"{r.duration_s:.0f} simulated s, seed {r.seed} (wall {r.wall_s:.1f} s)",
            f"  converged after warm-up:   {r.converged_after_warmup}",
            f"  crash detection, first:    p50 {r.detect_first_p50_s:.2f} s   "
            f"p99 {r.detect_first_p99_s:.2f} s   ({r.crashes} crashes, {r.undetected} not "
            f"seen by all)",
            f"  crash detection, all:      p50 {r.detect_all_p50_s:.2f} s   "
            f"p99 {r.detect_all_p99_s:.2f} s",
            f"  join dissemination (all):  {r.join_dissemination_s:.2f} s",
            f"  false-positive deaths:     {r.false_positive_deaths}   "
            f"(suspicions of live members, refuted: {r.suspicions_of_live_members}, "
            f"of {r.live_members_suspected} members)",
            f"  cost per member:           {r.msgs_per_member_per_s:.1f} msgs/s   "
            f"{r.bytes_per_member_per_s:.0f} B/s",
        ]
    )
