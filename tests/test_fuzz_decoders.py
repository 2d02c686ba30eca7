"""Hypothesis fuzzing of the decoders other than membership's (``test_fuzz.py``): the data-plane
control messages, the collective engine's frame stream (over real sockets), and state
snapshots. Whatever arrives, the only outcomes are a result or the layer's documented error."""

from __future__ import annotations

import socket
import struct

import msgpack
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ftmesh.collective import schedule, wire
from ftmesh.collective.engine import Buffers, Pipeline
from ftmesh.collective.ops import reducer
from ftmesh.collective.transport import Ring
from ftmesh.collective.view import Peer, RingView
from ftmesh.errors import CollectiveError, PeerLostError, RemoteProtocolError
from ftmesh.state import Snapshot, State

FAST = settings(deadline=None, max_examples=150, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(st.binary(max_size=300))
def test_control_decoder_arbitrary_bytes(data: bytes) -> None:
    try:
        msg = wire.unpack_control(data)
    except RemoteProtocolError:
        return
    assert isinstance(msg, dict)


def _damaged(data: st.DataObject, good: bytes) -> bytes:
    """``good`` cut short, with a byte flipped, with bytes inserted, or replaced by garbage."""
    out = bytearray(good)
    how = data.draw(st.sampled_from(["cut", "flip", "insert", "garbage"]))
    if how == "cut":
        del out[data.draw(st.integers(0, len(out) - 1)) :]
    elif how == "flip":
        out[data.draw(st.integers(0, len(out) - 1))] ^= data.draw(st.integers(1, 255))
    elif how == "insert":
        i = data.draw(st.integers(0, len(out)))
        out[i:i] = data.draw(st.binary(min_size=1, max_size=40))
    else:
        out = bytearray(data.draw(st.binary(max_size=400)))
    return bytes(out)


# -- the engine's receive side ----------------------------------------------------------------

N_ELEMS = 64


def _header(seq: int) -> dict[str, object]:
    return {
        "seq": seq,
        "kind": "allreduce",
        "op": "sum",
        "dtype": "float32",
        "shape": [N_ELEMS],
        "root": None,
    }


def _frame(kind: int, body: bytes = b"") -> bytes:
    return wire.FRAME.pack(kind, len(body)) + body


def _valid_stream(sched: schedule.Schedule) -> bytes:
    """What a correct left neighbour sends member 1 of a 2-member allreduce."""
    hdr = msgpack.packb({**_header(1), "frames": len(sched.sends)}, use_bin_type=True)
    out = _frame(wire.HEADER, hdr)
    for r in sched.recvs:
        out += _frame(wire.DATA, np.ones(r.stop - r.start, np.float32).tobytes())
    return out + _frame(wire.DONE)


def _run_member_1(stream: bytes) -> BaseException | None:
    """Member 1 of a 2-member ring runs an allreduce; its left neighbour's side of the
    connection sends ``stream`` and closes, its right neighbour says READY and reads."""
    view = RingView.of([Peer("m0", "127.0.0.1", 1), Peer("m1", "127.0.0.1", 2)])
    left_ours, left_theirs = socket.socketpair()
    right_ours, right_theirs = socket.socketpair()
    for s in (left_ours, right_ours):
        s.settimeout(0.05)
    bounds = schedule.segment_bounds(N_ELEMS, 2)
    sched = schedule.ring(bounds, 1, first_step=0, last_step=1, itemsize=4, chunk_bytes=64)
    acc = np.zeros(N_ELEMS, np.float32)
    ring = Ring(view, 1, view.members[0], view.members[0], right_ours, left_ours)
    pipe = Pipeline(
        "m1",
        ring,
        {**_header(1), "frames": len(sched.sends)},
        sched,
        Buffers(acc, acc, reducer("sum", "float32")),
        io_timeout=2.0,
        chunk_bytes=64,
        poll_interval=0.05,
    )
    right_theirs.sendall(wire.FRAME.pack(wire.READY, 1))
    right_theirs.setblocking(False)
    left_theirs.sendall(stream)
    left_theirs.shutdown(socket.SHUT_WR)
    try:
        pipe.run_blocking()
        return None
    except (CollectiveError, PeerLostError, RemoteProtocolError) as exc:
        return exc
    finally:
        for s in (left_ours, left_theirs, right_ours, right_theirs):
            s.close()


def test_engine_accepts_a_valid_stream() -> None:
    bounds = schedule.segment_bounds(N_ELEMS, 2)
    sched = schedule.ring(bounds, 1, first_step=0, last_step=1, itemsize=4, chunk_bytes=64)
    assert _run_member_1(_valid_stream(sched)) is None


@FAST
@given(st.data())
def test_engine_stream_mutations_end_in_a_clean_error(data: st.DataObject) -> None:
    bounds = schedule.segment_bounds(N_ELEMS, 2)
    sched = schedule.ring(bounds, 1, first_step=0, last_step=1, itemsize=4, chunk_bytes=64)
    # Any outcome but a hang or another exception type: success is possible when a flipped
    # byte only changed a payload value.
    _run_member_1(_damaged(data, _valid_stream(sched)))


# -- snapshots --------------------------------------------------------------------------------


def _snapshot_bytes() -> bytes:
    state = State(arrays={"w": np.arange(10, dtype=np.float32)}, scalars={"epoch": 3})
    return b"".join(bytes(p) for p in state.commit(step=7).to_bytes_parts())


@FAST
@given(st.data())
def test_snapshot_decoder_refuses_damage_cleanly(data: st.DataObject) -> None:
    blob = bytearray(_snapshot_bytes())
    if data.draw(st.booleans()):  # the header length field, or any other damage
        struct.pack_into("<I", blob, 8, data.draw(st.integers(0, 2**32 - 1)))
        damaged = bytes(blob)
    else:
        damaged = _damaged(data, bytes(blob))
    try:
        snap = Snapshot.from_buffer(damaged)
    except RemoteProtocolError:
        return
    assert snap.step >= 0
