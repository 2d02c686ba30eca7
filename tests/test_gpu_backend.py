"""Backend selection from member metadata, the dtypes that run on NCCL, and what a member
advertises: its CUDA devices and the NCCL version of torch's ``ProcessGroupNCCL`` (the one
NCCL binding), probed without importing anything at ``import ftmesh``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ftmesh.collective.backend import (
    DEVICES_KEY,
    NCCL_DTYPES,
    Backend,
    DeviceInfo,
    call_backend,
    local_devices,
    nccl_version_code,
    parse_devices,
    view_backend,
)

ROOT = Path(__file__).resolve().parents[1]


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
    # NCCL has uint32/uint64, torch's ProcessGroupNCCL does not map them: they stage
    for dtype in ("uint32", "uint64", "bool", "complex64", ""):
        assert call_backend(Backend.NCCL, on_gpu=True, dtype=dtype) is Backend.STAGING, dtype


TORCH_NCCL_TABLE = ("int8", "uint8", "int32", "int64", "float16", "float32", "float64", "bfloat16")
"""torch's ``ncclDataType`` map (c10d's NCCLUtils.hpp, torch 2.4-2.11), less ``bool`` (summed as
max) and float8 (sent as uint8): the dtypes ftmesh may hand to ``ProcessGroupNCCL``."""


def test_the_nccl_dtypes_are_torch_processgroupnccls() -> None:
    torch = pytest.importorskip("torch")
    assert set(TORCH_NCCL_TABLE) == NCCL_DTYPES
    for name in NCCL_DTYPES:  # the names GpuPath reads off a tensor's dtype
        assert str(getattr(torch, name)).removeprefix("torch.") == name


def test_nccl_version_code_is_ncclGetVersions() -> None:
    assert nccl_version_code((2, 21, 5)) == 22105
    assert nccl_version_code((2, 32, 3)) == 23203
    assert nccl_version_code((2, 9, 6)) == 20906  # the new encoding starts at 2.9
    assert nccl_version_code((2, 8, 4)) == 2804  # NCCL_VERSION before 2.9: major*1000 + ...
    assert nccl_version_code([3, 0, 1, "+cuda12"]) == 30001


def test_this_machine_has_no_gpu_and_says_so() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CPU machine's answer; tests/gpu/run_device_check.py covers a GPU's")
    assert local_devices() == DeviceInfo(0, 0)


def test_importing_ftmesh_and_the_gpu_modules_imports_neither_torch_nor_cupy() -> None:
    code = (
        "import sys, ftmesh, ftmesh.native, ftmesh.native.reference, ftmesh.native.nvrtc\n"
        "import ftmesh.native.launchers, ftmesh.collective.epochs, ftmesh.collective.backend\n"
        "import ftmesh.collective.tcp_backend, ftmesh.collective.torch_pg, ftmesh.mesh.gpu\n"
        "bad = [m for m in ('torch', 'cupy', 'nccl') if m in sys.modules]\n"
        "assert not bad, bad\n"
        "from ftmesh.collective.backend import local_devices; local_devices()\n"
        "bad = [m for m in ('cupy', 'nccl') if m in sys.modules]\n"  # torch: it asks torch
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, cwd=ROOT)


# A stand-in for a CUDA build of torch (what ``local_devices`` reads of it, nothing else), on
# the path of a child interpreter only: how a GPU machine's answers turn into metadata.
FAKE_TORCH = {
    "torch/__init__.py": "from . import cuda, distributed\n",
    "torch/cuda/__init__.py": textwrap.dedent(
        """\
        import os
        from . import nccl
        def is_available():
            return os.environ["FAKE_CUDA"] != "0"
        def device_count():
            if os.environ["FAKE_CUDA"] == "broken":
                raise RuntimeError("CUDA driver initialization failed")
            return 2
        """
    ),
    "torch/cuda/nccl.py": textwrap.dedent(
        """\
        import os
        def version():
            if os.environ["FAKE_NCCL"] == "broken":
                raise RuntimeError("libnccl.so.2: cannot open shared object file")
            return tuple(int(v) for v in os.environ["FAKE_NCCL"].split("."))
        """
    ),
    "torch/distributed/__init__.py": textwrap.dedent(
        """\
        import os
        def is_available():
            return True
        def is_nccl_available():
            return os.environ["FAKE_NCCL"] != "none"
        """
    ),
}


def advertised(tmp_path: Path, cuda: str, nccl: str) -> tuple[str, str]:
    """``local_devices()`` in a child whose torch answers ``cuda``/``nccl``; its warnings."""
    for rel, text in FAKE_TORCH.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    code = (
        "import logging; logging.basicConfig(format='%(levelname)s %(message)s')\n"
        "from ftmesh.collective.backend import local_devices\n"
        "print(local_devices().to_meta())\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}",
        "FAKE_CUDA": cuda,
        "FAKE_NCCL": nccl,
    }
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout.strip(), res.stderr


def test_local_devices_reads_cuda_and_nccl_through_torch(tmp_path: Path) -> None:
    assert advertised(tmp_path, "2", "2.21.5") == ("cuda=2,nccl=22105", "")
    assert advertised(tmp_path, "0", "2.21.5") == ("cuda=0,nccl=0", "")  # no GPU: no NCCL
    assert advertised(tmp_path, "2", "none") == ("cuda=2,nccl=0", "")  # torch without NCCL
    meta, err = advertised(tmp_path, "2", "broken")  # a broken libnccl: none, loudly, once
    assert meta == "cuda=2,nccl=0"
    assert err.count("WARNING") == 1 and "no usable NCCL" in err and "libnccl" in err
    meta, err = advertised(tmp_path, "broken", "2.21.5")  # a broken driver: no GPU, loudly
    assert meta == "cuda=0,nccl=0"
    assert err.count("WARNING") == 1 and "CUDA driver initialization failed" in err
