"""Backend selection from member metadata, and the NCCL layer's logic without a GPU: the
communicator's polls and grouped aborts on a scripted driver, CuPy's blocking init in its
helper thread, and that nothing imports CuPy or NCCL unless asked."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ftmesh.collective.aborts import CommFailure
from ftmesh.collective.backend import (
    DEVICES_KEY,
    Backend,
    DeviceInfo,
    call_backend,
    local_devices,
    parse_devices,
    view_backend,
)
from ftmesh.collective.nccl import (
    ABORTED,
    IN_PROGRESS,
    NcclCommunicator,
    NcclFactory,
    NcclUnavailableError,
    _code_of,
    _PendingInit,
    load_driver,
)


def test_parse_devices_accepts_only_well_formed_entries() -> None:
    assert parse_devices({DEVICES_KEY: "cuda=2,nccl=23203"}) == DeviceInfo(2, 23203)
    assert parse_devices({DEVICES_KEY: DeviceInfo(1, 0).to_meta()}) == DeviceInfo(1, 0)
    for bad in (
        None,
        3,
        1.5,
        True,
        "",
        "cuda=1",
        "cuda=1,nccl=1,x=0",
        "cuda=-1,nccl=2",
        "cuda=1,nccl=99999999",
        "cuda=99999,nccl=1",
        "cuda=1, nccl=2",
        "nccl=1,cuda=1",
        "cuda=\u0661,nccl=1",  # a digit, but not an ASCII one
    ):
        assert parse_devices({DEVICES_KEY: bad}) is None, bad
    assert parse_devices({}) is None


@settings(max_examples=150, deadline=None)
@given(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=40))
def test_parse_devices_never_raises_on_network_junk(raw: Any) -> None:
    info = parse_devices({DEVICES_KEY: raw})
    assert info is None or (0 <= info.cuda <= 1024 and 0 <= info.nccl <= 10**7)


def test_view_backend_needs_every_member_on_one_nccl_version() -> None:
    gpu = DeviceInfo(1, 23203)
    assert view_backend([gpu, gpu, DeviceInfo(8, 23203)]) is Backend.NCCL
    assert view_backend([gpu, DeviceInfo(0, 0)]) is Backend.STAGING  # a CPU-only member
    assert view_backend([gpu, DeviceInfo(1, 0)]) is Backend.STAGING  # a GPU without NCCL
    assert view_backend([gpu, DeviceInfo(1, 22903)]) is Backend.STAGING  # two NCCL versions
    assert view_backend([gpu, None]) is Backend.STAGING  # metadata that did not parse
    assert view_backend([]) is Backend.STAGING


def test_call_backend() -> None:
    assert call_backend(Backend.NCCL, on_gpu=False, dtype="float32") is Backend.TCP
    assert call_backend(Backend.NCCL, on_gpu=True, dtype="bfloat16") is Backend.NCCL
    assert call_backend(Backend.NCCL, on_gpu=True, dtype="int16") is Backend.STAGING
    assert call_backend(Backend.STAGING, on_gpu=True, dtype="float32") is Backend.STAGING


def test_this_machine_has_no_gpu_and_says_so() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CPU machine's answer; tests/gpu/run_device_check.py covers a GPU's")
    assert local_devices() == DeviceInfo(0, 0)
    with pytest.raises(NcclUnavailableError, match=r"nccl4py.*cupy"):
        load_driver()


def test_importing_ftmesh_and_the_gpu_modules_imports_neither_cupy_nor_nccl() -> None:
    code = (
        "import sys, ftmesh, ftmesh.native, ftmesh.native.reference, ftmesh.native.nvrtc\n"
        "import ftmesh.native.launchers, ftmesh.collective.nccl, ftmesh.collective.epochs\n"
        "import ftmesh.collective.tcp_backend\n"
        "from ftmesh.collective.backend import local_devices; local_devices()\n"
        "bad = [m for m in ('cupy', 'nccl') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


class ScriptedDriver:
    """An ``NcclDriver`` that returns the codes it is given, one per poll."""

    nonblocking = True

    def __init__(self, codes: list[int]) -> None:
        self.codes = codes
        self.groups: list[list[Any]] = []

    def version(self) -> int:
        return 23203

    def unique_id(self) -> bytes:
        return b"i" * 128

    def init(self, nranks: int, rank: int, uid: bytes) -> Any:
        return ("comm", nranks, rank)

    def async_error(self, handle: Any) -> int:
        return self.codes.pop(0) if len(self.codes) > 1 else self.codes[0]

    def error_string(self, handle: Any, code: int) -> str:
        return f"scripted error {code}"

    def collective(self, handle: Any, op: Any, buf: Any) -> None:
        raise AssertionError("not on CPU")

    def abort_group(self, handles: Sequence[Any]) -> None:
        self.groups.append(list(handles))


def test_communicator_polls_errors_and_grouped_abort() -> None:
    from ftmesh.collective.view import Peer, RingView

    view = RingView.of([Peer("a", "h", 1), Peer("b", "h", 2)])
    driver = ScriptedDriver([IN_PROGRESS, IN_PROGRESS, 0])
    factory = NcclFactory(driver)
    comm = factory.create(view, "b", b"i" * 128)
    assert comm.handle == ("comm", 2, 1)
    assert [comm.ready(), comm.ready(), comm.ready()] == [False, False, True]
    assert comm.done()  # nothing started
    driver.codes = [6]
    with pytest.raises(CommFailure, match="scripted error 6") as info:
        comm.ready()
    assert info.value.code == 6
    other = NcclCommunicator(driver, "second")
    factory.abort_group([comm, other])
    factory.abort_group([comm, other])  # idempotent
    assert driver.groups == [[("comm", 2, 1), "second"]]  # one group, both handles
    with pytest.raises(CommFailure) as info:
        comm.done()
    assert info.value.code == ABORTED


def test_cupy_style_blocking_init_is_abandoned_and_cleaned_up() -> None:
    release, made = threading.Event(), []

    class Comm:
        aborted = False

        def abort(self) -> None:
            self.aborted = True

    class BlockingNccl:
        @staticmethod
        def NcclCommunicator(n: int, uid: Any, rank: int) -> Comm:
            release.wait(10)
            made.append(Comm())
            return made[-1]

    pending = _PendingInit(BlockingNccl, 2, 0, b"x")
    assert pending.comm is None and not pending.abandon()  # still in ncclCommInitRank
    release.set()
    pending._thread.join(10)
    assert made and made[0].aborted and pending.comm is None  # the late comm was aborted
    assert _code_of(KeyError(7)) == 7 and _code_of(RuntimeError("x")) == 3
