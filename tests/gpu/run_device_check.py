"""The device check of the GPU data plane: one script, one table (issue #14).

On a one-GPU machine (``tests/gpu/run_device_check.sh`` installs the carried wheels and runs
this) it checks, in under 8 minutes:

* every ``native/`` kernel against its NumPy reference(s), bit for bit, on random data;
* NCCL at N=1 through the one binding, torch's ``ProcessGroupNCCL`` per view epoch on the
  ring store (``torch_pg.TorchPGFactory(sessions, "nccl")``), for each dtype, and the epoch
  lifecycle at N=1 (set up, allreduce, abort of a collective in flight, rebuild, the abort of
  two process groups), with latencies;
* ``NCCL_MULTI_RANK_GPU_ENABLE=1`` with ``--world`` processes on the one GPU, each a real
  mesh member whose sessions' GPU path is ``SyncMesh.enable_gpu``'s default (that same
  binding): ring correctness, busbw of ftmesh's NCCL path vs ``torch.distributed`` NCCL
  in the same processes, the staged path's busbw, and ``kill -9`` of one process
  mid-allreduce (survivors abort and run their next collective on the new view), timed;
* a CUDA model trained elastically through ``ElasticTrainer`` by the survivors;

and says in the table what one GPU cannot cover.

``--dry-run`` runs the same plumbing on a CPU machine (CI): the NVRTC compile, the lifecycle
at N=1 on the TCP ring behind the same interfaces, and the multi-process phases with the TCP
ring standing in for NCCL and gloo for torch's NCCL. Rows that need a GPU say ``n/a``.

Exit status: 0 if no row failed, 1 otherwise. ``--json PATH`` also writes the rows.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from ftmesh.collective import Peer, RingView  # noqa: E402
from ftmesh.collective.epochs import EpochConfig, EpochManager, SoloControl  # noqa: E402
from ftmesh.native import KERNEL_ARCHES, KERNEL_OPTIONS, KERNEL_SOURCES, nvrtc, read_source  # noqa: E402  # noqa: E402
from ftmesh.native import reference as R  # noqa: E402

MIB = 1 << 20
T0 = time.monotonic()


@dataclass
class Row:
    check: str
    status: str  # ok | FAIL | n/a
    value: str = ""
    note: str = ""


class Table:
    def __init__(self) -> None:
        self.rows: list[Row] = []

    def add(self, check: str, status: str, value: str = "", note: str = "") -> None:
        self.rows.append(Row(check, status, value, note))
        print(
            f"  {time.monotonic() - T0:6.1f}s [{status}] {check}: {value} {note}",
            file=sys.stderr,
            flush=True,
        )

    def guard(self, check: str, fn: Callable[[], None]) -> None:
        """Run a section; an exception becomes a FAIL row instead of ending the check."""
        try:
            fn()
        except Exception as exc:
            self.add(check, "FAIL", "", f"{type(exc).__name__}: {exc}"[:300])

    def render(self) -> str:
        w = [max(len(getattr(r, f)) for r in self.rows) for f in ("check", "status", "value")]
        w = [max(x, 6) for x in w]
        lines = [f"{'check':<{w[0]}}  {'status':<{w[1]}}  {'value':<{w[2]}}  note"]
        lines.append("-" * (sum(w) + 12))
        for r in self.rows:
            lines.append(f"{r.check:<{w[0]}}  {r.status:<{w[1]}}  {r.value:<{w[2]}}  {r.note}")
        return "\n".join(lines)


def ok(cond: bool) -> str:
    return "ok" if cond else "FAIL"


# -- kernels ----------------------------------------------------------------------------------


def check_compile(t: Table) -> None:
    major, minor = nvrtc.version()
    for name in KERNEL_SOURCES:
        for arch in KERNEL_ARCHES:
            nvrtc.compile_source(read_source(name), name, arch, KERNEL_OPTIONS)
    t.add(
        "NVRTC compile of native/*.cu",
        "ok",
        f"{len(KERNEL_SOURCES)} files x {KERNEL_ARCHES}",
        f"NVRTC {major}.{minor}",
    )


def same_bits(a: np.ndarray, b: np.ndarray, nan_equal: bool = False) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    eq = a.view(np.uint8).reshape(a.size, -1) == b.view(np.uint8).reshape(b.size, -1)
    row = eq.all(axis=1)
    if nan_equal and a.dtype.kind == "f":
        row |= np.isnan(a) & np.isnan(b)
    return bool(row.all())


def their_codec() -> Any:
    try:
        from ftmesh.compression.int8 import Int8Codec  # the codec owner's reference (#15)
    except ImportError:
        return None
    return Int8Codec


def check_kernels(t: Table) -> None:
    import cupy as cp

    from ftmesh.native import kernels

    k = kernels()
    rng = np.random.default_rng(14)
    codec = their_codec()
    for bs, n in ((256, (1 << 22) + 13), (1, 4099), (7, 100_003), (4096, 1 << 20)):
        mags = 10.0 ** rng.integers(-30, 30, size=-(-n // bs)).repeat(bs)[:n]
        x = (rng.standard_normal(n) * mags).astype(np.float32)
        x[rng.integers(0, n, 5)] = np.array([np.inf, -np.inf, np.nan, 1e-45, -1e-44], np.float32)
        r0 = (rng.standard_normal(n) * mags * 1e-3).astype(np.float32)
        r_ref = r0.copy()
        s_ref, q_ref = R.int8_quantize(x, r_ref, bs)
        r_dev = cp.asarray(r0)
        s_dev, q_dev = k.int8_quantize(cp.asarray(x), r_dev, bs)
        s_got, q_got, r_got = cp.asnumpy(s_dev), cp.asnumpy(q_dev), cp.asnumpy(r_dev)
        good = same_bits(s_got, s_ref, True) and same_bits(q_got, q_ref) and same_bits(r_got, r_ref)
        s2, q2 = k.int8_quantize(cp.asarray(x), None, bs)  # no error feedback
        s2r, q2r = R.int8_quantize(x, None, bs)
        good = good and same_bits(cp.asnumpy(s2), s2r, True) and same_bits(cp.asnumpy(q2), q2r)
        acc0 = rng.standard_normal(n).astype(np.float32)
        acc_dev = k.int8_dequantize_accumulate(s_dev, q_dev, cp.asarray(acc0), bs)
        acc_ref = R.int8_dequantize_accumulate(s_ref, q_ref, acc0.copy(), bs)
        good = good and same_bits(cp.asnumpy(acc_dev), acc_ref, True)
        note = f"n={n}, 5 non-finite inputs"
        if codec is not None:
            c = codec(bs)
            v = (x + r0).astype(np.float32)
            out, res = np.empty(c.encoded_bytes(n), np.uint8), np.empty(n, np.float32)
            c.encode_into(v, out, res)
            nb = c.blocks(n)
            good = good and same_bits(s_got, out[: 4 * nb].view("<f4").astype(np.float32), True)
            good = good and same_bits(q_got, out[4 * nb :].view(np.int8)) and same_bits(r_got, res)
            note += "; also = ftmesh.compression.int8"
        else:
            note += "; ftmesh.compression.int8 not on this branch"
        t.add(f"int8 quantize+EF / dequant-acc, block {bs}", ok(good), "bitwise", note)
    # throughput, for the record (memory bound: 4 B in, ~1 B out)
    n = 1 << 26
    xd = cp.asarray(rng.standard_normal(n).astype(np.float32))
    k.int8_quantize(xd)
    cp.cuda.Device().synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        k.int8_quantize(xd)
    cp.cuda.Device().synchronize()
    gbs = 10 * n * 5 / (time.perf_counter() - t0) / 1e9
    t.add(
        "int8 quantize throughput", "ok", f"{gbs:.0f} GB/s", "256 MiB float32, bytes read+written"
    )

    for dtype in ("float16", "bfloat16"):
        n = 1 << 22
        a = rng.integers(0, 1 << 16, n, dtype=np.uint16)  # every pattern: NaN, inf, subnormal
        b = rng.integers(0, 1 << 16, n, dtype=np.uint16)
        acc0 = (rng.standard_normal(n) * 100).astype(np.float32)
        acc_dev = k.accumulate_half(cp.asarray(acc0), cp.asarray(a), dtype)
        acc_ref = R.accumulate_half(acc0.copy(), a, dtype)
        f = rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32).view(np.float32)
        good = same_bits(cp.asnumpy(acc_dev), acc_ref, True)
        good = good and same_bits(
            cp.asnumpy(k.round_half(cp.asarray(f), dtype)), R.round_half(f, dtype)
        )
        s_dev = k.sum_half(cp.asarray(a), cp.asarray(b), dtype)
        good = good and same_bits(cp.asnumpy(s_dev), R.sum_half(a, b, dtype))
        t.add(
            f"{dtype} accumulate/round/sum in float32",
            ok(good),
            "bitwise",
            f"n={n}, all 16-bit patterns, random float32 bits",
        )


# -- NCCL at N=1 ------------------------------------------------------------------------------


def solo_view(node: str) -> RingView:
    return RingView.of([Peer(node, "127.0.0.1", 1)])


def check_nccl_solo(t: Table) -> None:
    from ftmesh.collective import SyncDataPlane

    with SyncDataPlane.start("solo") as dp:
        nccl_solo(t, dp)


def nccl_solo(t: Table, dp: Any) -> None:
    """NCCL at N=1 through the one binding, torch's ``ProcessGroupNCCL`` per view epoch on the
    ring store (``TorchPGFactory(sessions, "nccl")``), the store rounds on a one-member ring."""
    import torch

    from ftmesh.collective.backend import NCCL_DTYPES, local_devices
    from ftmesh.collective.torch_pg import TorchPGFactory

    factory = TorchPGFactory(dp.session, "nccl", init_timeout=20.0, op_timeout=20.0)
    t.add(
        "NCCL binding",
        "ok",
        "torch ProcessGroupNCCL",
        f"torch {torch.__version__}, NCCL {torch.cuda.nccl.version()}, "
        f"advertised {local_devices().to_meta()}",
    )
    view = RingView.of([Peer("solo", *dp.address)])
    cfg = EpochConfig(init_timeout=30, op_timeout=20)
    m = EpochManager("solo", factory, SoloControl(), config=cfg)
    t0 = time.perf_counter()
    m.allreduce(view, torch.ones(4, device="cuda"))
    t.add(
        "lifecycle N=1: set up (store rounds + ProcessGroupNCCL + first allreduce)",
        "ok",
        f"{time.perf_counter() - t0:.3f} s",
    )
    bad = []
    for dtype in sorted(NCCL_DTYPES):
        try:
            tdt = getattr(torch, dtype)
            if dtype.startswith(("int", "uint")):
                x = torch.randint(1, 100, (1 << 20,), device="cuda").to(tdt)
            else:
                x = (torch.rand(1 << 20, device="cuda", dtype=torch.float64) + 0.5).to(tdt)
            before = x.clone()
            m.allreduce(view, x)
            torch.cuda.synchronize()
            if not torch.equal(x.view(torch.uint8), before.view(torch.uint8)):
                bad.append(dtype)
        except Exception as exc:  # one dtype's failure must not hide the others'
            bad.append(f"{dtype} ({type(exc).__name__}: {str(exc)[:80]})")
    t.add(
        "NCCL N=1 allreduce per dtype",
        ok(not bad),
        f"{len(NCCL_DTYPES)} dtypes",
        f"wrong: {bad}" if bad else "torch tensors, in place, unchanged at N=1",
    )
    import cupy as cp

    y = cp.arange(1, 1001, dtype=cp.float32)
    m.broadcast(view, y, root="solo")
    m.allreduce(view, y)
    t.add("NCCL N=1 on a CuPy array", ok(bool((y == cp.arange(1, 1001)).all())), "float32")
    small = torch.ones(1024, device="cuda")
    lat = []
    for _ in range(50):
        t0 = time.perf_counter()
        m.allreduce(view, small)
        lat.append(time.perf_counter() - t0)
    t.add(
        "lifecycle N=1: 4 KiB allreduce latency",
        "ok",
        f"{np.median(lat) * 1e6:.0f} us",
        "median of 50, enqueue + poll to completion",
    )

    # abort a collective in flight: the stream is held by a sleeping kernel
    big = torch.ones(16 * MIB, device="cuda")
    torch.cuda._sleep(int(2e9))  # ~1 s of GPU time ahead of the allreduce
    err: list[BaseException] = []
    done = threading.Event()

    def run() -> None:
        try:
            m.allreduce(view, big)
        except BaseException as exc:
            err.append(exc)
        done.set()

    th = threading.Thread(target=run)
    th.start()
    time.sleep(0.1)
    t0 = time.perf_counter()
    m.view_changed(None)  # what membership does on a view change
    done.wait(30)
    t_abort = time.perf_counter() - t0  # until the caller's collective raised
    m.wait_aborts(30)  # ProcessGroup.abort() itself runs in the manager's aborting thread
    torch.cuda.synchronize()
    t.add(
        "lifecycle N=1: abort mid-collective",
        ok(bool(err)),
        f"{t_abort * 1e3:.1f} ms",
        f"{type(err[0]).__name__ if err else 'no error'}; abort "
        f"{m.statistics().last_abort_seconds * 1e3:.1f} ms",
    )
    m.clear_abort(view.epoch)
    t0 = time.perf_counter()
    m.allreduce(view, small)
    torch.cuda.synchronize()
    t.add(
        "lifecycle N=1: rebuild + allreduce",
        "ok",
        f"{time.perf_counter() - t0:.3f} s",
        f"setups={m.statistics().setups}",
    )

    # two process groups on one GPU (idle, the stream held by a sleeping kernel), one call
    m2 = EpochManager("solo", factory, SoloControl(), config=cfg)
    m2.allreduce(view, small)
    comms = [ep.comm for ep in (m._epoch, m2._epoch) if ep is not None and ep.comm is not None]
    torch.cuda._sleep(int(1e9))
    t0 = time.perf_counter()
    factory.abort_group(comms)
    t.add(
        "abort of 2 idle process groups on one GPU",
        ok(len(comms) == 2),
        f"{(time.perf_counter() - t0) * 1e3:.1f} ms",
        "ProcessGroup.abort() of each, one after the other (torch has no grouped abort)",
    )
    torch.cuda.synchronize()


def check_tcp_solo(t: Table) -> None:
    """--dry-run: the N=1 lifecycle on the TCP ring behind the same interfaces."""
    from ftmesh.collective import SyncDataPlane
    from ftmesh.collective.session import SessionRing, nested_sessions
    from ftmesh.collective.tcp_backend import TcpFactory

    with SyncDataPlane.start("solo") as dp:
        view = RingView.of([Peer("solo", *dp.address)])
        ring = SessionRing(nested_sessions(dp.session))
        factory = TcpFactory(ring, lambda ep: dp.abort_view(ep, "", "aborted"))
        m = EpochManager("solo", factory, SoloControl())
        x = np.arange(1, 5, dtype=np.float32)
        t0 = time.perf_counter()
        m.allreduce(view, x)
        t.add(
            "lifecycle N=1 (TCP): set up + allreduce",
            ok(bool((x == [1, 2, 3, 4]).all())),
            f"{time.perf_counter() - t0:.3f} s",
        )
        m.view_changed(None)
        m.clear_abort(view.epoch)
        m.allreduce(view, x)
        t.add(
            "lifecycle N=1 (TCP): abort, rebuild",
            ok(m.statistics().setups == 2),
            f"setups={m.statistics().setups}",
            "no collective in flight to abort on a CPU",
        )


# -- several processes on the one GPU -----------------------------------------------------------


class Workers:
    """Worker processes (``device_worker.py``) and the events they print."""

    def __init__(self, n: int, argv: list[str], env: dict[str, str], logs: Path, name: str) -> None:
        self.events: queue.Queue[tuple[int, dict[str, Any]]] = queue.Queue()
        self._log = logs / f"{name}-events.jsonl"
        self._log_lock = threading.Lock()
        self.procs: list[subprocess.Popen[str]] = []
        for i in range(n):
            err = open(logs / f"{name}{i}.log", "w")  # noqa: SIM115 - closed with the process
            p = subprocess.Popen(
                [sys.executable, str(Path(__file__).with_name("device_worker.py")), *argv],
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env=env,
                cwd=ROOT,
            )
            self.procs.append(p)
            threading.Thread(target=self._read, args=(i, p), daemon=True).start()

    def _read(self, i: int, p: subprocess.Popen[str]) -> None:
        assert p.stdout is not None
        for line in p.stdout:
            if line.startswith("DEVCHECK "):
                event = json.loads(line[len("DEVCHECK ") :])
                event["at"] = time.monotonic()
                self.events.put((i, event))
                with self._log_lock, open(self._log, "a") as f:
                    f.write(json.dumps({"worker": i, **event}) + "\n")
        self.events.put((i, {"event": "exit"}))

    def collect(
        self,
        until: Callable[[list[tuple[int, dict[str, Any]]]], bool],
        timeout: float,
        seen: list[tuple[int, dict[str, Any]]],
    ) -> bool:
        end = time.monotonic() + timeout
        while not until(seen):
            left = end - time.monotonic()
            if left <= 0:
                return False
            try:
                seen.append(self.events.get(timeout=min(left, 0.5)))
            except queue.Empty:
                continue
        return True

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait(10)


def of(seen: list[tuple[int, dict[str, Any]]], event: str) -> list[tuple[int, dict[str, Any]]]:
    return [(i, e) for i, e in seen if e["event"] == event]


def check_processes(t: Table, args: argparse.Namespace, logs: Path) -> None:
    gpu = not args.dry_run
    world = args.world
    reg = Path(tempfile.mkdtemp(prefix="ftmesh-devcheck-"))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "NCCL_MULTI_RANK_GPU_ENABLE": "1"}
    argv = [
        "--registry",
        str(reg),
        "--world",
        str(world),
        "--backend",
        "nccl" if gpu else "tcp",
        "--sizes",
        args.sizes,
        "--iters",
        str(args.iters),
        "--dtypes",
        "float32,bfloat16,float16,int32" if gpu else "float32,bfloat16,int32",
        "--staging-mib",
        str(args.staging_mib),
        "--kill-mib",
        str(args.kill_mib),
        "--steps",
        str(args.train_steps),
    ]
    w = Workers(world, argv, env, logs, "collectives")
    seen: list[tuple[int, dict[str, Any]]] = []
    what = f"{world} processes on one GPU" if gpu else f"{world} processes, TCP standing in"
    try:
        exits = lambda s: len(of(s, "exit")) + len(of(s, "fatal"))  # noqa: E731
        if not w.collect(
            lambda s: len(of(s, "kill-ready")) == world or exits(s) > 0, args.phase_timeout, seen
        ):
            t.add(f"multi-process ({what})", "FAIL", "", "timed out before the kill phase")
        for i, e in of(seen, "fatal"):
            t.add(f"worker {i}", "FAIL", "", e["error"])
        corr = of(seen, "correct")
        backends = sorted({e.get("backend", "?") for _, e in corr})
        if gpu:
            works = backends == ["nccl"]
            t.add(
                f"NCCL_MULTI_RANK_GPU_ENABLE=1 probe ({world} procs)",
                ok(works),
                "/".join(backends),
                "nccl = ranks share the GPU; staging = NCCL init failed, "
                "the view fell back (see worker logs)",
            )
        for dtype in sorted({e["dtype"] for _, e in corr}):
            rows = [e for _, e in corr if e["dtype"] == dtype]
            errs = [e["error"] for e in rows if "error" in e]
            digests = {e.get("digest") for e in rows}
            tol = 2e-2 if dtype in ("bfloat16", "float16") else 1e-5
            rel = max((e.get("rel_err", 1.0) for e in rows), default=1.0)
            good = not errs and len(rows) == world and len(digests) == 1 and rel <= tol
            t.add(
                f"ring correctness {dtype} ({what})",
                ok(good),
                f"rel err {rel:.1e}",
                errs[0]
                if errs
                else f"identical on all {len(rows)} members"
                if len(digests) == 1
                else f"{len(digests)} different results",
            )
        for mib in [int(s) for s in args.sizes.split(",")]:
            rows = [e for _, e in of(seen, "busbw") if e["mib"] == mib]
            errs = [e["error"] for e in rows if "error" in e]
            if errs or not rows:
                t.add(f"busbw {mib} MiB ftmesh vs torch", "FAIL", "", errs[0] if errs else "none")
                continue
            n = rows[0]["size"]
            factor = 2 * (n - 1) / n
            ft = max(e["ftmesh"] for e in rows)  # the slowest member bounds the collective
            tt = max(e["torch"] for e in rows)
            bus_ft, bus_tt = (mib * MIB / s * factor / 1e9 for s in (ft, tt))
            ratio = tt / ft
            peer = "torch NCCL" if gpu else "torch gloo"
            t.add(
                f"busbw {mib} MiB: ftmesh vs {peer}",
                ok(ratio >= 0.95) if gpu else "ok",
                f"{bus_ft:.2f} vs {bus_tt:.2f} GB/s",
                f"ratio {ratio:.2f} (goal >= 0.95 on GPU); same processes, interleaved, N={n}",
            )
        for _, e in of(seen, "staging")[:1]:
            if "error" in e:
                t.add("staged path busbw", "FAIL", "", e["error"])
            else:
                n = e["size"]
                bus = e["mib"] * MIB / e["seconds"] * 2 * (n - 1) / n / 1e9
                t.add(
                    f"staged path busbw {e['mib']} MiB",
                    "ok",
                    f"{bus:.2f} GB/s",
                    f"GPU -> host -> TCP ring -> GPU, N={n}",
                )

        # kill -9 of the last rank mid-allreduce
        ranks = {i: e["rank"] for i, e in of(seen, "view")}
        victim = next((i for i, r in ranks.items() if r == world - 1), None)
        if victim is None or len(of(seen, "kill-ready")) < world:
            t.add("kill -9 mid-allreduce", "FAIL", "", "workers never reached the kill phase")
            return
        time.sleep(0.5)  # well inside the allreduce loop
        w.procs[victim].send_signal(signal.SIGKILL)
        t_kill = time.monotonic()
        survivors = [i for i in range(world) if i != victim]
        w.collect(
            lambda s: (
                len([1 for i, _ in of(s, "kill-recovered") if i in survivors]) == len(survivors)
                or exits(s) > 1
            ),
            args.phase_timeout,
            seen,
        )
        w.collect(
            lambda s: (
                len([1 for i, _ in of(s, "trained") if i in survivors]) == len(survivors)
                or exits(s) > 1
            ),
            args.phase_timeout,
            seen,
        )
        (reg / "done").touch()
        try:
            kill_rows(t, gpu, seen, survivors, t_kill)
        finally:
            check_training(t, gpu, [e for i, e in of(seen, "trained") if i in survivors])
    finally:
        w.close()
        shutil.rmtree(reg, ignore_errors=True)


def kill_rows(
    t: Table, gpu: bool, seen: list[tuple[int, dict[str, Any]]], survivors: list[int], t_kill: float
) -> None:
    errs: dict[int, dict[str, Any]] = {}
    for i, e in of(seen, "loop-error"):  # each survivor's first failure after the kill
        if i in survivors and e["t"] >= t_kill and i not in errs:
            errs[i] = e
    false_alarms = len([1 for _, e in of(seen, "loop-error") if e["t"] < t_kill])
    recs = {i: e for i, e in of(seen, "kill-recovered") if i in survivors}
    if len(errs) < len(survivors):
        t.add("kill -9 -> survivors abort", "FAIL", "", f"errors seen: {list(errs.values())}")
        return
    t_err = max(e["t"] for e in errs.values()) - t_kill
    kinds = sorted({e["error"] for e in errs.values()})
    t.add(
        "kill -9 -> survivors' collective aborted",
        ok(t_err < 1.0),
        f"{t_err:.3f} s",
        f"{'/'.join(kinds)}; goal < 1 s (torch's NCCL watchdog: 10 min); "
        f"{false_alarms} false suspicions before the kill",
    )
    if len(recs) < len(survivors) or any("t" not in e for e in recs.values()):
        t.add(
            "kill -9 -> next collective on the new view",
            "FAIL",
            "",
            f"{[e.get('error') for e in recs.values()]}",
        )
        return
    t_next = max(e["t"] for e in recs.values()) - t_kill
    t.add(
        "kill -9 -> next collective on the new view",
        ok(t_next < 1.0 or not gpu),
        f"{t_next:.3f} s",
        f"backend {sorted({e['backend'] for e in recs.values()})}, "
        f"new communicator included; goal < 1 s",
    )


def check_training(t: Table, gpu: bool, done: list[dict[str, Any]]) -> None:
    where, n = ("CUDA" if gpu else "CPU"), len(done)
    check = f"ElasticTrainer, {where} model, the {n} survivors"
    errs = [e["error"] for e in done if "error" in e]
    if errs or not done:
        t.add(check, "FAIL", "", errs[0] if errs else "no result (see worker logs)")
        return
    same = len({e["digest"] for e in done}) == 1
    better = all(e["last"] < e["first"] for e in done)
    t.add(
        check,
        ok(same and better),
        f"loss {done[0]['first']:.3f} -> {done[0]['last']:.3f}",
        f"{done[0]['steps']} steps on {done[0]['device']}; "
        f"{'identical digests' if same else 'DIGESTS DIFFER'}; gradients via the mesh's path",
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="CPU only: the plumbing (CI)")
    p.add_argument("--world", type=int, default=3)
    p.add_argument("--sizes", default="")
    p.add_argument("--iters", type=int, default=0)
    p.add_argument("--staging-mib", type=int, default=64)
    p.add_argument("--kill-mib", type=int, default=16)
    p.add_argument("--train-steps", type=int, default=30)
    p.add_argument("--phase-timeout", type=float, default=150.0)
    p.add_argument(
        "--budget", type=float, default=440.0, help="seconds for the whole check (of 8 min)"
    )
    p.add_argument("--logs", default="")
    p.add_argument("--json", default="")
    args = p.parse_args()
    args.sizes = args.sizes or ("1,4" if args.dry_run else "64,256")
    args.iters = args.iters or (3 if args.dry_run else 5)
    logs = Path(args.logs or tempfile.mkdtemp(prefix="ftmesh-devlogs-"))
    logs.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    t = Table()

    def stop(_sig: int, _frame: Any) -> None:  # `timeout` ends us: still print the table
        raise SystemExit(1)

    signal.signal(signal.SIGTERM, stop)
    try:
        t.guard("NVRTC compile of native/*.cu", lambda: check_compile(t))
        if args.dry_run:
            t.add("kernels vs references", "n/a", "", "--dry-run: no GPU")
            t.guard("lifecycle N=1 (TCP)", lambda: check_tcp_solo(t))
        else:
            t.guard("kernels vs references", lambda: check_kernels(t))
            t.guard("NCCL at N=1", lambda: check_nccl_solo(t))
        args.phase_timeout = min(
            args.phase_timeout, max(30.0, args.budget - (time.monotonic() - started)) / 2
        )
        t.guard("multi-process phases", lambda: check_processes(t, args, logs))
    except SystemExit:
        t.add("interrupted", "FAIL", "", "stopped by SIGTERM (the wrapper's time limit)")
    finally:
        t.add(
            "not covered by one GPU",
            "n/a",
            "",
            "busbw across GPUs/NVLink/network; NCCL on GPUs of several hosts; a GPU failing "
            "(Xid) or a hung driver; ncclCommShrink vs init (not measured)",
        )
        t.add("wall time", "ok", f"{time.monotonic() - started:.0f} s", f"logs in {logs}")
        print(t.render(), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps([asdict(r) for r in t.rows], indent=1))
    return 1 if any(r.status == "FAIL" for r in t.rows) else 0


if __name__ == "__main__":
    sys.exit(main())
