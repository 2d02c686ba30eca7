"""Worker process for tests/test_collective_procs.py (run as a script).

Protocol on stdio: prints ``ADDR <port>``, reads one JSON line ``{"peers": [[id, port]...],
"mode": ...}``, runs, prints one JSON line per result. Inputs of member ``i`` come from
``np.random.default_rng(seed + i)``, so every worker can compute the float64 reference itself.
"""

from __future__ import annotations

import hashlib
import json
import sys
import threading
import time

import numpy as np
import trio

from ftmesh.collective import CollectiveConfig, Peer, RingView, SyncDataPlane
from ftmesh.errors import FtmeshError, PeerLostError

DTYPES = ["float16", "float32", "float64", "int32", "int64", "uint8"]
TOL = {"float16": 2e-2, "float32": 1e-5, "float64": 1e-12}


def member_input(dtype: str, size: int, rank: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed * 1000 + rank)
    if dtype.startswith("float"):
        return rng.uniform(-1, 1, size).astype(dtype)
    hi = 40 if dtype == "uint8" else 1000
    return rng.integers(0 if dtype == "uint8" else -hi, hi, size).astype(dtype)


def emit(obj: object) -> None:
    print(json.dumps(obj), flush=True)


def correctness(dp: SyncDataPlane, view: RingView, rank: int) -> None:
    n = view.size
    sizes = sorted({0, 1, max(n - 1, 0), 2, 13, 4099, 10007})
    for dtype in DTYPES:
        for op in ("sum", "avg", "min", "max"):
            if op == "avg" and not dtype.startswith("float"):
                continue
            for size in sizes:
                seed = size + 7 * DTYPES.index(dtype)
                allx = [member_input(dtype, size, r, seed).astype(np.float64) for r in range(n)]
                st = np.stack(allx) if size else np.zeros((n, 0))
                want = {"sum": st.sum(0), "avg": st.mean(0), "min": st.min(0), "max": st.max(0)}
                x = member_input(dtype, size, rank, seed)
                res = dp.session(view).allreduce(x, op=op)
                err = float(np.abs(x.astype(np.float64) - want[op]).max()) if size else 0.0
                ok = err <= TOL.get(dtype, 0.0) * n and res.members == view.node_ids
                emit(
                    {
                        "case": f"allreduce/{dtype}/{op}/{size}",
                        "ok": ok,
                        "err": err,
                        "hash": hashlib.sha256(x.tobytes()).hexdigest(),
                    }
                )
    for size in sizes:
        allx = [member_input("float32", size, r, size) for r in range(n)]
        x = allx[rank]
        rs = dp.session(view).reduce_scatter(x).output
        part = np.array_split(np.sum([a.astype(np.float64) for a in allx], 0), n)[rank]
        ok = rs.shape == part.shape and bool(np.allclose(rs, part, atol=1e-5 * n))
        emit({"case": f"reduce_scatter/{size}/{rank}", "ok": ok, "hash": ""})
        ag = dp.session(view).allgather(x).output
        ok = bool(np.array_equal(ag, np.stack(allx)))
        emit(
            {
                "case": f"allgather/{size}",
                "ok": ok,
                "hash": hashlib.sha256(ag.tobytes()).hexdigest(),
            }
        )
        b = x.copy()
        dp.session(view).broadcast(b, root=view.node_ids[0])
        ok = bool(np.array_equal(b, allx[0]))
        emit(
            {"case": f"broadcast/{size}", "ok": ok, "hash": hashlib.sha256(b.tobytes()).hexdigest()}
        )
    dp.session(view).barrier()
    emit({"case": "done", "ok": True, "hash": ""})


def until_lost(dp: SyncDataPlane, view: RingView) -> None:
    x = np.ones(4 << 20, np.float32)  # 16 MiB
    for i in range(500):  # bounded: the parent kills a member long before
        try:
            dp.session(view).allreduce(x)
        except PeerLostError as exc:
            emit(
                {
                    "lost": getattr(exc, "peer", None),
                    "type": type(exc).__name__,
                    "t": time.monotonic(),
                    "msg": str(exc),
                }
            )
            return
        except FtmeshError as exc:
            emit({"other": type(exc).__name__, "msg": str(exc), "t": time.monotonic()})
            return
        emit({"iter": i})
    emit({"finished": True})


def watch_idle(dp: SyncDataPlane, view: RingView) -> None:
    """One allreduce, then idle with the ring open, printing every neighbour the data plane
    reports closed (``DataPlane.on_closed``); on ``{"supersede": true}`` from the parent, give
    the view up (as a member moving on to a newer view does) and exit."""

    def closed(peer: str, refused: bool) -> None:
        emit({"closed": peer, "refused": refused, "t": time.monotonic()})

    dp.dp.on_closed = closed
    dp.session(view).allreduce(np.ones(1 << 16, np.float32))
    emit({"idle": True})
    for _ in range(100):
        line = sys.stdin.readline()
        if not line:
            return
        if json.loads(line).get("supersede"):
            token = dp._token  # (the data plane's trio thread)
            trio.from_thread.run_sync(
                dp.dp.supersede_view, view.epoch, "the test moved on", trio_token=token
            )
            emit({"superseded": True})
            return


def abort_on_request(dp: SyncDataPlane, view: RingView) -> None:
    """Reads ``{"abort": peer}`` lines from the parent (as membership would declare a death)."""
    for _ in range(100):
        line = sys.stdin.readline()
        if not line:
            return
        dp.abort_view(view.epoch, json.loads(line)["abort"], "declared dead by the test")


def main() -> int:
    node_id = sys.argv[1]
    io_timeout = float(sys.argv[2]) if len(sys.argv) > 2 else 10.0
    config = CollectiveConfig(chunk_bytes=1 << 16, io_timeout=io_timeout, view_timeout=20.0)
    with SyncDataPlane.start(node_id, config=config) as dp:
        print(f"ADDR {dp.address[1]}", flush=True)
        setup = json.loads(sys.stdin.readline())
        view = RingView.of(Peer(p, "127.0.0.1", port) for p, port in setup["peers"])
        rank = view.rank_of(node_id)
        if setup["mode"] == "correctness":
            correctness(dp, view, rank)
        elif setup["mode"] == "watch_idle":
            watch_idle(dp, view)
        else:
            if setup["mode"] == "until_abort":
                threading.Thread(target=abort_on_request, args=(dp, view), daemon=True).start()
            until_lost(dp, view)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
