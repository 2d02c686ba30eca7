"""Export a checkpoint's state to the formats other tools read: ``torch.save`` and safetensors.

Theory of operation. A checkpoint (``ftmesh.state.checkpoint``) holds one snapshot: the state
dicts of the registered parts (``model``, ``optimizer``, a scheduler...) and the scalars, with
every tensor stored in the arena. Export rebuilds them:

* ``torch``: ``torch.save`` of ``{"step": N, "model": {...}, "optimizer": {...}, ...,
  "scalars": {...}}``, or of one part alone (``part="model"``: exactly what
  ``model.load_state_dict(torch.load(path))`` takes);
* ``safetensors``: the tensors only, keyed by their path in the state joined with dots
  (``model.fc1.weight``, ``optimizer.state.0.momentum_buffer``); with one part, the part's own
  keys (``fc1.weight``: ``model.load_state_dict(safetensors.torch.load_file(path))``). What is
  not a tensor (hyper-parameters, step counts, a scheduler's state) goes into the file's
  metadata as JSON under ``ftmesh``, with the step under ``ftmesh_step``. The file is written
  here, byte for byte as the format specifies (an 8-byte little-endian header length, a JSON
  header, the raw little-endian tensor bytes), so exporting needs no extra package.

A sharded checkpoint keeps the gathered optimizer state in the scalars (``scalars.zero``, one
flat vector per state key): it is exported as it is.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import LocalUsageError
from .checkpoint import _atomic_write, latest_valid_checkpoint, load_checkpoint
from .snapshot import KIND_NUMPY, Ref, Snapshot, numpy_dtype

FORMATS = ("torch", "safetensors")

_SAFETENSORS_DTYPES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
}
_NUMPY_TO_TORCH = {
    "f8": "float64",
    "f4": "float32",
    "f2": "float16",
    "i8": "int64",
    "i4": "int32",
    "i2": "int16",
    "i1": "int8",
    "u1": "uint8",
    "b1": "bool",
}


@dataclass(frozen=True, slots=True)
class Exported:
    path: Path
    step: int
    parts: tuple[str, ...]
    tensors: int
    nbytes: int


def _parts(snap: Snapshot) -> dict[str, Any]:
    """Every part's tree (refs in place of tensors), and the scalars."""
    out: dict[str, Any] = {name: tree for name, (_, tree) in snap.trees["objects"].items()}
    out.update(snap.trees["arrays"])
    if snap.trees["scalars"]:
        out["scalars"] = snap.trees["scalars"]
    return out


def _walk(node: Any, path: str) -> Iterator[tuple[str, Ref]]:
    if isinstance(node, Ref):
        yield path, node
    elif isinstance(node, dict):
        for k, v in node.items():
            yield from _walk(v, f"{path}.{k}" if path else str(k))
    elif isinstance(node, list | tuple):
        for i, v in enumerate(node):
            yield from _walk(v, f"{path}.{i}" if path else str(i))


def _plain(node: Any) -> Any:
    """The tree with tensors replaced by a marker (for the metadata)."""
    if isinstance(node, Ref):
        return {"tensor": node.name}
    if isinstance(node, dict):
        return {str(k): _plain(v) for k, v in node.items()}
    if isinstance(node, list | tuple):
        return [_plain(v) for v in node]
    if isinstance(node, bytes):
        return node.hex()
    return node


def _torch_dtype(snap: Snapshot, ref: Ref) -> str:
    e = snap.entry(ref.name)
    if ref.kind == KIND_NUMPY:
        np_dt = numpy_dtype(e.dtype)
        key = f"{np_dt.kind}{np_dt.itemsize}"
        if key not in _NUMPY_TO_TORCH or np_dt.byteorder == ">":
            raise LocalUsageError(f"{ref.name}: a {np_dt} array has no safetensors dtype")
        return _NUMPY_TO_TORCH[key]
    return e.dtype


def _materialize(snap: Snapshot, node: Any) -> Any:
    if isinstance(node, Ref):
        if node.kind == KIND_NUMPY:
            return _as_tensor(snap, node)
        return snap.tensor(node.name).clone()
    if isinstance(node, dict):
        return {k: _materialize(snap, v) for k, v in node.items()}
    if isinstance(node, list):
        return [_materialize(snap, v) for v in node]
    if isinstance(node, tuple):
        return tuple(_materialize(snap, v) for v in node)
    return node


def _as_tensor(snap: Snapshot, ref: Ref) -> Any:
    import torch

    return torch.from_numpy(snap.numpy(ref.name).copy())


def export_checkpoint(
    source: str | Path, out: str | Path, *, fmt: str | None = None, part: str | None = None
) -> Exported:
    """Export the checkpoint ``source`` (a checkpoint file, or a directory: its newest valid
    one) to ``out`` in ``fmt`` (default: from ``out``'s suffix, ``.safetensors`` or torch);
    ``part``: one part only (``model``)."""
    src, dest = Path(source), Path(out)
    if src.is_dir():
        found = latest_valid_checkpoint(src)
        if found is None:
            raise LocalUsageError(f"no valid checkpoint in {src}")
    elif src.exists():
        found = load_checkpoint(src)
    else:
        raise LocalUsageError(f"{src}: no such checkpoint file or directory")
    fmt = fmt or ("safetensors" if dest.suffix == ".safetensors" else "torch")
    if fmt not in FORMATS:
        raise LocalUsageError(f"format must be one of {FORMATS}, got {fmt!r}")
    snap = found.snapshot
    parts = _parts(snap)
    if part is not None:
        if part not in parts:
            raise LocalUsageError(f"the checkpoint has no part {part!r}; it has {sorted(parts)}")
        parts = {part: parts[part]}
    refs = []
    for name, tree in parts.items():
        for path, ref in _walk(tree, ""):
            key = path if part is not None else ".".join(x for x in (name, path) if x)
            refs.append((key or name, ref))
    nbytes = sum(snap.entry(r.name).nbytes for _, r in refs)
    dest.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "torch":
        import io

        import torch

        if part is not None:
            obj: Any = _materialize(snap, parts[part])
        else:
            obj = {"step": snap.step, **{k: _materialize(snap, v) for k, v in parts.items()}}
        buf = io.BytesIO()
        torch.save(obj, buf)
        _atomic_write(dest, [buf.getvalue()])
    else:
        _write_safetensors(dest, snap, refs, parts)
    return Exported(dest, snap.step, tuple(sorted(parts)), len(refs), nbytes)


def _write_safetensors(
    dest: Path, snap: Snapshot, refs: list[tuple[str, Ref]], parts: dict[str, Any]
) -> None:
    header: dict[str, Any] = {}
    offset = 0
    chunks: list[bytes] = []
    for key, ref in refs:
        e = snap.entry(ref.name)
        dtype = _torch_dtype(snap, ref)
        if dtype not in _SAFETENSORS_DTYPES:
            raise LocalUsageError(f"{key}: {dtype} has no safetensors dtype")
        data = np.ascontiguousarray(snap.raw(ref.name)).tobytes()
        header[key] = {
            "dtype": _SAFETENSORS_DTYPES[dtype],
            "shape": list(e.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        offset += len(data)
        chunks.append(data)
    header["__metadata__"] = {
        "format": "pt",
        "ftmesh_step": str(snap.step),
        "ftmesh": json.dumps({k: _plain(v) for k, v in parts.items()}, sort_keys=True),
    }
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the tensor bytes start 8-byte aligned
    _atomic_write(dest, [struct.pack("<Q", len(text)), text, *chunks])
