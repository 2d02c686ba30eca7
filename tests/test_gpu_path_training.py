"""Issue #24 item 4: the trainer's GPU path, proven on the CPU by the same code. Three
``ftmesh.lab.train_worker`` processes on loopback with ``--gpu-standin`` (a test setting:
CPU tensors count as device buffers and torch's gloo process group, built per view epoch on
the mesh's ring store, stands in for NCCL): their gradient buckets reduce on that backend,
the header beside them on the TCP ring. A ``kill -9`` aborts the view's group and the
survivors build the next one; a joiner fetches the state and gets a group of the 3-member
view again. Every member holds the same digest after every step, and the commit records
show the buckets were on the device and how many collectives the backend ran."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from reach_support import commits, on_view, stop_all, wait_commit, worker_argv

from ftmesh.lab.procs import NodeProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

START = 90.0
"""Seconds a worker may take to import torch and join (several start at once on 2 cores)."""


def _start(tmp_path: Path, name: str) -> NodeProcess:
    argv = worker_argv(name, "--gpu-standin", registry=tmp_path / "reg")
    return NodeProcess(argv, stderr_path=tmp_path / f"{name}.stderr", start_timeout=START)


def test_three_members_train_on_the_process_group_backend_through_a_kill_and_a_join(
    tmp_path: Path,
) -> None:
    procs: list[NodeProcess] = []
    try:
        procs = [_start(tmp_path, n) for n in ("g0", "g1", "g2")]
        trio = {p.node_id for p in procs}
        wait_commit(procs, on_view(trio), timeout=120.0)
        high = max(int(c["step"]) for p in procs for c in commits(p))
        wait_commit(procs, on_view(trio, high + 3), timeout=60.0)
        victim, survivors = procs[2], procs[:2]
        victim.signal(signal.SIGKILL)
        pair = {p.node_id for p in survivors}
        wait_commit(survivors, on_view(pair, high + 3), timeout=90.0)
        high = max(int(c["step"]) for p in survivors for c in commits(p))
        wait_commit(survivors, on_view(pair, high + 3), timeout=60.0)
        joiner = _start(tmp_path, "g3")
        procs.append(joiner)
        trio = pair | {joiner.node_id}
        members = [*survivors, joiner]
        wait_commit(members, on_view(trio), timeout=120.0)
        high = max(int(c["step"]) for p in members for c in commits(p))
        wait_commit(members, on_view(trio, high + 3), timeout=60.0)

        by_step: dict[int, set[str]] = {}
        for p in procs:
            for c in commits(p):
                by_step.setdefault(int(c["step"]), set()).add(str(c["digest"]))
        assert by_step and all(len(d) == 1 for d in by_step.values()), by_step
        for p in members:
            last = commits(p)[-1]
            gpu = last["gpu"]
            print(p.node_id, "step", last["step"], gpu)
            # every bucket of this model is on the "device"; each step's buckets ran on the
            # process group, on views set up on it (3, 2, then 3 members again for the first
            # members; the joiner's first view is the 3-member one)
            assert gpu["device_buckets"] >= 1, gpu
            assert gpu["fallbacks"] == 0, gpu
            assert gpu["nccl_views"] >= (1 if p is joiner else 3), gpu
            # (the record's counters are read as the step commits: its own collectives may
            # still be counting, so the steps before it)
            computed = sum(1 for c in commits(p)[:-1] if not c["adopted"])
            assert gpu["collectives"] >= computed * gpu["device_buckets"], (gpu, computed)
        assert victim.proc.poll() == -signal.SIGKILL
        assert all(p.proc.poll() is None for p in members), "a member exited"
    finally:
        stop_all(procs)
