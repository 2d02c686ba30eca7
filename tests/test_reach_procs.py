"""Reachability with real training processes on loopback: a member whose data-plane address
cannot be reached (it publishes a closed port: a wrong ``--advertise``, a firewalled port)
while gossip reaches it is left out of the ring within the documented bound, with a WARNING
that names it and the address tried; the others keep committing at >= 80 % of the step rate
they had before; once reachable again it is taken back. Also the insiders of issue 17: a
member holding the secret that serves flipped state bytes as the only holder, and one that
sends malformed frames, are left out after the documented threshold, and training resumes
without them."""

from __future__ import annotations

import itertools
import os
import re
import shutil
import signal
import time
from pathlib import Path

import pytest
from reach_support import commits, log_lines, on_view, rate, stop_all, wait_commit, worker_argv

from ftmesh.collective.reach import ReachConfig
from ftmesh.lab.netns import VirtualLan
from ftmesh.lab.procs import NodeProcess
from ftmesh.mesh.reach import REACH_TICK

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

CFG = ReachConfig()
EXCLUSION_BOUND = CFG.unreachable_after + REACH_TICK + 1.0 + 5.0
"""Seconds from the fault to the first commit without the member: the tracker's threshold and
tick, gossip of the accusation (~1 s on loopback), plus 5 s of slack for a loaded 2-core CI
host (the ring attempt in flight is superseded as soon as the view changes)."""
WINDOW = 8.0
"""Seconds over which step rates are compared."""
START = 90.0
"""Seconds a worker may take to import torch and join (several start at once on 2 cores)."""


def test_unreachable_data_address_is_left_out_and_taken_back(tmp_path: Path) -> None:
    """h0 and h1 train; h2 joins publishing a closed port as its data address. h0 and h1 go on
    at their rate of before h2 came (measured in this run), h2 named in a WARNING; reachable
    again (SIGUSR2), h2 is taken back and the three train together."""
    reg = tmp_path / "reg"
    procs: list[NodeProcess] = []
    try:
        for name in ("h0", "h1"):
            argv = worker_argv(name, registry=reg)
            procs.append(
                NodeProcess(
                    argv,
                    stderr_path=tmp_path / f"{name}.stderr",
                    start_timeout=START,
                    wait_started=False,  # (both import torch at once, then awaited)
                )
            )
        for p in procs:
            p.wait_started()
        good = list(procs)
        rest = {p.node_id for p in good}
        t = wait_commit(good, on_view(rest), timeout=120.0)
        time.sleep(max(0.0, t + WINDOW - time.monotonic()))
        base = [rate(p, t, t + WINDOW) for p in good]
        argv = worker_argv("h2", "--fault", "bad-data-addr", "--fault-on-start", registry=reg)
        bad = NodeProcess(argv, stderr_path=tmp_path / "h2.stderr", start_timeout=START)
        procs.append(bad)
        fault = bad.wait_seen(lambda r: r.get("event") == "fault" and r["on"], 60.0)
        addr = str(fault.record["detail"]).rpartition(" ")[2]
        # h2 enters the ring at its first step; its neighbours cannot connect to it and leave
        # it out. The longest pause in h0's commits from then on is what it cost.
        warned = wait_warning(good, "the ring leaves out h2", timeout=120.0)
        out_at = time.monotonic()
        time.sleep(WINDOW + 1.0)
        after = [rate(p, out_at + 1.0, out_at + 1.0 + WINDOW) for p in good]
        for b, a in zip(base, after, strict=True):
            assert a >= 0.8 * b, f"step rate {a:.1f}/s without h2 vs {b:.1f}/s before it came"
        stall = longest_pause(good[0], fault.mono, out_at + WINDOW)
        assert stall <= EXCLUSION_BOUND, f"h0 committed nothing for {stall:.1f}s"
        assert all(set(c["members"]) == rest for c in commits(good[0], out_at + 1.0))
        # The WARNINGs name the member and the address tried (its published, closed port).
        assert addr.startswith("127.0.0.1:"), fault.record
        reported = [w for w in warned if "cannot be reached" in w]
        assert reported and all(addr in w and bad.node_id[:8] in w for w in reported), warned
        # Reachable again: taken back.
        bad.signal(signal.SIGUSR2)
        healed = bad.wait_seen(lambda r: r.get("event") == "fault" and not r["on"], 10.0)
        ids = {p.node_id for p in procs}
        high = max(int(c["step"]) for c in commits(good[0]))
        back_at = wait_commit(procs, on_view(ids, high), timeout=60.0)
        bound = CFG.min_hold + CFG.probe_interval + 2 * REACH_TICK + 1.0 + 10.0
        assert back_at - healed.mono <= bound, f"taken back after {back_at - healed.mono:.1f}s"
        print(
            f"\nlongest pause {stall:.2f}s; step rates before {base} after {after}; "
            f"taken back after {back_at - healed.mono:.2f}s"
        )
    finally:
        stop_all(procs)


def wait_warning(procs: list[NodeProcess], text: str, timeout: float) -> list[str]:
    """Wait until one of ``procs`` logged a WARNING containing ``text``; every WARNING of
    theirs so far."""
    deadline = time.monotonic() + timeout
    while True:
        found = [line for p in procs for line in log_lines(Path(str(p.stderr_path)), "WARNING")]
        if any(text in line for line in found):
            return found
        assert time.monotonic() < deadline, f"no WARNING with {text!r} within {timeout}s"
        time.sleep(0.2)


def longest_pause(p: NodeProcess, since: float, until: float) -> float:
    """The longest time between two commits of ``p`` (or ``since``/``until``) in between."""
    with p._cond:
        times = [s.mono for s in p.records if s.record.get("event") == "commit"]
    marks = [since, *(x for x in times if since < x < until), until]
    return max(b - a for a, b in itertools.pairwise(marks))


needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("nft") is None,
    reason="needs root to create network namespaces (and iproute2, nftables); CI runs as root",
)

LINK_BREAK_BOUND = 10.0 + CFG.unreachable_after + REACH_TICK + 1.0 + 5.0
"""Seconds a link that breaks under an open ring may stall the others: the ring's connections
stall (the mesh's ``io_timeout``, 10 s), the reconnect fails for ``unreachable_after``, then
the tick, the accusation's gossip and CI slack as above."""


@pytest.mark.netns
@needs_root
def test_one_way_link_between_two_of_three_lab_hosts(tmp_path: Path) -> None:
    """Three lab hosts train (mDNS, the ``lan`` membership preset); the IPv4 packets from h0
    to h1 are dropped (gossip still reaches both through h2, so SWIM holds everyone alive).
    The member whose connection fails accuses the other; that one is left out, named in a
    WARNING, and the two others commit at >= 80 % of their rate before the fault. Healed, the
    three train together again."""
    with VirtualLan(hosts=3, prefix="ftmreach") as lan:
        procs: list[NodeProcess] = []
        try:
            for h in range(3):
                argv = ["ip", "netns", "exec", lan.ns_name(h)]
                argv += worker_argv(f"h{h}", "--interface", lan.host_ip(h), "--preset", "lan")
                procs.append(
                    NodeProcess(
                        argv,
                        stderr_path=tmp_path / f"h{h}.stderr",
                        start_timeout=START,
                        wait_started=False,  # (all three import torch at once, then awaited)
                    )
                )
            for p in procs:
                p.wait_started()
            ids = {p.node_id for p in procs}
            t = wait_commit(procs, on_view(ids), timeout=120.0)
            time.sleep(max(0.0, t + WINDOW - time.monotonic()))
            base = {p.name: rate(p, t, t + WINDOW) for p in procs}
            broke = time.monotonic()
            lan.one_way(0, 1)
            warned = wait_warning(procs, "the ring leaves out h", timeout=60.0)
            out_at = time.monotonic()
            left_out = [p for p in procs[:2] if any(f"leaves out {p.name} " in w for w in warned)]
            assert len(left_out) == 1, warned
            rest = [p for p in procs if p is not left_out[0]]
            time.sleep(WINDOW + 1.0)
            after = {p.name: rate(p, out_at + 1.0, out_at + 1.0 + WINDOW) for p in rest}
            for p in rest:
                assert after[p.name] >= 0.8 * base[p.name], (after, base)
            assert all(
                set(c["members"]) == {p.node_id for p in rest}
                for c in commits(rest[0], out_at + 1.0)
            )
            stall = longest_pause(rest[0], broke, out_at + WINDOW)
            assert stall <= LINK_BREAK_BOUND, f"{rest[0].name} committed nothing for {stall:.1f}s"
            accused = [w for w in warned if "cannot be reached" in w]
            named = (f"{left_out[0].name} (", "leaves out this member")  # (or its own log)
            assert accused and all(any(n in w for n in named) for w in accused), warned
            high = max(int(c["step"]) for c in commits(rest[0]))
            lan.one_way(0, 1, broken=False)
            healed = time.monotonic()
            back_at = wait_commit(procs, on_view(ids, high), timeout=60.0)
            print(
                f"\nleft out {left_out[0].name}; longest pause {stall:.2f}s; step rates "
                f"before {base} after {after}; taken back after {back_at - healed:.2f}s"
            )
        finally:
            stop_all(procs)


def test_insiders_are_left_out_after_the_threshold_and_training_resumes(tmp_path: Path) -> None:
    """Two insiders (they hold the secret, if there is one, and run the real code with a fault
    injected, ``ftmesh.lab.insider``). h0 trains alone, then h1 and h2 join while h0 serves
    them flipped state bytes as the only holder: each counts the failed verifications, accuses
    h0 at the threshold, and the two train on from their own state without it. Then h3 joins
    and, once it trains with them, sends malformed frames: its right neighbour accuses it at
    the threshold and the two train on without it."""
    reg = tmp_path / "reg"
    strikes = CFG.bad_bytes_strikes

    def start(name: str, *extra: str, wait: bool = True) -> NodeProcess:
        argv = worker_argv(name, *extra, registry=reg)
        return NodeProcess(
            argv, stderr_path=tmp_path / f"{name}.stderr", start_timeout=START, wait_started=wait
        )

    procs: list[NodeProcess] = []
    try:
        liar = start("h0", "--fault", "flip-state", "--fault-on-start")
        procs.append(liar)
        wait_commit([liar], on_view({liar.node_id}, 10), timeout=120.0)
        honest = [start("h1", wait=False), start("h2", wait=False)]
        procs += honest
        for p in honest:
            p.wait_started()
        pair = {p.node_id for p in honest}
        joined = time.monotonic()
        resumed = wait_commit(honest, on_view(pair), timeout=90.0)
        warned = wait_warning(honest, "serves state that fails verification", timeout=10.0)
        accusations = [w for w in warned if "h0" in w and "cannot be reached" not in w]
        assert any(counted(w) >= strikes for w in accusations), warned
        for p in honest:  # no more than the threshold (and the ticks until it took effect)
            failed = log_lines(Path(str(p.stderr_path)), r"attempt \d+ failed .*fetch state")
            assert len(failed) <= strikes + 3, failed
        print(f"\nflip-state: the joiners trained without h0 {resumed - joined:.1f}s after start")
        # Its accusation stands for a minute (``bad_bytes_hold``); h3 may take longer than
        # that to start on a loaded host, so h0 goes now (the ring without it is shown).
        liar.kill()
        # The second insider: malformed frames once it trains in the ring.
        framer = start("h3", "--fault", "bad-frames")
        procs.append(framer)
        trio_ids = pair | {framer.node_id}
        wait_commit([*honest, framer], on_view(trio_ids), timeout=90.0)
        high = max(int(c["step"]) for c in commits(honest[0]))
        framer.signal(signal.SIGUSR1)
        on = framer.wait_seen(lambda r: r.get("event") == "fault" and r["on"], 10.0)
        back = wait_commit(honest, on_view(pair, high), timeout=60.0)
        assert back - on.mono <= EXCLUSION_BOUND, f"took {back - on.mono:.1f}s"
        warned = wait_warning(honest, "sends frames that fail verification", timeout=10.0)
        accusation = [w for w in warned if "h3" in w and "frames that fail" in w]
        assert any("4294967040" in w for w in accusation), warned
        assert any(counted(w) >= strikes for w in accusation), warned
        time.sleep(2.0)
        assert all(set(c["members"]) == pair for c in commits(honest[0], back))
        print(f"bad-frames: trained without h3 {back - on.mono:.1f}s after the fault")
    finally:
        stop_all(procs)


def counted(warning: str) -> int:
    """The verification failures an accusation's WARNING counts (the threshold, or more:
    retries fail faster than the tracker ticks)."""
    found = re.search(r"(\d+) verification failures", warning)
    return int(found.group(1)) if found else -1
