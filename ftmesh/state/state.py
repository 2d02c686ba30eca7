"""``State``: the training state of one member, with commit / restore / digest.

Theory of operation: the user registers what makes up the training state by name; ``commit()``
walks it, copies every tensor and array into one preallocated arena (a ``Snapshot``), and keeps
that snapshot as *the* committed state (only the last one). ``restore()`` copies the committed
snapshot back into the live objects; ``load_snapshot()`` does the same from a snapshot fetched
from a peer (a joiner, or a survivor that is behind) and adopts it as committed.

Commits are double-buffered: the snapshot of commit *k* is written into the arena of commit
*k-2* when the layout (names, dtypes, shapes) is unchanged and nobody holds a ``lease()`` on
it, so steady-state commits allocate nothing and cost one ``memcpy`` of the state. A snapshot
handed out stays valid until the second commit after it (then ``StaleSnapshotError``); hold
``snapshot.lease()`` to keep it longer (state servers and checkpoint writers do).

What a snapshot includes:

* every registered object with ``state_dict()``/``load_state_dict()`` — ``torch.nn.Module``
  (parameters and persistent buffers), ``torch.optim.Optimizer`` (per-parameter state and
  ``param_groups`` hyper-parameters), and any other such object (LR schedulers, AMP scalers);
* registered NumPy arrays (plain numeric/bool dtypes), by name;
* ``step`` (an int the caller owns; ``commit(step=...)`` sets it);
* ``scalars``: a dict of user values — None, bool, int, float, str, bytes, lists, tuples,
  dicts with str/int keys, tensors and arrays (NumPy scalars are stored as Python scalars);
* with ``rng=True`` (default): the Python ``random`` state, the NumPy *global* (legacy)
  generator state and the torch CPU default generator state (when torch is imported: the
  state layer never imports torch itself).

What it does not include: CUDA generator states, ``numpy.random.Generator`` objects the user
created (put ``gen.bit_generator.state`` in ``scalars``), gradients (``.grad``), non-persistent
module buffers, data-loader position (put it in ``scalars``), anything not registered. CUDA
tensors are copied to host memory on commit and back to their device on restore.

Set ``rng=False`` when members deliberately run different random streams (e.g. per-rank data
augmentation) but should still compare equal by digest.

Not thread-safe: call from the training loop's thread.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Mapping
from typing import Any

import blake3
import msgpack
import numpy as np

from ..errors import LocalUsageError
from .errors import NoCommittedStateError, StateMismatchError
from .memory import populated_zeros
from .snapshot import (
    _TORCH_DTYPES,
    EXT_NUMPY_REF,
    EXT_TORCH_REF,
    EXT_TUPLE,
    KIND_NUMPY,
    KIND_TORCH,
    Entry,
    Ref,
    Snapshot,
    align,
    build_prefix,
    encode_header,
    numpy_dtype,
)

_NUMPY_KINDS = "biufc"
_MAX_DEPTH = 64

OBJ_MODULE = "module"
OBJ_STATEFUL = "stateful"


def _torch() -> Any:
    return sys.modules.get("torch")


def _is_tensor(x: object) -> bool:
    torch = _torch()
    return torch is not None and isinstance(x, torch.Tensor)


def _is_module(x: object) -> bool:
    torch = _torch()
    return torch is not None and isinstance(x, torch.nn.Module)


def _check_array(name: str, arr: np.ndarray[Any, Any]) -> None:
    if arr.dtype.kind not in _NUMPY_KINDS or arr.dtype.fields is not None:
        raise LocalUsageError(f"array {name!r}: unsupported dtype {arr.dtype} (plain numeric only)")


def _tensor_dtype(name: str, t: Any) -> str:
    torch = _torch()
    if t.layout != torch.strided or t.is_quantized:
        raise LocalUsageError(f"tensor {name!r}: only dense (strided) tensors can be stored")
    dt = str(t.dtype).removeprefix("torch.")
    if dt not in _TORCH_DTYPES:
        raise LocalUsageError(f"tensor {name!r}: unsupported dtype {t.dtype}")
    return dt


class _Encoder:
    """Turns a nested state into a msgpack-ready tree, collecting tensors/arrays as leaves."""

    def __init__(self) -> None:
        self.leaves: dict[str, Any] = {}

    def encode(self, obj: Any, path: str, depth: int = 0) -> Any:
        if depth > _MAX_DEPTH:
            raise LocalUsageError(f"{path}: nested deeper than {_MAX_DEPTH}")
        if obj is None or isinstance(obj, bool | str | bytes):
            return obj
        if isinstance(obj, int):
            if not -(2**63) <= obj < 2**64:
                raise LocalUsageError(f"{path}: int {obj} does not fit in 64 bits")
            return int(obj)
        if isinstance(obj, float):
            return float(obj)
        if _is_tensor(obj):
            _tensor_dtype(path, obj)
            return self._leaf(path, obj, EXT_TORCH_REF)
        if isinstance(obj, np.ndarray):
            _check_array(path, obj)
            return self._leaf(path, obj, EXT_NUMPY_REF)
        if isinstance(obj, np.generic):
            return self.encode(obj.item(), path, depth + 1)
        if isinstance(obj, Mapping):
            for k in obj:
                if isinstance(k, bool) or not isinstance(k, str | int):
                    raise LocalUsageError(f"{path}: dict key {k!r} is not a str or int")
            keys = sorted(obj, key=lambda k: (isinstance(k, str), k))
            return {k: self.encode(obj[k], f"{path}/{k}", depth + 1) for k in keys}
        if isinstance(obj, list):
            return [self.encode(v, f"{path}/{i}", depth + 1) for i, v in enumerate(obj)]
        if isinstance(obj, tuple):
            items = [self.encode(v, f"{path}/{i}", depth + 1) for i, v in enumerate(obj)]
            return msgpack.ExtType(EXT_TUPLE, msgpack.packb(items, use_bin_type=True))
        raise LocalUsageError(f"{path}: cannot store a {type(obj).__name__}")

    def _leaf(self, path: str, obj: Any, code: int) -> msgpack.ExtType:
        if path in self.leaves:
            raise LocalUsageError(f"two tensors map to the same name {path!r}")
        self.leaves[path] = obj
        return msgpack.ExtType(code, path.encode())


def _materialize(node: Any, snap: Snapshot, *, clone: bool) -> Any:
    """Rebuild a decoded tree: refs become tensors/arrays (views into the snapshot, or copies)."""
    if isinstance(node, Ref):
        if node.kind == KIND_TORCH:
            t = snap.tensor(node.name)
            return t.clone() if clone else t
        arr = snap.numpy(node.name)
        return arr.copy() if clone else arr
    if isinstance(node, dict):
        return {k: _materialize(v, snap, clone=clone) for k, v in node.items()}
    if isinstance(node, list):
        return [_materialize(v, snap, clone=clone) for v in node]
    if isinstance(node, tuple):
        return tuple(_materialize(v, snap, clone=clone) for v in node)
    return node


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not name or "/" in name:
        raise LocalUsageError(f"state names must be non-empty strings without '/': {name!r}")


class State:
    """The training state of one member. See the module docstring for what is included.

    ``State(model=model, optimizer=opt, arrays={"ema": ema}, scalars={"epoch": 0})``; more
    can be added with ``register(name, obj)`` before the first commit.
    """

    def __init__(
        self,
        *,
        step: int = 0,
        arrays: Mapping[str, np.ndarray[Any, Any]] | None = None,
        scalars: Mapping[str, Any] | None = None,
        rng: bool = True,
        **objects: Any,
    ) -> None:
        self.step = step
        """The step counter; captured by ``commit()`` and set back by ``restore()``."""
        self.rng = rng
        self.arrays: dict[str, np.ndarray[Any, Any]] = {}
        self.scalars: dict[str, Any] = dict(scalars or {})
        """User values captured with the state (epoch, data position...). Mutate freely."""
        self._objects: dict[str, Any] = {}
        self._committed: Snapshot | None = None
        self._spare: Snapshot | None = None
        for name, obj in objects.items():
            self.register(name, obj)
        for name, arr in (arrays or {}).items():
            self.register(name, arr)

    # -- registration ----------------------------------------------------------------------
    def register(self, name: str, obj: Any) -> None:
        """Add a NumPy array, or an object with ``state_dict()``/``load_state_dict()``."""
        _check_name(name)
        if name in self._objects or name in self.arrays:
            raise LocalUsageError(f"{name!r} is already registered")
        if isinstance(obj, np.ndarray):
            _check_array(name, obj)
            self.arrays[name] = obj
        elif callable(getattr(obj, "state_dict", None)) and callable(
            getattr(obj, "load_state_dict", None)
        ):
            self._objects[name] = obj
        else:
            raise LocalUsageError(
                f"{name!r}: register NumPy arrays or objects with state_dict/load_state_dict"
            )

    @property
    def names(self) -> list[str]:
        return sorted([*self._objects, *self.arrays])

    @property
    def objects(self) -> dict[str, Any]:
        """The registered objects by name (a copy of the mapping)."""
        return dict(self._objects)

    # -- capture ---------------------------------------------------------------------------
    def commit(self, step: int | None = None) -> Snapshot:
        """Capture the live state as the committed snapshot (replacing the previous one)."""
        if step is not None:
            self.step = step
        snap = self._capture(reuse=True)
        old, self._committed = self._committed, snap
        if old is not None and getattr(old, "_owner", None) is self:
            self._spare = old
        return snap

    def snapshot(self) -> Snapshot:
        """Capture the live state into fresh buffers without committing (never reused)."""
        return self._capture(reuse=False)

    @property
    def committed(self) -> Snapshot | None:
        return self._committed

    @property
    def committed_step(self) -> int | None:
        return None if self._committed is None else self._committed.step

    def digest(self) -> str:
        """Content hash of the committed snapshot (hex)."""
        return self._require_committed().digest

    def live_digest(self) -> str:
        """Content hash of the live state (costs one full copy)."""
        return self.snapshot().digest

    def part_digests(self) -> dict[str, str]:
        """A content hash (hex) of each registered object and array of the live state, copying
        nothing: members compare them part by part to say *what* differs. Not the snapshot's
        digest (that one covers the whole blob, ``scalars`` and the step included)."""
        out: dict[str, str] = {}
        for name in self.names:
            enc = _Encoder()
            if name in self._objects:
                tree = enc.encode(self._objects[name].state_dict(), f"o/{name}")
            else:
                tree = enc.encode(self.arrays[name], f"a/{name}")
            out[name] = _tree_digest(tree, enc.leaves)
        return out

    def scalars_digest(self) -> str:
        """A content hash (hex) of ``scalars`` (see :meth:`part_digests`)."""
        enc = _Encoder()
        return _tree_digest(enc.encode(self.scalars, "s"), enc.leaves)

    def to_bytes_parts(self) -> list[memoryview]:
        """Serialised committed snapshot, as ``[prefix, arena]`` memoryviews (no copy)."""
        return self._require_committed().to_bytes_parts()

    def _require_committed(self) -> Snapshot:
        if self._committed is None:
            raise NoCommittedStateError("nothing committed yet: call commit() first")
        return self._committed

    def nbytes(self) -> int:
        """The size of the snapshot ``commit()`` would make now, copying nothing."""
        _, _, arena_bytes, prefix = self._layout()
        return len(prefix) + arena_bytes

    def _layout(self) -> tuple[_Encoder, list[Entry], int, bytes]:
        """Walk the live state (no copy): its leaves, where each goes in the arena, the
        arena's size, and the snapshot's prefix."""
        enc = _Encoder()
        objects: dict[str, Any] = {}
        for name in sorted(self._objects):
            obj = self._objects[name]
            tag = OBJ_MODULE if _is_module(obj) else OBJ_STATEFUL
            objects[name] = [tag, enc.encode(obj.state_dict(), f"o/{name}")]
        arrays = {name: enc.encode(self.arrays[name], f"a/{name}") for name in sorted(self.arrays)}
        scalars = enc.encode(self.scalars, "s")
        rng = enc.encode(_capture_rng(), "r") if self.rng else None
        trees = {"arrays": arrays, "objects": objects, "rng": rng, "scalars": scalars}

        entries: list[Entry] = []
        offset = 0
        for name in sorted(enc.leaves):
            src = enc.leaves[name]
            if isinstance(src, np.ndarray):
                kind, dtype, shape = KIND_NUMPY, src.dtype.str, tuple(src.shape)
                nbytes = src.nbytes
            else:
                kind, dtype, shape = KIND_TORCH, _tensor_dtype(name, src), tuple(src.shape)
                nbytes = src.numel() * src.element_size()
            entries.append(Entry(name, kind, dtype, shape, offset, nbytes))
            offset = align(offset + nbytes)
        return enc, entries, offset, build_prefix(encode_header(self.step, entries, trees))

    def _capture(self, *, reuse: bool) -> Snapshot:
        enc, entries, arena_bytes, prefix = self._layout()
        layout = tuple((e.name, e.kind, e.dtype, e.shape) for e in entries)

        arena: np.ndarray[Any, np.dtype[np.uint8]] | None = None
        spare = self._spare
        if reuse and spare is not None and not spare.leased and spare._layout == layout:
            spare._mark_stale()
            arena, self._spare = spare._arena, None
        if arena is None:
            arena = populated_zeros(arena_bytes)

        for e in entries:
            src = enc.leaves[e.name]
            dst = arena[e.offset : e.offset + e.nbytes]
            if e.kind == KIND_NUMPY:
                np.copyto(dst.view(numpy_dtype(e.dtype)).reshape(e.shape), src)
            else:
                torch = _torch()
                with torch.no_grad():
                    view = torch.from_numpy(dst).view(getattr(torch, e.dtype)).view(e.shape)
                    view.copy_(src.detach())

        snap = Snapshot.from_buffer_parts(prefix, arena)
        snap._layout = layout
        if reuse:
            snap._owner = self
        return snap

    # -- apply -----------------------------------------------------------------------------
    def restore(self) -> int:
        """Roll every live object back to the committed snapshot. Returns its step."""
        snap = self._require_committed()
        self._apply(snap)
        return snap.step

    def load_snapshot(self, snapshot: Snapshot) -> None:
        """Adopt ``snapshot`` (e.g. fetched from a peer): apply it to the live objects and make
        it the committed state. Its buffers are never reused by later commits."""
        self._apply(snapshot)
        self._committed = snapshot

    def _apply(self, snap: Snapshot) -> None:
        objects = snap.trees["objects"]
        arrays = snap.trees["arrays"]
        if set(objects) != set(self._objects) or set(arrays) != set(self.arrays):
            raise StateMismatchError(
                f"snapshot holds objects {sorted(objects)} and arrays {sorted(arrays)}; "
                f"this State has {sorted(self._objects)} and {sorted(self.arrays)}"
            )
        for name, ref in arrays.items():
            if not isinstance(ref, Ref) or ref.kind != KIND_NUMPY:
                raise StateMismatchError(f"array {name!r} is not stored as an array")
        for name, obj in self._objects.items():
            tag, tree = objects[name]
            is_module = _is_module(obj)
            if is_module != (tag == OBJ_MODULE):
                raise StateMismatchError(f"{name!r}: snapshot holds a {tag}")
            # Modules copy into their own parameters; other objects may keep what they are
            # given (optimizers alias same-dtype tensors), so they get private copies.
            sd = _materialize(tree, snap, clone=not is_module)
            try:
                if is_module:
                    obj.load_state_dict(sd, strict=True)
                else:
                    obj.load_state_dict(sd)
            except (RuntimeError, ValueError, KeyError) as exc:
                raise StateMismatchError(f"{name!r}: {exc}") from exc
        for name, ref in arrays.items():
            src = snap.numpy(ref.name)
            live = self.arrays[name]
            if live.shape == src.shape and live.dtype == src.dtype and live.flags.writeable:
                np.copyto(live, src)
            else:
                self.arrays[name] = src.copy()
        self.scalars.clear()
        self.scalars.update(_materialize(snap.trees["scalars"], snap, clone=True))
        rng = snap.trees["rng"]
        if self.rng and rng is not None:
            _apply_rng(_materialize(rng, snap, clone=True))
        self.step = snap.step


def _tree_digest(tree: Any, leaves: Mapping[str, Any]) -> str:
    """BLAKE3 over a part's encoded tree and its leaves' raw bytes (sorted by name)."""
    h = blake3.blake3(msgpack.packb(tree, use_bin_type=True))
    for name in sorted(leaves):
        leaf = leaves[name]
        h.update(name.encode())
        h.update(_raw_bytes(leaf))
    return str(h.hexdigest())


def _raw_bytes(leaf: Any) -> memoryview:
    """The bytes of a tensor or array without a copy where it is contiguous in host memory
    (a tensor on another device is copied to the host)."""
    if isinstance(leaf, np.ndarray):
        return np.ascontiguousarray(leaf).reshape(-1).view(np.uint8).data
    torch = _torch()
    t = leaf.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    flat = t.contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    raw: np.ndarray[Any, np.dtype[np.uint8]] = flat.view(torch.uint8).numpy()
    return raw.data


def _capture_rng() -> dict[str, Any]:
    out: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(legacy=False),
    }
    torch = _torch()
    if torch is not None:
        out["torch"] = torch.get_rng_state()
    return out


def _apply_rng(rng: dict[str, Any]) -> None:
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch = _torch()
    if torch is not None and "torch" in rng:
        torch.set_rng_state(rng["torch"])
