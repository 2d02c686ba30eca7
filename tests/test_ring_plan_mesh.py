"""The ring plan on real members (``ftmesh.collective.topology`` through ``ftmesh.mesh``):
measured links published from SWIM's probes, sites from labels, the view and its epoch, and the
hierarchical allreduce, with its bytes and its failures.

Real meshes in one process: SWIM over loopback UDP with the ``local`` preset, same-host
discovery in a per-test registry, real data-plane sockets."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AsyncExitStack, ExitStack, asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
from tests_support import local_mesh_config

from ftmesh.collective import RingView, ViewSupersededError
from ftmesh.collective.ops import CollectiveOp
from ftmesh.collective.topology import links_of, parse_links
from ftmesh.collective.view import view_epoch
from ftmesh.compression import Int8Compression
from ftmesh.errors import CollectiveError, PeerLostError
from ftmesh.mesh.blocking import SyncMesh
from ftmesh.mesh.core import Mesh, MeshConfig, open_mesh
from ftmesh.mesh.meta import LINKS_KEY

NO_HANG = 30.0


def config(
    registry: Path, site: str = "", links_interval: float = 0.0, name: str = ""
) -> MeshConfig:
    base = local_mesh_config(registry, "plan", max_cached_views=1)
    node = dataclasses.replace(base.node, name=name) if name else base.node
    return dataclasses.replace(base, node=node, site=site, links_interval=links_interval)


@asynccontextmanager
async def meshes(
    registry: Path, sites: list[str], links_interval: float = 0.0
) -> AsyncIterator[list[Mesh]]:
    async with AsyncExitStack() as stack:
        yield [
            await stack.enter_async_context(open_mesh(config(registry, s, links_interval)))
            for s in sites
        ]


async def one_view(ms: list[Mesh], size: int) -> str:
    """Wait until every member holds the same view of ``size`` members; its epoch."""
    with trio.fail_after(NO_HANG):
        while True:
            views = [v for m in ms if (v := m.view()) is not None and v.size == size]
            if len(views) == len(ms) and len({v.epoch for v in views}) == 1:
                return views[0].epoch
            await trio.sleep(0.05)


async def test_members_measure_and_publish_their_links(tmp_path: Path) -> None:
    """Every member times its probes' acks and publishes a bucket per peer; on one host the
    links are the fastest bucket, so the plan is one site, measured, and the epoch is the
    unplanned one (measured links between hosts: ``test_ring_plan_lab``)."""
    async with meshes(tmp_path, ["", "", ""], links_interval=0.2) as ms:
        await one_view(ms, 3)
        ids = sorted(m.node_id for m in ms)
        with trio.fail_after(NO_HANG):
            while True:
                published = [
                    links_of(parse_links(m.node.me().meta.get(LINKS_KEY, "1")), ids) for m in ms
                ]
                # one host: every peer advertises our address, so its link is bucket 0
                # whatever the probes measure (a loaded host's scheduling is no distance)
                if all(len(p) == 2 and all(b == 0 for b in p.values()) for p in published):
                    break
                await trio.sleep(0.1)
        for m, p in zip(ms, published, strict=True):
            assert set(p) == set(ids) - {m.node_id}
            assert m.links_published >= 1
        epoch = await one_view(ms, 3)
        view = ms[0].view()
        assert view is not None and view.plan is not None
        # every member's links are in every member's view (gossip converged): measured
        with trio.fail_after(NO_HANG):
            while ms[0].view().plan.source != "measured":  # type: ignore[union-attr]
                await trio.sleep(0.1)
        assert view.plan.flat and epoch == view_epoch(ids)


# -- explicit sites: the plan, the hierarchical allreduce, its bytes -----------------------------


@contextmanager
def sync_meshes(registry: Path, sites: list[str]) -> Iterator[list[SyncMesh]]:
    with ExitStack() as stack:
        yield [
            stack.enter_context(SyncMesh.start(config(registry, s, name=f"m{i}")))
            for i, s in enumerate(sites)
        ]


def common_view(ms: list[SyncMesh], size: int) -> RingView:
    deadline = time.monotonic() + NO_HANG
    while time.monotonic() < deadline:
        views = [v for m in ms if (v := m.view()) is not None and v.size == size]
        if len(views) == len(ms) and len({v.epoch for v in views}) == 1:
            return views[0]
        time.sleep(0.05)
    raise AssertionError(f"no common view of {size}")


def in_threads(ms: list[SyncMesh], fn: Callable[[SyncMesh], Any]) -> list[Any]:
    out: list[Any] = [None] * len(ms)

    def one(i: int) -> None:
        try:
            out[i] = fn(ms[i])
        except Exception as exc:
            out[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(ms))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(NO_HANG)
    assert not any(t.is_alive() for t in threads), "a collective hung"
    return out


def sent_counts(ms: list[SyncMesh]) -> list[dict[str, int]]:
    """Each member's payload bytes sent so far, by destination (``DataPlane.sent_bytes``)."""
    return [m.mesh.data_plane.sent_bytes() for m in ms]


def sent_since(
    ms: list[SyncMesh], before: list[dict[str, int]]
) -> Callable[[set[str], set[str]], int]:
    """``between(x, y)``: the bytes members ``x`` sent to members ``y`` since ``before``."""
    after = sent_counts(ms)
    sent = {
        (ms[i].node_id, peer): after[i].get(peer, 0) - before[i].get(peer, 0)
        for i in range(len(ms))
        for peer in after[i]
    }

    def between(x: set[str], y: set[str]) -> int:
        return sum(v for (src, dst), v in sent.items() if src in x and dst in y)

    return between


def check_sum_and_avg(ms: list[SyncMesh], view: RingView, seed: int) -> None:
    """Allreduces (sum, avg) of an odd length on ``view``: every member gets the same bits,
    equal (allclose) to the float64 sum (mean)."""
    rng = np.random.default_rng(seed)
    n = 100_003
    inputs = {m.node_id: rng.standard_normal(n).astype(np.float32) for m in ms}
    want = np.sum([inputs[k].astype(np.float64) for k in sorted(inputs)], axis=0)
    for op, expect in (("sum", want), ("avg", want / len(ms))):

        def reduce(m: SyncMesh, op: str = op) -> Any:
            return m.session(view).allreduce(inputs[m.node_id].copy(), op).output

        outs = in_threads(ms, reduce)
        assert not [o for o in outs if isinstance(o, Exception)], outs
        assert len({o.tobytes() for o in outs}) == 1  # the same bits everywhere
        assert np.allclose(outs[0], expect, rtol=1e-5, atol=1e-5)


def test_two_labelled_sites_plan_alike_and_reduce_hierarchically(tmp_path: Path) -> None:
    """2 + 2 members with ``--site`` labels: every member derives the same plan (sites
    adjacent on the ring, hierarchical) and the same epoch, which is not the unplanned one.
    Allreduces (sum, avg; an odd length, so the site blocks differ in size) give every member
    the same bits, equal (allclose) to the sum in float64. Across the sites, each direction
    carries exactly one buffer (S bytes) per allreduce, where the flat ring on the same order
    would carry 2 (N-1)/N S = 1.5 S."""
    with sync_meshes(tmp_path, ["east", "west", "east", "west"]) as ms:
        view = common_view(ms, 4)
        plans = [m.view().plan for m in ms]  # type: ignore[union-attr]
        assert all(p is not None and p.hierarchical and p.source == "labels" for p in plans)
        assert len({p.hash for p in plans if p is not None}) == 1
        plan = view.plan
        assert plan is not None and [s.label for s in plan.sites] == ["east", "west"]
        east = {ms[0].node_id, ms[2].node_id}
        assert set(plan.sites[0].members) == east and view.node_ids == plan.order
        assert view.epoch != view_epoch(view.node_ids)
        check_sum_and_avg(ms, view, seed=5)

        # the view's ring and both sub-rings stay open from one allreduce to the next (a
        # sub-ring counts as its view's in the ring cache: max_cached_views=1 here)
        def rings(m: SyncMesh) -> list[Any]:
            dp = m.mesh.data_plane
            subs = [v for v in view.groups(m.node_id) if v is not None]
            return [dp.whole_ring(v.epoch) for v in (view, *subs)]

        opened = [rings(m) for m in ms]
        assert all(r is not None for rs in opened for r in rs), opened
        # bytes: one more allreduce of S bytes, counted per destination
        s_bytes = 4 * 65536
        before = sent_counts(ms)
        outs = in_threads(
            ms, lambda m: m.session(view).allreduce(np.ones(65536, np.float32)).output
        )
        assert all(np.array_equal(o, np.full(65536, 4.0, np.float32)) for o in outs), outs
        between = sent_since(ms, before)
        assert [rings(m) for m in ms] == opened  # (the same Ring objects: none reopened)
        west = set(view.node_ids) - east

        assert between(east, west) == between(west, east) == s_bytes
        # inside each site: the reduce-scatter and allgather halves, (k-1)/k S each, per member
        assert between(east, east) == between(west, west) == 2 * s_bytes
        # ftmesh status shows the plan
        status = subprocess.run(
            [sys.executable, "-m", "ftmesh", "status", "--mesh", "plan",
             "--registry-dir", str(tmp_path)],
            capture_output=True, text=True, timeout=60, cwd=ROOT,
            env=dict(os.environ, PYTHONPATH=str(ROOT)),
        )  # fmt: skip
        assert status.returncode == 0, status.stdout + status.stderr
        name = {m.node_id: f"m{i}" for i, m in enumerate(ms)}
        east_names, west_names = ([name[n] for n in s.members] for s in plan.sites)
        assert status.stdout.splitlines()[-4:] == [
            f"ring plan: 2 sites (labels) east[2] west[2], hierarchical, plan {plan.hash[:8]}",
            f"  site east: {', '.join(east_names)}",
            f"  site west: {', '.join(west_names)}",
            f"  ring: {' -> '.join(name[n] for n in view.node_ids)} -> (back to the first)",
        ], status.stdout
        assert sorted(east_names) == ["m0", "m2"]


@pytest.mark.parametrize("sites", ["abab", "aaabb"])
def test_an_int8_allreduce_compresses_only_across_the_sites(tmp_path: Path, sites: str) -> None:
    """int8 compression on a hierarchical view (``ftmesh.collective.hierarchical_int8``): the
    sites reduce in float32, only the cross-site phase is int8. Every member gets the same
    bits, near the float64 sum (``sum`` and ``avg``, an odd length), the exact tail (counters)
    summed in float32; inside each site exactly the float32 halves travel, across the sites
    each direction carries about a quarter of the buffer (int8 and a scale per block of 256:
    S (1 + 4/256) / 4); and error feedback keeps what 8 rounds of the same values add up to
    within about one round's error of 8 times their sum."""
    with sync_meshes(tmp_path, list(sites)) as ms:
        size = len(sites)
        view = common_view(ms, size)
        assert view.plan is not None and view.plan.hierarchical
        n, tail = 100_003, 3
        rng = np.random.default_rng(11)
        inputs = {m.node_id: rng.standard_normal(n).astype(np.float32) for m in ms}
        for i, m in enumerate(ms):
            inputs[m.node_id][-tail:] = [1000.0 + i, 0.001 * i, 12345.5]
        want = np.sum([inputs[k].astype(np.float64) for k in sorted(inputs)], axis=0)
        comps = {m.node_id: Int8Compression(exact_tail=tail) for m in ms}
        a = {m.node_id for m, s in zip(ms, sites, strict=True) if s == "a"}
        b = set(view.node_ids) - a

        def reduce(op: str) -> list[Any]:
            def one(m: SyncMesh) -> Any:
                x = inputs[m.node_id].copy()
                return m.session(view).allreduce(x, op, comps[m.node_id]).output

            outs = in_threads(ms, one)
            assert not [o for o in outs if isinstance(o, Exception)], outs
            assert len({o.tobytes() for o in outs}) == 1  # the same bits everywhere
            return outs

        before = sent_counts(ms)
        (out, *_) = reduce("sum")
        between = sent_since(ms, before)

        s_bytes = 4 * n
        for x, y in ((a, b), (b, a)):
            assert 0.25 * s_bytes < between(x, y) < 0.27 * s_bytes, between(x, y)
        # inside a site of k: (k-1)/k S in each half, per member, in float32
        k_a, k_b = len(a), len(b)
        assert between(a, a) == pytest.approx(2 * (k_a - 1) * s_bytes, rel=1e-4)
        assert between(b, b) == pytest.approx(2 * (k_b - 1) * s_bytes, rel=1e-4)
        scale = float(np.max(np.abs(want[:-tail])))
        err = np.abs(out[:-tail] - want[:-tail])
        assert err.max() < 0.05 * scale, (err.max(), scale)
        assert np.allclose(out[-tail:], want[-tail:], rtol=1e-6, atol=1e-4), out[-tail:]
        (avg, *_) = reduce("avg")
        assert np.abs(avg[:-tail] - want[:-tail] / size).max() < 0.05 * scale / size
        assert np.allclose(avg[-tail:], want[-tail:] / size, rtol=1e-6, atol=1e-4)
        # error feedback: 8 more rounds of the same values add up to 8 sums, within about one
        # round's error (without it, the errors would add up: 8 rounds, 8 times the error)
        total = np.zeros(n, np.float64)
        for _ in range(8):
            (o, *_) = reduce("sum")
            total += o
        drift = np.abs(total[:-tail] - 8 * want[:-tail])
        assert drift.max() < 3 * err.max(), (drift.max(), err.max())


@pytest.mark.parametrize("sites", ["aaabb", "aab"])
def test_unequal_sites_reduce_hierarchically(tmp_path: Path, sites: str) -> None:
    """3 + 2 and 2 + 1 labelled members: the plan is hierarchical in blocks of the smallest
    site's size; allreduces (sum, avg; an odd length) give every member the same bits, equal
    (allclose) to the float64 sum; across the sites each direction carries exactly one buffer
    (S bytes) per allreduce, where the flat site-ordered ring would carry 2 (N-1)/N S."""
    with sync_meshes(tmp_path, list(sites)) as ms:
        n_members = len(sites)
        view = common_view(ms, n_members)
        plan = view.plan
        assert plan is not None and plan.hierarchical and plan.blocks == sites.count("b")
        check_sum_and_avg(ms, view, seed=7)
        s_bytes = 4 * 65536
        before = sent_counts(ms)
        outs = in_threads(
            ms, lambda m: m.session(view).allreduce(np.ones(65536, np.float32)).output
        )
        want_ones = np.full(65536, float(n_members), np.float32)
        assert all(np.array_equal(o, want_ones) for o in outs), outs
        between = sent_since(ms, before)
        a = {m.node_id for m, s in zip(ms, sites, strict=True) if s == "a"}
        b = set(view.node_ids) - a

        assert between(a, b) == between(b, a) == s_bytes


async def test_the_async_face_runs_the_hierarchical_allreduce(tmp_path: Path) -> None:
    """``Mesh.allreduce`` (inside trio) on a 2 + 2 mesh: the same phases, the same result."""
    async with meshes(tmp_path, ["a", "b", "a", "b"]) as ms:
        epoch = await one_view(ms, 4)
        view = ms[0].view()
        assert view is not None and view.hierarchical and view.epoch == epoch
        outs: dict[int, Any] = {}

        async def one(i: int) -> None:
            x = np.arange(1001, dtype=np.float64) * (i + 1)
            outs[i] = (await ms[i].allreduce(x, "avg")).output

        async with trio.open_nursery() as nursery:
            for i in range(4):
                nursery.start_soon(one, i)
        assert len({o.tobytes() for o in outs.values()}) == 1
        assert np.allclose(outs[0], np.arange(1001) * 2.5)


# -- a kill during a hierarchical allreduce ----------------------------------------------------

WORKER = Path(__file__).with_name("plan_worker.py")
ROOT = Path(__file__).resolve().parents[1]


def test_a_kill_fails_the_hierarchical_allreduce_and_the_next_view_works(tmp_path: Path) -> None:
    """Four member processes, sites 2 + 2, allreducing 4 MiB hierarchically in a loop; one is
    SIGKILLed. Every survivor's allreduce fails with one of the session's typed errors (a lost
    peer, or a view moved on), none hangs, and all three then reduce on the view of three (two
    sites of unequal size, 2 + 1: hierarchical in one block)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(tmp_path), site, "4"],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for site in ("east", "west", "east", "west")
    ]
    lines: list[list[dict[str, Any]]] = [[] for _ in procs]

    def read(i: int) -> None:
        out = procs[i].stdout
        assert out is not None
        for line in out:
            lines[i].append(json.loads(line))

    readers = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(4)]
    for t in readers:
        t.start()
    try:
        deadline = time.monotonic() + 90
        while not all(sum("ok" in x for x in ls) >= 2 for ls in lines):
            assert time.monotonic() < deadline, lines
            assert all(p.poll() is None for p in procs), lines
            time.sleep(0.05)
        procs[3].kill()
        killed_at, killed_wall = time.monotonic(), time.time()
        (tmp_path / "killed").write_text("")
        while not all(any("after" in x for x in ls) for ls in lines[:3]):
            assert time.monotonic() < killed_at + 60, f"no allreduce after the kill: {lines}"
            assert all(p.poll() is None for p in procs[:3]), lines
            time.sleep(0.05)
        (tmp_path / "stop").write_text("")
        for p in procs[:3]:
            assert p.wait(30) == 0, lines
        survivors = lines[:3]
        print("survivors:", [[x for x in ls if "ok" not in x] for ls in survivors])
        for ls in survivors:
            assert all(x["right"] for x in ls if "ok" in x), ls
            # (errors before the kill: a loaded host's hiccups, retried on the next view)
            errors = [x for x in ls if "error" in x and x["t"] >= killed_wall - 0.05]
            assert len(errors) == 1, ls
            assert errors[0]["error"] in (
                "RingPeerLostError", "PeerStalledError", "ViewSupersededError",
                "ViewMismatchError",
            ), ls  # fmt: skip
            after = [x for x in ls if "after" in x]
            # (the view of three: sites 2 + 1, hierarchical in one block)
            assert after and after[0]["right"] and after[0]["hierarchical"], ls
        assert time.monotonic() - killed_at < 50  # (far below io_timeout: nobody waited it out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)
            if p.stdout is not None:
                p.stdout.close()
        for t in readers:
            t.join(5)


# -- one member gives up an attempt: the others fail promptly and the retry converges -----------


def retried_allreduce(m: SyncMesh, view: RingView, until: float) -> tuple[int, float, str]:
    """Allreduce ones on ``view`` until an attempt succeeds, as the trainer retries a step:
    the attempts made, the seconds it took and the last error (``""``: none failed). Gives
    up at ``until`` (``time.monotonic()``)."""
    start, attempts, last = time.monotonic(), 0, ""
    while time.monotonic() < until:
        attempts += 1
        try:
            out = m.session(view).allreduce(np.ones(65536, np.float32)).output
        except (CollectiveError, PeerLostError) as exc:
            last = f"{type(exc).__name__}: {exc}"
            continue
        assert np.array_equal(out, np.full(65536, 4.0, np.float32))
        return attempts, time.monotonic() - start, last
    raise AssertionError(f"{m.node_id[:8]}: no attempt succeeded in {attempts}: {last}")


def test_a_member_that_lost_its_rings_alone_does_not_livelock_the_retries(
    tmp_path: Path,
) -> None:
    """A suspicion that only one member saw, refuted (the lab's saturated WAN link: the view
    comes back with the same epoch): that member's rings of the view were killed, while its
    neighbours' whole-view rings still look healthy to them. A hierarchical allreduce opens
    the whole view's ring first and then the phases' sub-rings, so the member reopening the
    whole ring waited for neighbours that went straight to a sub-ring, and they for it: every
    retry failed after ``view_timeout`` for as long as the view lasted (the lab run's stall).
    A member that fails any part of a hierarchical attempt now also gives up the whole
    view's ring, so the retries meet again within a few attempts."""
    with sync_meshes(tmp_path, ["a", "b", "a", "b"]) as ms:
        view = common_view(ms, 4)
        assert view.hierarchical
        until = time.monotonic() + 25
        assert all(r[0] == 1 for r in in_threads(ms, lambda m: retried_allreduce(m, view, until)))
        # m0 alone hears that m2 (its site's other member) is suspect, and the suspicion is
        # refuted at once: the view (and its epoch) stays, m0's rings of it are killed
        ms[0].call_sync(
            ms[0].mesh.data_plane.abort_view, view.epoch, ms[2].node_id, "test: suspect"
        )
        assert ms[0].view() == view
        until = time.monotonic() + 25
        outs = in_threads(ms, lambda m: retried_allreduce(m, view, until))
        assert not [o for o in outs if isinstance(o, BaseException)], outs
        # (each failed attempt costs a view_timeout (5 s) at most; a livelock runs to `until`)
        assert max(o[1] for o in outs) < 12, outs
        assert max(o[0] for o in outs) <= 3, outs


def test_a_member_abandoning_the_cross_site_phase_fails_the_others_promptly(
    tmp_path: Path,
) -> None:
    """One member of site a gives its attempt up after the site phase, before the cross-site
    phase (its view moved on, as ``Mesh._in_use`` says when it opens the cross sub-ring). The
    three others fail promptly -- its cross-site partner waits in the cross phase, the two
    others in the site phases after theirs -- not after ``io_timeout`` (60 s here): it tells
    every sub-ring it is on (notices both ways). The next attempt of all four succeeds."""
    with sync_meshes(tmp_path, ["a", "b", "a", "b"]) as ms:
        view = common_view(ms, 4)
        until = time.monotonic() + 25
        assert all(r[0] == 1 for r in in_threads(ms, lambda m: retried_allreduce(m, view, until)))
        quitter = ms[0]
        _site, cross = view.groups(quitter.node_id)
        assert cross is not None
        plane = quitter.mesh.data_plane

        def abandon(m: SyncMesh) -> Any:
            if m is not quitter:
                start = time.monotonic()
                try:
                    m.session(view).allreduce(np.ones(65536, np.float32))
                except (CollectiveError, PeerLostError) as exc:
                    return time.monotonic() - start, exc
                return time.monotonic() - start, None

            def ring_of(sub: RingView) -> Any:
                if sub.epoch == cross.epoch:
                    raise ViewSupersededError("test: moved on", epoch=view.epoch)
                ring = m.mesh.ring_in_use(sub)
                assert ring is not None  # (open since the first allreduce)
                return ring

            phases = plane.plan_phases(view, CollectiveOp.allreduce("sum"), np.ones(65536, "f4"))
            try:
                plane.run_phases_blocking(phases, ring_of)
            except ViewSupersededError:
                return None
            raise AssertionError("the quitter's attempt did not fail")

        outs = in_threads(ms, abandon)
        others = [o for m, o in zip(ms, outs, strict=True) if m is not quitter]
        assert all(isinstance(o, tuple) and o[1] is not None for o in others), outs
        assert max(o[0] for o in others) < 5, outs  # (io_timeout is 60 s)
        until = time.monotonic() + 25
        outs = in_threads(ms, lambda m: retried_allreduce(m, view, until))
        assert not [o for o in outs if isinstance(o, BaseException)], outs
        assert max(o[1] for o in outs) < 12, outs
