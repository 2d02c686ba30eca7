"""``ftmesh bench kill``: real ``ftmesh node`` processes, time from kill -9 to the last
survivor's ``dead`` event.

Each round starts ``procs`` members on this host (same-host discovery), waits until they all
see each other, kills one with SIGKILL and measures, on the monotonic clock of this process,
the delay until the first and the last survivor report it dead. Those times include the event
travelling through each node's stdout pipe, so they slightly overstate detection.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from ..lab.procs import NodeGroup, declared_dead
from ..membership.config import MembershipConfig


def run_kill_bench(*, procs: int, rounds: int, preset: str) -> dict[str, Any]:
    firsts: list[float] = []
    lasts: list[float] = []
    with NodeGroup(mesh="bench-kill", preset=preset) as group:
        nodes = [group.start() for _ in range(procs)]
        group.wait_converged(nodes, timeout=60)
        for r in range(rounds):
            victim = nodes[r % len(nodes)]
            survivors = [n for n in nodes if n is not victim]
            killed = time.monotonic()
            victim.kill()
            seen = [
                n.wait_seen(declared_dead(victim.node_id), timeout=30).mono - killed
                for n in survivors
            ]
            firsts.append(min(seen))
            lasts.append(max(seen))
            # Replace the victim so every round runs at the same size.
            fresh = group.start()
            nodes = [*survivors, fresh]
            group.wait_converged(nodes, timeout=60)
    bound = MembershipConfig.preset(preset).crash_detection_bound(procs)
    return {
        "procs": procs,
        "rounds": rounds,
        "preset": preset,
        "first_dead_s": {"median": statistics.median(firsts), "max": max(firsts)},
        "last_dead_s": {"median": statistics.median(lasts), "max": max(lasts), "min": min(lasts)},
        "protocol_bound_s": bound,
    }


def format_kill_report(r: dict[str, Any]) -> str:
    return (
        f"kill -9 -> dead, {r['procs']} real processes, preset {r['preset']}, "
        f"{r['rounds']} rounds\n"
        f"  first survivor: median {r['first_dead_s']['median']:.3f} s  "
        f"max {r['first_dead_s']['max']:.3f} s\n"
        f"  last survivor:  median {r['last_dead_s']['median']:.3f} s  "
        f"min {r['last_dead_s']['min']:.3f} s  max {r['last_dead_s']['max']:.3f} s\n"
        f"  protocol bound (no confirmations): {r['protocol_bound_s']:.2f} s"
    )
