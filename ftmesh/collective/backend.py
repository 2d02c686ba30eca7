"""Which backend a view's collectives use: NCCL, host staging or TCP.

Theory of operation: every member advertises its devices in its member metadata under
``DEVICES_KEY`` (``local_devices()`` at start: the CUDA devices it sees and the NCCL version
it can load, 0 for none). A view's GPU collectives run on NCCL only when *every* member
advertises a GPU and the *same* NCCL version (ranks of one communicator must run one NCCL
version); otherwise GPU buffers are staged through host memory over the TCP ring, and host
buffers always use TCP. A dtype NCCL does not reduce through torch's ``ProcessGroupNCCL``
(``NCCL_DTYPES``: no ``int16``, no unsigned beyond ``uint8``) always stages.

The decision is made by the view's root (``epochs``) and broadcast with the NCCL id, so
members that see different metadata for a moment still follow one decision; a member that
cannot follow it (no NCCL after all) fails its init, and the whole view falls back.

Metadata comes from the network: ``parse_devices`` validates it where it is read (types,
ranges, caps) and returns None for anything else, which the caller counts (``bad_meta``)
and treats as "no GPU" -- never an exception in a loop.
"""

from __future__ import annotations

import enum
import logging
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

DEVICES_KEY = "devices"
"""Member metadata key: ``"cuda=<devices>,nccl=<version code>"`` (metadata values are flat
scalars; this one is also what ``ftmesh status`` can print as it is)."""
_DEVICES_RE = re.compile(r"cuda=([0-9]{1,4}),nccl=([0-9]{1,7})")  # ASCII digits only
MAX_DEVICES = 1024
"""Largest device count accepted from the network (a bound, not a hardware limit)."""
MAX_NCCL_VERSION = 10**7
"""Largest NCCL version code accepted (2.32.3 is 23203)."""


NCCL_DTYPES = frozenset(
    {"int8", "uint8", "int32", "int64", "float16", "float32", "float64", "bfloat16"}
)
"""The dtypes (NumPy/torch names) a GPU collective runs on NCCL for; the others stage. The
NCCL binding is torch's ``ProcessGroupNCCL`` (``torch_pg``), whose dtype table maps exactly
these (plus ``bool`` and float8, which ftmesh does not send there): NCCL's own ``uint32`` and
``uint64`` have no entry in it, so they stage too."""


class Backend(enum.Enum):
    TCP = "tcp"
    STAGING = "staging"
    NCCL = "nccl"


@dataclass(frozen=True)
class DeviceInfo:
    cuda: int = 0
    """CUDA devices this member can use."""
    nccl: int = 0
    """NCCL version code (as ``ncclGetVersion``'s) of its torch's NCCL, 0 for none."""

    def to_meta(self) -> str:
        return f"cuda={self.cuda},nccl={self.nccl}"

    @property
    def can_nccl(self) -> bool:
        return self.cuda > 0 and self.nccl > 0


def parse_devices(meta: Mapping[str, Any]) -> DeviceInfo | None:
    """The ``DEVICES_KEY`` entry of a member's metadata, or None if absent or malformed."""
    raw = meta.get(DEVICES_KEY)
    match = _DEVICES_RE.fullmatch(raw) if isinstance(raw, str) else None
    if match is None:
        return None
    cuda, nccl = int(match[1]), int(match[2])
    if not (cuda <= MAX_DEVICES and nccl <= MAX_NCCL_VERSION):
        return None
    return DeviceInfo(cuda, nccl)


def view_backend(devices: Iterable[DeviceInfo | None]) -> Backend:
    """NCCL if every member can run it with one NCCL version, else staging."""
    infos = list(devices)
    ok = [d for d in infos if d is not None and d.can_nccl]
    if infos and len(ok) == len(infos) and len({d.nccl for d in ok}) == 1:
        return Backend.NCCL
    return Backend.STAGING


def call_backend(view: Backend, on_gpu: bool, dtype: str) -> Backend:
    """The backend of one collective: TCP for host buffers, NCCL where the view chose it and
    NCCL has the dtype, else staging."""
    if not on_gpu:
        return Backend.TCP
    return Backend.NCCL if view is Backend.NCCL and dtype in NCCL_DTYPES else Backend.STAGING


def local_devices() -> DeviceInfo:
    """This process's devices: the CUDA devices torch sees (CuPy's count if torch is not
    installed) and the NCCL version of torch's ``ProcessGroupNCCL`` -- the one NCCL binding
    (``torch_pg``), so without torch there is no NCCL. Imports torch lazily; anything missing
    counts as none, a broken install warns once and counts as none."""
    try:
        import torch
    except ImportError:
        return DeviceInfo(_cupy_device_count(), 0)
    try:
        cuda = int(torch.cuda.device_count()) if torch.cuda.is_available() else 0
    except Exception as exc:  # a broken driver or CUDA install: "no GPU", loudly
        log.warning("torch cannot count CUDA devices (%s): GPU views will stage", exc)
        return DeviceInfo(0, 0)
    if cuda == 0:
        return DeviceInfo(0, 0)
    try:
        version = _torch_nccl_version()
    except Exception as exc:  # a broken binding: "no NCCL", loudly
        log.warning("%d CUDA device(s) but no usable NCCL (%s): GPU views will stage", cuda, exc)
        version = 0
    return DeviceInfo(min(cuda, MAX_DEVICES), max(0, min(version, MAX_NCCL_VERSION)))


def _torch_nccl_version() -> int:
    """The version code (as ``ncclGetVersion``'s) of the NCCL torch's ``ProcessGroupNCCL`` runs
    on, 0 if this torch has none (a CPU build, or one without ``torch.distributed``)."""
    import torch.cuda.nccl
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_nccl_available()):
        return 0
    return nccl_version_code(torch.cuda.nccl.version())  # type: ignore[no-untyped-call]


def nccl_version_code(version: Any) -> int:
    """``torch.cuda.nccl.version()`` (a tuple such as ``(2, 21, 5)``) as NCCL's own version
    code (``NCCL_VERSION(major, minor, patch)``: 22105; before 2.9 it was ``major*1000 + ...``)."""
    major, minor, patch = (int(v) for v in tuple(version)[:3])
    if (major, minor) < (2, 9):
        return major * 1000 + minor * 100 + patch
    return major * 10000 + minor * 100 + patch


def _cupy_device_count() -> int:
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # no CuPy, no driver, no device
        return 0
