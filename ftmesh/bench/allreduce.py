"""``ftmesh bench allreduce``: ftmesh ring allreduce vs torch.distributed gloo vs a raw TCP ring.

Theory of operation: for each process count N, launch N local processes (multiprocessing,
spawn). Every process joins a gloo group (TCPStore rendezvous on loopback), starts an ftmesh
data plane and a raw-socket ring, and publishes the addresses through the store. For each size,
each repetition runs the three implementations back to back on the same float32 buffer size,
rotating their order so machine noise hits all of them; a gloo barrier precedes every timed
call and a repetition's time is the slowest rank's. We report medians (and min/max) of

* algbw = bytes / time, busbw = algbw * 2(N-1)/N (the bytes each rank moves, NCCL's convention);
* ``ceiling`` (``--ceiling stream``, the default): the bytes a ring allreduce moves, and
  nothing else. Each member streams ``2(N-1)/N`` of the buffer to its right neighbour, one
  ``sendall`` per ring step from a sender thread, while its main thread receives as many
  from its left into a sink (``MSG_WAITALL`` per ring step): the same process count, the same
  ring of loopback TCP connections, the same bytes per link, the kernel's socket buffer
  autotuning (as gloo has it; ``--ceiling-sockbuf`` fixes a size, which ran slower), but no
  reduction, no wait for the receive a chunk depends on, no framing and no event
  loop. Every ring allreduce (ftmesh's, gloo's) does all of this and more, so it is an upper
  bound on a host with CPU to spare: ``ftm/ceil`` and ``gloo/ceil`` read at most 1.0 up to
  noise. On a host whose CPUs other processes keep busy it is not: there the scheduler sets
  every implementation's pace (gloo's C++ threads fared better than any Python ring: at load
  20-29 on 2 CPUs gloo/ceil read 0.56-1.69 between runs), so the JSON carries the load
  average before and after (``loadavg``, ``cpus``) and a cell above the ceiling is noted.
  It reduces nothing, so ``--check`` skips it. ``--ceiling reduce`` is the earlier probe
  instead: the chunked ring reduce-scatter + allgather written plainly in Python (a sender
  and a receiver thread, ``np.add`` in place, a chunk sent only once the receive it depends
  on is reduced). It is a Python implementation, not a bound: gloo, in C++, ran above it
  (it read 1.13-1.21x ftmesh while ftmesh was 0.83-0.89x gloo). ``--ceiling wire`` is that
  ring without the reduction.

Noise: the machine is shared, so repetitions are many (``--iters``, by default about 1 GiB of
traffic per implementation and cell, 6 to 40 repetitions) and the implementations take turns
within every repetition, so a burst of load hits all of them alike; the ratios are taken
between medians measured in the same run.

Encryption: ``--encrypt`` adds ``ftmesh_enc``, a second ftmesh data plane in every process with
a random mesh secret and ``MeshAuth(encrypt=True)`` (AES-256-GCM on every frame), to the
implementations that take turns, and reports per cell ``encrypted_vs_plain`` = busbw of
``ftmesh_enc`` / busbw of ``ftmesh`` (1.0: encryption is free; 0.5: it halves bandwidth).

Compression: ``--compression int8`` adds ``ftmesh_int8``, the same data plane with
``compression=Int8Compression()`` (blockwise int8 with error feedback,
``ftmesh.collective.compressed``), and reports per cell ``vs_uncompressed`` = busbw of
``ftmesh_int8`` / busbw of ``ftmesh``. Its algbw counts the float32 bytes reduced, so the ratio
is the speed-up a caller sees. On loopback the codec's CPU time dominates; on slow links it
is the bytes.

Chunk size: ``--alt-chunk 1M`` adds ``ftmesh_alt``, a second data plane in every process
whose ``chunk_bytes`` is that size, to the turns, and reports per cell ``alt_vs_ftmesh`` =
its busbw / plain ``ftmesh``'s (``--chunk``): two chunk sizes compared in one run, where a
loaded host makes ratios between runs meaningless.

torch process group: ``--torch-pg`` adds ``gloo_pg``, torch's gloo process group as ftmesh
builds it for a view epoch (rendezvous on the ring store, every call through the epoch
manager's deadline and abort polling: the path NCCL takes on a GPU), and reports per cell
``pg_vs_gloo`` = busbw of ``gloo_pg`` / busbw of gloo called directly: the overhead of the
session's torch-process-group path.

Slow links: ``--lab`` runs the N processes on N hosts of a virtual LAN
(``ftmesh.lab.VirtualLan``, root), each link limited with ``--link-rate`` (tc tbf, e.g.
``100mbit``); gloo, the store, the data planes and the raw ring all use the lab addresses. The
repetitions default to 6 there (16 MB at 100 Mbit/s takes seconds).

Two sites: ``--lab --sites 2x2 --wan-rate 20mbit --wan-delay 50`` puts the hosts on two
bridges joined by one shaped WAN link (``VirtualLan(sites=...)``, ``ftmesh.lab.wan``: rate and
one-way delay) and adds two implementations to the turns, on the same data plane as
``ftmesh``: ``ftmesh_sites``, the flat ring in the ring plan's order (each site's members
adjacent: the WAN is crossed once per direction, by ``2(N-1)/N`` of the buffer), and
``ftmesh_hier``, the planned hierarchical allreduce (``ftmesh.collective.topology``, the
sites given as labels: reduce-scatter in the site, allreduce across, allgather in the site:
the buffer once per direction). The data planes' node ids are chosen so that plain ``ftmesh``
-- the ring in node-id order, as before ring plans, where ids fall as they may -- alternates
between the sites and crosses the WAN at every hop. Per cell ``hier_vs_flat`` and
``hier_vs_sites`` are the hierarchical busbw over each flat one. With ``--compression int8``
too, ``ftmesh_int8_sites`` (int8 on the site-ordered flat ring) and ``ftmesh_int8_hier`` (the
hierarchical allreduce, int8 across the sites only) take turns as well: ``int8_hier_vs_sites``
and ``int8_hier_vs_hier`` (over the float32 hierarchical one).

Large buffers: ``--impls ftmesh --check --sizes 2.5G --procs 2`` allreduces a buffer larger than
2**31 bytes and checks every element. Each process holds one buffer per implementation; a cell
that would not fit in 80% of MemAvailable is skipped with a message.

Everything runs on 127.0.0.1, or inside the lab's namespaces with ``--lab``.
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from ..collective import CollectiveConfig, Peer, RingView, SyncDataPlane
from ..collective.schedule import chunks_per_segment, segment_bounds
from ..collective.topology import MemberLinks, RingPlan, plan_ring
from ..compression import Int8Compression
from ..security import MeshAuth
from .plots import plot_allreduce, plot_path_error

IMPLS = ("ftmesh", "gloo", "ceiling")
ENC = "ftmesh_enc"
"""The encrypted ftmesh data plane (``--encrypt``)."""
INT8 = "ftmesh_int8"
"""ftmesh with ``compression=Int8Compression()`` (``--compression int8``)."""
PG = "gloo_pg"
"""torch's gloo process group built by ftmesh per view epoch on the ring store, behind the
epoch manager (``ftmesh.collective.torch_pg``, the GPU path's CI stand-in; ``--torch-pg``)."""
SITES = "ftmesh_sites"
"""With ``--sites``: the flat ring in the ring plan's order (sites adjacent)."""
ALT = "ftmesh_alt"
"""With ``--alt-chunk``: ftmesh on a second data plane whose ``chunk_bytes`` differs."""
HIER = "ftmesh_hier"
"""With ``--sites``: the planned hierarchical allreduce."""
INT8_SITES = "ftmesh_int8_sites"
"""With ``--sites`` and ``--compression int8``: the int8 allreduce on the flat site-ordered ring."""
INT8_HIER = "ftmesh_int8_hier"
"""With ``--sites`` and ``--compression int8``: the planned hierarchical allreduce, int8 across
the sites only (``ftmesh.collective.hierarchical_int8``)."""
COMPRESSED = (INT8, INT8_SITES, INT8_HIER)
LAB_ITERS = 6
"""Default repetitions with ``--lab``: a 16 MB allreduce at 100 Mbit/s takes about 2 s."""


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    num = text[:-1] if text[-1:] in "KMG" else text
    return int(float(num) * mult)


def _fmt_size(n: int) -> str:
    for unit, div in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div}{unit}"
    return str(n)


# -- raw TCP ring (the ceiling) ------------------------------------------------------------
class RawRing:
    """Raw ring probes over blocking sockets (a sender thread and this thread receiving).

    ``stream`` (the ceiling): every member streams the bytes the ring allreduce sends,
    ``2(N-1)/N`` of the buffer, to its right neighbour, one ``sendall`` per ring step, while
    it receives as many from its left into a sink, ``MSG_WAITALL`` per ring step; no
    reduction, no chunk waits for a receive, no framing. Any ring allreduce moves these bytes
    over the same loopback TCP connections and does more besides (reduce, wait for the chunk
    it forwards), so this is an upper bound for ftmesh and gloo alike.

    ``reduce``: the chunked ring reduce-scatter + allgather written plainly (the send of a
    chunk waits for the receive that produced it, ``np.add`` in place): a correct allreduce in
    plain Python, not a bound (a C++ ring, gloo, can beat it). ``wire``: the same without the
    reduction."""

    def __init__(
        self, rank: int, n: int, store: Any, chunk_bytes: int, mode: str, host: str, sockbuf: int
    ) -> None:
        self.rank, self.n, self.chunk_bytes, self.mode = rank, n, chunk_bytes, mode
        self.reduce = mode == "reduce"
        self.sink: np.ndarray[Any, Any] | None = None
        lst = socket.socket()
        lst.bind((host, 0))
        lst.listen(4)
        store.set(f"raw/{rank}", f"{host}:{lst.getsockname()[1]}")
        right_host, right_port = store.get(f"raw/{(rank + 1) % n}").decode().rsplit(":", 1)
        self.tx = socket.create_connection((right_host, int(right_port)), timeout=60)
        self.rx, _ = lst.accept()
        lst.close()
        for s in (self.tx, self.rx):
            s.settimeout(120)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if sockbuf:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sockbuf)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, sockbuf)

    def allreduce(self, a: np.ndarray[Any, Any]) -> None:
        if self.mode == "stream":
            self._stream(a)
        else:
            self._ring(a)

    def _stream(self, a: np.ndarray[Any, Any]) -> None:
        """The ceiling: the ring's bytes, both ways at once, nothing else (see the class)."""
        n, r, isz = self.n, self.rank, a.itemsize
        bounds = segment_bounds(a.size, n)
        if self.sink is None or self.sink.nbytes < a.nbytes:
            self.sink = np.zeros(a.size, a.dtype)  # reused: its pages are faulted in once
        raw, sink = a.view(np.uint8).data, self.sink.view(np.uint8).data
        steps = [((r - t - 1) % n, (r - t - 2) % n) for t in range(2 * n - 2)]
        failed: list[BaseException] = []

        def sender() -> None:
            try:
                for ss, _ in steps:
                    self.tx.sendall(raw[bounds[ss] * isz : bounds[ss + 1] * isz])
            except BaseException as exc:  # reported by the caller's thread
                failed.append(exc)

        th = threading.Thread(target=sender)
        th.start()
        for _, rs in steps:
            view = sink[bounds[rs] * isz : bounds[rs + 1] * isz]
            got, nb = 0, len(view)
            while got < nb:
                k = self.rx.recv_into(view[got:], nb - got, socket.MSG_WAITALL)
                if not k:
                    raise ConnectionError("raw ring: peer closed")
                got += k
        th.join(120)
        if failed:
            raise ConnectionError(f"raw ring: send failed: {failed[0]!r}")

    def _ring(self, a: np.ndarray[Any, Any]) -> None:
        n, r = self.n, self.rank
        bounds = segment_bounds(a.size, n)
        widest = max(bounds[i + 1] - bounds[i] for i in range(n))
        c = chunks_per_segment(widest, a.itemsize, self.chunk_bytes)
        sends, recvs = [], []
        for t in range(2 * n - 2):
            ss, rs = (r - t - 1) % n, (r - t - 2) % n
            for k in range(c):
                s0, s1 = bounds[ss], bounds[ss + 1]
                r0, r1 = bounds[rs], bounds[rs + 1]
                sends.append((s0 + (s1 - s0) * k // c, s0 + (s1 - s0) * (k + 1) // c))
                recvs.append((r0 + (r1 - r0) * k // c, r0 + (r1 - r0) * (k + 1) // c, t < n - 1))
        done = [0]
        cv = threading.Condition()
        raw = a.view(np.uint8).data
        isz = a.itemsize

        def sender() -> None:
            for j, (s0, s1) in enumerate(sends):
                if j >= c:
                    with cv:
                        for _ in range(1200):  # bounded: 0.1 s waits, 120 s in all
                            if done[0] >= j - c + 1:
                                break
                            cv.wait(0.1)
                self.tx.sendall(raw[s0 * isz : s1 * isz])

        th = threading.Thread(target=sender)
        th.start()
        scratch = np.empty(max(1, self.chunk_bytes // isz + 1), a.dtype)
        sraw = scratch.view(np.uint8).data
        for i, (r0, r1, red) in enumerate(recvs):
            nb = (r1 - r0) * isz
            view = sraw[:nb] if red and self.reduce else raw[r0 * isz : r1 * isz]
            got = 0
            while got < nb:
                k = self.rx.recv_into(view[got:], nb - got)
                if not k:
                    raise ConnectionError("raw ring: peer closed")
                got += k
            if red and self.reduce:
                np.add(a[r0:r1], scratch[: r1 - r0], out=a[r0:r1])
            with cv:
                done[0] = i + 1
                cv.notify()
        th.join(120)

    def close(self) -> None:
        self.tx.close()
        self.rx.close()


# -- worker --------------------------------------------------------------------------------
def _worker(rank: int, nprocs: int, port: int, cfg: dict[str, Any], out: Any) -> None:
    """One rank: ``cfg["hosts"]`` (lab addresses; loopback when absent) says where rank 0's
    store and this rank's sockets live; rank 0 puts the results into ``out``."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    hosts = cfg.get("hosts") or ["127.0.0.1"] * nprocs
    me = hosts[rank]
    tcp_store: Any = getattr(dist, "TCPStore")  # noqa: B009 - not re-exported for mypy
    store = tcp_store(hosts[0], port, nprocs, rank == 0, timeout=_td(120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=nprocs)
    config = CollectiveConfig(
        chunk_bytes=cfg["chunk"], io_timeout=120.0, socket_buffer_bytes=cfg["sockbuf"]
    )
    impls: tuple[str, ...] = tuple(cfg["impls"])
    sites: list[int] = cfg.get("sites") or []
    dp = SyncDataPlane.start(_node_id(rank, sites), host=me, config=config)
    view = _publish_view(store, "ftmesh", dp, rank, nprocs, sites)
    planned = _planned_views(view, rank, sites) if sites else {}
    dp_enc = enc_view = None
    if ENC in impls:
        auth = MeshAuth.from_secrets([bytes.fromhex(cfg["secret"])], encrypt=True)
        dp_enc = SyncDataPlane.start(f"bench-{rank:03d}", host=me, auth=auth, config=config)
        enc_view = _publish_view(store, ENC, dp_enc, rank, nprocs)
    pg_mgr = _pg_manager(dp) if PG in impls else None
    dp_alt = alt_view = None
    if ALT in impls:  # the same data plane with another chunk size (--alt-chunk)
        alt_config = replace(config, chunk_bytes=cfg["alt_chunk"])
        dp_alt = SyncDataPlane.start(f"bench-{rank:03d}", host=me, config=alt_config)
        alt_view = _publish_view(store, ALT, dp_alt, rank, nprocs)
    raw = RawRing(
        rank, nprocs, store, cfg["chunk"], cfg["ceiling"], me, cfg.get("ceiling_sockbuf", 0)
    )
    results = []
    try:
        for size in cfg["sizes"]:
            elems = size // 4
            if not _fits(size * len(impls) * nprocs):
                results.append({"bytes": size, "skipped": "not enough memory"})
                continue
            bufs = {k: np.zeros(elems, np.float32) for k in impls}
            fns: dict[str, Callable[[], object]] = {}
            session = dp.session(view)
            if "ftmesh" in bufs:
                fns["ftmesh"] = functools.partial(session.allreduce, bufs["ftmesh"])
            for impl, v in planned.items():
                fns[impl] = functools.partial(dp.session(v).allreduce, bufs[impl])
            for impl, plain in ((INT8_SITES, SITES), (INT8_HIER, HIER)):
                if impl in bufs:
                    v = planned[plain]
                    c = Int8Compression(cfg["block_size"])
                    fns[impl] = functools.partial(dp.session(v).allreduce, bufs[impl], "sum", c)
            if dp_enc is not None and enc_view is not None:
                fns[ENC] = functools.partial(dp_enc.session(enc_view).allreduce, bufs[ENC])
            if INT8 in bufs:  # one residual per buffer, carried from repetition to repetition
                comp = Int8Compression(cfg["block_size"])
                fns[INT8] = functools.partial(session.allreduce, bufs[INT8], "sum", comp)
            if "gloo" in bufs:
                fns["gloo"] = functools.partial(dist.all_reduce, torch.from_numpy(bufs["gloo"]))
            if pg_mgr is not None:
                fns[PG] = functools.partial(pg_mgr.allreduce, view, torch.from_numpy(bufs[PG]))
            if dp_alt is not None and alt_view is not None:
                fns[ALT] = functools.partial(dp_alt.session(alt_view).allreduce, bufs[ALT])
            if "ceiling" in bufs:
                fns["ceiling"] = functools.partial(raw.allreduce, bufs["ceiling"])
            check = None
            if cfg["check"]:
                # The stream ceiling reduces nothing: there is no result to check.
                skip = {"ceiling"} if cfg["ceiling"] == "stream" else set()
                check = _check(rank, nprocs, bufs, fns, skip)
            iters = cfg["iters"] or max(6, min(40, (1 << 30) // max(size, 1)))
            times: dict[str, list[float]] = {k: [] for k in impls}
            for rep in range(cfg["warmup"] + iters):
                k = rep % len(impls)
                order = impls[k:] + impls[:k]
                mine = []
                for impl in order:
                    dist.barrier()
                    t0 = time.perf_counter()
                    fns[impl]()
                    mine.append(time.perf_counter() - t0)
                slowest = torch.tensor(mine, dtype=torch.float64)
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                if rep >= cfg["warmup"]:
                    for impl, dt in zip(order, slowest.tolist(), strict=True):
                        times[impl].append(dt)
            results.append({"bytes": size, "times": times, "check": check})
            del bufs, fns
    finally:
        if pg_mgr is not None:
            pg_mgr.close()
        dp.close()
        if dp_enc is not None:
            dp_enc.close()
        if dp_alt is not None:
            dp_alt.close()
        raw.close()
        dist.destroy_process_group()
    if rank == 0:
        out.put(results)


def _pg_manager(dp: SyncDataPlane) -> Any:
    """An epoch manager building torch's gloo process group on the ring store."""
    from ..collective.epochs import EpochConfig, EpochManager
    from ..collective.torch_pg import SessionControl, TorchPGFactory

    factory = TorchPGFactory(dp.session, "gloo", init_timeout=100.0, op_timeout=120.0)
    config = EpochConfig(init_timeout=110.0, op_timeout=120.0)
    return EpochManager(dp.node_id, factory, SessionControl(dp.session), config=config)


def _node_id(rank: int, sites: list[int]) -> str:
    """Rank ``rank``'s data-plane id. On two sites (ranks ``0..sites[0]-1`` on the first),
    ids that sort alternately from the sites, so that the node-id ring crosses the WAN at
    every hop while both sites have members left (ids fall as they may; this is the worst
    case, and a common one)."""
    if not sites:
        return f"bench-{rank:03d}"
    site, k = (0, rank) if rank < sites[0] else (1, rank - sites[0])
    return f"bench-{2 * k + site:03d}"


def _site_of(node: str, sites: list[int]) -> int:
    rank = next(r for r in range(sum(sites)) if _node_id(r, sites) == node)
    return 0 if rank < sites[0] else 1


def _planned_views(view: RingView, rank: int, sites: list[int]) -> dict[str, RingView]:
    """The two planned views of ``--sites`` over ``view``'s members: the flat ring in the
    plan's order, and the hierarchical plan (sites given as labels ``a``, ``b``)."""
    links = [MemberLinks.of(n, "ab"[_site_of(n, sites)]) for n in view.node_ids]
    hier = plan_ring(links)
    if not hier.hierarchical:
        raise SystemExit(f"ftmesh bench allreduce: sites {sites} plan no hierarchy: {hier}")
    flat = RingPlan(hier.sites, False, hier.source, "bench: the flat ring in site order")
    return {SITES: RingView.of(view.members, flat), HIER: RingView.of(view.members, hier)}


def _publish_view(
    store: Any, key: str, dp: SyncDataPlane, rank: int, nprocs: int, sites: list[int] | None = None
) -> RingView:
    """Publish our data-plane address under ``key`` and build the view from everyone's."""
    store.set(f"{key}/{rank}", f"{dp.address[0]}:{dp.address[1]}")
    peers = []
    for i in range(nprocs):
        host, p = store.get(f"{key}/{i}").decode().rsplit(":", 1)
        peers.append(Peer(_node_id(i, sites or []), host, int(p)))
    return RingView.of(peers)


def _loadavg() -> float:
    """The 1-minute load average (0.0 where there is none)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return 0.0


def _fits(total_bytes: int) -> bool:
    """Whether ``total_bytes`` (all processes' buffers) fit in 80% of MemAvailable."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return total_bytes <= int(line.split()[1]) * 1024 * 0.8
    except OSError:
        pass
    return True


def _check(
    rank: int,
    nprocs: int,
    bufs: dict[str, Any],
    fns: dict[str, Callable[[], object]],
    skip: set[str],
) -> dict[str, bool]:
    """One allreduce per implementation (but those in ``skip``) of ``rank + 1`` everywhere,
    then compare every element with the exact sum (integers below 2**24 are exact in
    float32)."""
    want = np.float32(nprocs * (nprocs + 1) // 2)
    ok = {}
    for impl, buf in bufs.items():
        if impl in skip:
            continue
        buf.fill(rank + 1)
        fns[impl]()
        if impl in COMPRESSED:  # within one quantization step of the sum
            ok[impl] = bool(np.all(np.abs(buf - want) <= want / 127))
        else:
            ok[impl] = bool(np.all(buf == want))
        buf.fill(0)
    return ok


def _td(seconds: float) -> Any:
    import datetime

    return datetime.timedelta(seconds=seconds)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_procs(nprocs: int, cfg: dict[str, Any], timeout: float) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, nprocs, port, cfg, q)) for r in range(nprocs)]
    for p in procs:
        p.start()
    try:
        res: list[dict[str, Any]] = q.get(timeout=timeout)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join(5)
    return res


def _stats(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def summarise(nprocs: int, raw: dict[str, Any]) -> dict[str, Any]:
    size = raw["bytes"]
    factor = 2 * (nprocs - 1) / nprocs
    cell: dict[str, Any] = {"procs": nprocs, "bytes": size, "algbw": {}, "busbw": {}, "time": {}}
    if "skipped" in raw:
        cell["skipped"] = raw["skipped"]
        return cell
    cell["check"] = raw.get("check")
    for impl in raw["times"]:
        t = _stats(raw["times"][impl])
        cell["time"][impl] = t
        # fastest time gives the max bandwidth and vice versa
        alg = {"median": size / t["median"], "min": size / t["max"], "max": size / t["min"]}
        cell["algbw"][impl] = alg
        cell["busbw"][impl] = {k: v * factor for k, v in alg.items()}
    med = {k: cell["busbw"][k]["median"] for k in raw["times"]}
    if "gloo" in med and "ceiling" in med:
        cell["gloo_vs_ceiling"] = med["gloo"] / med["ceiling"]
    if "ftmesh" in med:
        for other in ("gloo", "ceiling"):
            if other in med:
                cell[f"vs_{other}"] = med["ftmesh"] / med[other]
        if ENC in med:
            cell["encrypted_vs_plain"] = med[ENC] / med["ftmesh"]
        if INT8 in med:
            cell["vs_uncompressed"] = med[INT8] / med["ftmesh"]
        if ALT in med:
            cell["alt_vs_ftmesh"] = med[ALT] / med["ftmesh"]
    if PG in med and "gloo" in med:
        cell["pg_vs_gloo"] = med[PG] / med["gloo"]
    if HIER in med:
        cell["hier_vs_flat"] = med[HIER] / med["ftmesh"]
        cell["hier_vs_sites"] = med[HIER] / med[SITES]
    if INT8_HIER in med:
        cell["int8_hier_vs_sites"] = med[INT8_HIER] / med[INT8_SITES]
        cell["int8_hier_vs_hier"] = med[INT8_HIER] / med[HIER]
    return cell


def _print_table(cells: list[dict[str, Any]]) -> None:
    top = max((b["median"] for c in cells for b in c.get("busbw", {}).values()), default=0.0)
    gb, unit = (1e9, "GB/s") if top >= 1e8 else (1e6, "MB/s")  # (slow links: MB/s)
    extra = tuple(
        x
        for x in (ENC, INT8, PG, SITES, HIER, INT8_SITES, INT8_HIER, ALT)
        if any(x in c["busbw"] for c in cells)
    )
    impls = IMPLS + extra
    ratios = {"vs_gloo": "ftm/gloo", "vs_ceiling": "ftm/ceil", "gloo_vs_ceiling": "gloo/ceil"}
    if ENC in extra:
        ratios["encrypted_vs_plain"] = "enc/plain"
    if INT8 in extra:
        ratios["vs_uncompressed"] = "int8/f32"
    if PG in extra:
        ratios["pg_vs_gloo"] = "pg/gloo"
    if ALT in extra:
        ratios["alt_vs_ftmesh"] = "alt/ftm"
    if HIER in extra:
        ratios["hier_vs_flat"] = "hier/flat"
        ratios["hier_vs_sites"] = "hier/site"
    if INT8_HIER in extra:
        ratios["int8_hier_vs_sites"] = "i8h/i8s"
        ratios["int8_hier_vs_hier"] = "i8h/hier"
    width = 26 * len(impls)
    heads = " ".join(f"{h:>9}" for h in ratios.values())
    print(f"{'N':>2} {'size':>6} | {f'busbw {unit} (median [min-max])':^{width}} | {heads}")
    names = "".join(f"{i:^26}" for i in impls)
    print(f"{'':>2} {'':>6} | {names} |")
    for c in cells:
        head = f"{c['procs']:>2} {_fmt_size(c['bytes']):>6} | "
        if "skipped" in c:
            print(head + f"skipped: {c['skipped']}")
            continue
        cols = ""
        for impl in impls:
            b = c["busbw"].get(impl)
            if b is None:
                cols += f"{'-':^26}"
            else:
                cols += f"{b['median'] / gb:7.3f} [{b['min'] / gb:6.3f}-{b['max'] / gb:6.3f}]  "
        nums = " ".join(f"{c[k]:9.2f}" if k in c else f"{'-':>9}" for k in ratios)
        check = ""
        if c.get("check"):
            check = "  check " + ",".join(
                f"{k}={'ok' if v else 'FAIL'}" for k, v in c["check"].items()
            )
        print(f"{head}{cols:<{width}} | {nums}{check}")
    print("algbw = bytes/time; busbw = algbw*2(N-1)/N; time = slowest rank, per repetition.")
    if ENC in extra:
        print("enc/plain = busbw of ftmesh with encryption (AES-256-GCM) / without.")
    if ALT in extra:
        print("alt/ftm = busbw of ftmesh with --alt-chunk / with --chunk.")
    if INT8 in extra:
        print("int8/f32 = busbw of ftmesh with int8 compression / without (float32 bytes).")
    if PG in extra:
        print("pg/gloo = busbw of gloo built and driven by ftmesh per view epoch / gloo direct.")
    if HIER in extra:
        print(
            "hier/flat, hier/site = busbw of the hierarchical allreduce / the flat ring in "
            "node-id order (alternating sites) / the flat ring with each site's hosts adjacent."
        )
    if INT8_HIER in extra:
        print(
            "i8h/i8s, i8h/hier = busbw of the hierarchical int8 allreduce (int8 across the "
            "sites only) / the int8 allreduce on the site-ordered flat ring / the float32 "
            "hierarchical allreduce."
        )


# -- lab mode ------------------------------------------------------------------------------
class _FileOut:
    """Where a lab worker (another process, in a namespace) leaves rank 0's results."""

    def __init__(self, path: str) -> None:
        self.path = path

    def put(self, results: list[dict[str, Any]]) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(results, f)
        os.replace(tmp, self.path)


LAB_STORE_PORT = 29500
"""Port of rank 0's store on its lab host (a fresh namespace: nothing else listens there)."""


def run_lab_procs(
    nprocs: int, cfg: dict[str, Any], timeout: float, rate: str | None, wan: Any = None
) -> list[dict[str, Any]]:
    """``run_procs`` on N hosts of a fresh virtual LAN whose links are limited to ``rate``;
    with ``cfg["sites"]``, on two sites joined by the WAN link ``wan`` (a ``WanLink``)."""
    import tempfile

    from ..lab.netns import VirtualLan

    sites = cfg.get("sites")
    lab = VirtualLan(sites=sites, wan=wan) if sites else VirtualLan(hosts=nprocs)
    with lab as lan, tempfile.TemporaryDirectory() as tmp:
        for i in range(nprocs):
            if rate:
                lan.set_rate(i, rate)
        cfg = {**cfg, "hosts": [lan.host_ip(i) for i in range(nprocs)]}
        cfg_path, out_path = os.path.join(tmp, "cfg.json"), os.path.join(tmp, "out.json")
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)
        env = {**os.environ, "GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1"}
        argv = [sys.executable, "-m", "ftmesh.bench.allreduce", "--lab-worker"]
        procs = [
            lan.popen(i, [*argv, str(i), str(nprocs), cfg_path, out_path], env=env)
            for i in range(nprocs)
        ]
        deadline = time.monotonic() + timeout
        for p in procs:
            try:
                p.wait(max(deadline - time.monotonic(), 1.0))
            except Exception:
                for q in procs:
                    q.kill()
                raise
        if any(p.returncode for p in procs):
            codes = [p.returncode for p in procs]
            raise SystemExit(f"ftmesh bench allreduce --lab: a worker failed (exit codes {codes})")
        with open(out_path) as f:
            res: list[dict[str, Any]] = json.load(f)
        return res


def _lab_worker(argv: list[str]) -> int:
    rank, nprocs, cfg_path, out_path = int(argv[0]), int(argv[1]), argv[2], argv[3]
    with open(cfg_path) as f:
        cfg = json.load(f)
    _worker(rank, nprocs, LAB_STORE_PORT, cfg, _FileOut(out_path))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--lab-worker"]:
        return _lab_worker(argv[1:])
    ap = argparse.ArgumentParser(prog="ftmesh bench allreduce", description=__doc__.split("\n")[0])
    ap.add_argument("--procs", default="2,3,4", help="comma-separated process counts")
    ap.add_argument("--sizes", default="1M,16M,64M,256M", help="buffer sizes in bytes (K/M/G)")
    ap.add_argument("--iters", type=int, default=0, help="timed repetitions (0: by size)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--chunk", default="4M", help="ftmesh/ceiling pipeline chunk size (largest)")
    ap.add_argument(
        "--alt-chunk",
        default=None,
        help=f"also run ftmesh with this chunk size ({ALT}); reports alt_vs_ftmesh",
    )
    ap.add_argument(
        "--ceiling",
        choices=("stream", "reduce", "wire"),
        default="stream",
        help="stream: the ring's bytes both ways at once (an upper bound); reduce/wire: a "
        "plain Python chunked ring with/without the reduction (not a bound)",
    )
    ap.add_argument(
        "--impls", default=",".join(IMPLS), help=f"comma-separated subset of {','.join(IMPLS)}"
    )
    ap.add_argument(
        "--sockbuf", default="4M", help="ftmesh SO_SNDBUF/SO_RCVBUF (0: kernel autotuning)"
    )
    ap.add_argument(
        "--ceiling-sockbuf",
        default="0",
        help="the ceiling's SO_SNDBUF/SO_RCVBUF (0: kernel autotuning, as gloo)",
    )
    ap.add_argument("--check", action="store_true", help="verify one result per cell first")
    ap.add_argument(
        "--encrypt",
        action="store_true",
        help=f"also run ftmesh with encryption ({ENC}) and report encrypted/plain busbw",
    )
    ap.add_argument(
        "--compression",
        choices=("none", "int8"),
        default="none",
        help=f"int8: also run ftmesh with int8 compression ({INT8}); reports vs_uncompressed",
    )
    ap.add_argument(
        "--torch-pg",
        action="store_true",
        help=f"also run torch's gloo built per view epoch on the ring store ({PG}); "
        "reports pg_vs_gloo",
    )
    ap.add_argument("--block-size", type=int, default=256, help="int8 elements per scale")
    ap.add_argument(
        "--lab",
        action="store_true",
        help="one process per host of a virtual LAN (network namespaces; needs root)",
    )
    ap.add_argument("--link-rate", default=None, help="with --lab: tc rate of every link")
    ap.add_argument(
        "--sites",
        default=None,
        metavar="AxB",
        help="with --lab: two sites of A and B hosts joined by one WAN link (--procs is A+B); "
        f"adds {SITES} and {HIER}",
    )
    ap.add_argument("--wan-rate", default="20mbit", help="with --sites: the WAN link's rate")
    ap.add_argument(
        "--wan-delay", type=float, default=50.0, help="with --sites: one-way delay in ms"
    )
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per process count")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--plot", metavar="FILE.png", help="also draw busbw against size (matplotlib)")
    args = ap.parse_args(argv)
    if args.link_rate and not args.lab:
        ap.error("--link-rate needs --lab")
    sites: list[int] = []
    wan = None
    if args.sites:
        if not args.lab:
            ap.error("--sites needs --lab")
        try:
            sites = [int(x) for x in args.sites.lower().split("x")]
        except ValueError:
            sites = []
        if len(sites) != 2 or min(sites) < 1 or max(sites) < 2:
            ap.error(f"--sites {args.sites}: two sites, one of 2 or more hosts, e.g. 2x2 or 3x2")
        from ..lab.wan import WanLink

        wan = WanLink(rate=args.wan_rate, delay_ms=args.wan_delay)
        args.procs = str(sum(sites))
    if problem := plot_path_error(args.plot):  # before a run that can take minutes
        print(f"{ap.prog}: error: {problem}", file=sys.stderr)
        return 2
    cfg = {
        "sizes": [parse_size(s) for s in args.sizes.split(",") if s.strip()],
        "iters": args.iters or (LAB_ITERS if args.lab else 0),
        "warmup": args.warmup,
        "chunk": parse_size(args.chunk),
        "ceiling": args.ceiling,
        "impls": [i for i in IMPLS if i in args.impls.split(",")],
        "check": args.check,
        "sockbuf": parse_size(args.sockbuf),
        "ceiling_sockbuf": parse_size(args.ceiling_sockbuf),
        "alt_chunk": parse_size(args.alt_chunk) if args.alt_chunk else 0,
        "secret": os.urandom(32).hex(),
        "block_size": args.block_size,
        "sites": sites,
    }
    if not cfg["impls"]:
        ap.error(f"--impls: choose from {','.join(IMPLS)}")
    if args.encrypt:
        # ftmesh_enc takes turns right after plain ftmesh, which is always measured with it.
        cfg["impls"] = ["ftmesh", ENC] + [i for i in cfg["impls"] if i != "ftmesh"]
    if args.compression == "int8":  # likewise ftmesh_int8, against plain ftmesh
        cfg["impls"] = ["ftmesh", INT8] + [i for i in cfg["impls"] if i != "ftmesh"]
    if args.alt_chunk:  # ftmesh_alt takes turns right after plain ftmesh
        cfg["impls"] = ["ftmesh", ALT] + [i for i in cfg["impls"] if i != "ftmesh"]
    if args.torch_pg:  # gloo_pg takes turns right after gloo, which is always measured with it
        cfg["impls"] = [i for i in cfg["impls"] if i != "gloo"] + ["gloo", PG]
    if sites:  # the planned rings take turns with plain ftmesh, which is always measured
        planned = [SITES, HIER] + ([INT8_SITES, INT8_HIER] if args.compression == "int8" else [])
        cfg["impls"] = ["ftmesh", *planned] + [i for i in cfg["impls"] if i != "ftmesh"]
    load_before = _loadavg()
    cells = []
    for nprocs in (int(p) for p in args.procs.split(",") if p.strip()):
        if nprocs < 2:
            print("skipping --procs 1: nothing to compare", file=sys.stderr)
            continue
        if args.lab:
            raws = run_lab_procs(nprocs, cfg, args.timeout, args.link_rate, wan)
        else:
            raws = run_procs(nprocs, cfg, args.timeout)
        for raw in raws:
            cells.append(summarise(nprocs, raw))
            if not args.json:
                print(f"done N={nprocs} size={_fmt_size(raw['bytes'])}", file=sys.stderr)
    if args.json:
        out = {
            "benchmark": "allreduce",
            "dtype": "float32",
            "encrypt": args.encrypt,
            "compression": args.compression,
            "torch_pg": args.torch_pg,
            "lab": args.lab,
            "link_rate": args.link_rate,
            "sites": args.sites,
            "wan": None if wan is None else wan.to_json(),
            "loadavg": [load_before, _loadavg()],
            "cpus": os.cpu_count(),
        }
        print(json.dumps({**out, "cells": cells}))
    else:
        _print_table(cells)
    over = [c for c in cells if max(c.get("vs_ceiling", 0), c.get("gloo_vs_ceiling", 0)) > 1.05]
    if over:
        print(
            f"note: {len(over)} cell(s) ran above the ceiling (load {load_before:.1f} -> "
            f"{_loadavg():.1f} on {os.cpu_count()} CPUs): on a contended host the scheduler, "
            "not the bytes, sets the pace, and ratios to the ceiling mean little",
            file=sys.stderr,
        )
    if args.plot:
        plot_allreduce(cells, args.plot)
        print(f"plot: {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
