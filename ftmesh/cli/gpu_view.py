"""What an observer (``ftmesh status``) shows of the GPU path: each member's devices and the
backend of the current view.

Theory of operation: a member whose GPU path is enabled (``SyncMesh.enable_gpu``) advertises
its devices in its metadata under ``DEVICES_KEY`` (``"cuda=1,nccl=22105"``: CUDA devices and
NCCL version code); a member without it advertises nothing, which every member reads as "no
GPU". The root of a view chooses the view's backend from its members' entries
(``ftmesh.collective.backend.view_backend``): device buffers take NCCL only when every member
of the view has a GPU and the same NCCL version, and are staged through host memory over the
TCP ring otherwise; host buffers always take the TCP ring. ``describe_view`` derives the same
choice from the member list an observer reads, over the view every member computes from it
(``view_of(ring_members(...))``, suspects left out as by default), and says why GPU buffers
stage when they do.

It is what the metadata implies, not what a communicator did: a member that advertised NCCL
but fails to initialise it makes that view fall back to staging, which its progress (the
``BACKEND`` column of ``--watch``) shows; and members that briefly hold different member
lists still follow their root's single decision.

Metadata comes from the network: ``parse_devices`` validates an entry, and one that does not
parse is shown as ``?``, named in the staging reasons and counted as "no GPU", as the members
count it -- never an exception.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..collective.backend import DEVICES_KEY, Backend, parse_devices, view_backend
from ..membership.messages import MemberSnapshot
from ..mesh.core import ring_members, view_of
from ..mesh.meta import BadMetadataError, read_member
from .escape import shown

NAMES_SHOWN = 4
"""Members named in one staging reason before ``+N more``."""
UNREADABLE = "?"
"""The devices cell of a member whose entry does not parse."""


def nccl_version(code: int) -> str:
    """An NCCL version code (``ncclGetVersion``) as ``major.minor.patch``: 22105 is 2.21.5,
    2804 is 2.8.4 (codes before 2.9 have one digit less); a code too small to be either, as
    it is."""
    if code >= 20900:
        return f"{code // 10000}.{code % 10000 // 100}.{code % 100}"
    if code >= 1000:
        return f"{code // 1000}.{code % 1000 // 100}.{code % 100}"
    return str(code)


def devices_cell(meta: Mapping[str, Any]) -> str:
    """A member's devices as a table shows them: ``cpu`` (no entry, or no CUDA device),
    ``cuda=N,nccl=2.21.5``, ``cuda=N,nccl=none``, or ``?`` (an entry that does not parse)."""
    info = parse_devices(meta)
    if info is None:
        return UNREADABLE if DEVICES_KEY in meta else "cpu"
    if info.cuda == 0:
        return "cpu"
    return f"cuda={info.cuda},nccl={nccl_version(info.nccl) if info.nccl else 'none'}"


def devices_json(meta: Mapping[str, Any]) -> dict[str, Any]:
    """A member's devices for ``--json``: ``{"devices": {...} or None}``, and
    ``devices_problem`` when its entry does not parse."""
    info = parse_devices(meta)
    if info is None:
        if DEVICES_KEY not in meta:
            return {"devices": None}
        raw = shown(repr(meta[DEVICES_KEY])[:80])
        return {"devices": None, "devices_problem": f"{DEVICES_KEY} does not parse: {raw}"}
    version = nccl_version(info.nccl) if info.nccl else None
    return {"devices": {"cuda": info.cuda, "nccl": info.nccl, "nccl_version": version}}


@dataclass(frozen=True, slots=True)
class ViewBackend:
    """The backend a view's collectives take, as its members derive it."""

    members: tuple[str, ...]
    """The view's members' names (escaped), in view order."""
    gpu: Backend
    """What device buffers take: ``NCCL`` or ``STAGING`` (host buffers always take TCP)."""
    nccl: int
    """The NCCL version code every member shares (``gpu`` is NCCL), else 0."""
    staged_because: tuple[str, ...]
    """Why device buffers stage (``gpu`` is STAGING)."""

    def line(self) -> str:
        """One line for a person."""
        if self.gpu is Backend.NCCL:
            what = f"nccl (NCCL {nccl_version(self.nccl)} on every member; host buffers: tcp ring)"
        else:
            what = f"tcp ring (host buffers; GPU buffers staged: {'; '.join(self.staged_because)})"
        return f"view backend ({len(self.members)} members): {what}"

    def as_json(self) -> dict[str, Any]:
        return {
            "members": list(self.members),
            "gpu_buffers": self.gpu.value,
            "host_buffers": Backend.TCP.value,
            "nccl": self.nccl or None,
            "nccl_version": nccl_version(self.nccl) if self.nccl else None,
            "staged_because": list(self.staged_because),
            "line": self.line(),
        }


def current_view(members: list[MemberSnapshot]) -> list[MemberSnapshot]:
    """The members of the view every member computes from ``members`` (empty: no view)."""
    usable = []
    for m in ring_members(members):
        try:
            read_member(m)
        except BadMetadataError:  # (left out of the view: shown as UNUSABLE elsewhere)
            continue
        usable.append(m)
    view = view_of(usable)
    if view is None:
        return []
    by_node = {m.node: m for m in usable}
    return [by_node[nid] for nid in view.node_ids]


def describe_view(members: list[MemberSnapshot]) -> ViewBackend | None:
    """The backend of the view ``members`` imply (``None``: no training member, no view)."""
    in_view = current_view(members)
    if not in_view:
        return None
    infos = [parse_devices(m.meta) for m in in_view]
    names = tuple(shown(m.name) for m in in_view)
    chosen = view_backend(infos)
    if chosen is Backend.NCCL:
        (version,) = {d.nccl for d in infos if d is not None}
        return ViewBackend(names, Backend.NCCL, version, ())
    unreadable: list[str] = []
    no_gpu: list[str] = []
    no_nccl: list[str] = []
    versions: dict[int, list[str]] = {}
    for name, m, d in zip(names, in_view, infos, strict=True):
        if d is None:
            (unreadable if DEVICES_KEY in m.meta else no_gpu).append(name)
        elif d.cuda == 0:
            no_gpu.append(name)
        elif d.nccl == 0:
            no_nccl.append(name)
        else:
            versions.setdefault(d.nccl, []).append(name)
    reasons = []
    if unreadable:
        reasons.append(f"{_names(unreadable)}: devices entry does not parse")
    if no_gpu:
        reasons.append(f"{_names(no_gpu)}: no GPU")
    if no_nccl:
        reasons.append(f"{_names(no_nccl)}: a GPU but no NCCL")
    if len(versions) > 1:
        each = ", ".join(f"{nccl_version(v)} on {_names(n)}" for v, n in sorted(versions.items()))
        reasons.append(f"NCCL versions differ ({each})")
    return ViewBackend(names, Backend.STAGING, 0, tuple(reasons))


def _names(names: list[str]) -> str:
    more = len(names) - NAMES_SHOWN
    return " ".join(names[:NAMES_SHOWN]) + (f" +{more} more" if more > 0 else "")
