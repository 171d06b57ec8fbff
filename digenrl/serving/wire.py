"""Task results on the wire: their tensors and arrays as raw buffers, the rest as plain data.

Dask moves a result from one worker to another (and spills it to disk) with the
serializer its type registers in the "dask" family, before falling back to pickle. Every
class passed to :func:`register` is written as

* a header of plain data, which Dask packs with MessagePack: the class's name and its
  fields, where numbers, strings, None, lists, tuples and str-keyed dicts stay as they
  are (tagged, so a tuple comes back a tuple) and nested registered classes nest;
* the bytes of each ``torch.Tensor`` or ``np.ndarray``: a frame of its own, as they lie
  in memory, where it holds more than :data:`PACKED_BYTES`; the smaller ones copied one
  after another into one shared frame, each at an offset aligned to :data:`ALIGN` bytes
  (Dask handles every frame in Python on both sides: the default model's 234 weight
  tensors travel in 49 frames). The header gives each one's dtype, shape, and frame or
  offset.

Reading it back builds only registered classes, tensors and arrays of numeric dtypes
(bfloat16 and float16 included) with the exact shape and bytes that were sent: no field,
tensor or nested value is unpickled. (Dask's own envelope names the class by a pickled
reference, which it loads to find this reader.) A tensor takes the received frame as its
memory (its part of the shared frame) where the frame is writable and starts where torch
would place a tensor (:data:`ALIGN`), and a copy of the frame, made once, where not.

Tensors must be on the CPU: task results return there before they travel.
"""

from __future__ import annotations

import math
from dataclasses import fields, is_dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from distributed.protocol import dask_deserialize, dask_serialize

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = ["register", "encode", "decode"]

#: The classes a header may name, by name (filled by :func:`register`).
_CLASSES: dict[str, type[DataclassInstance]] = {}

#: The tensor dtypes that travel, by the name the header gives them.
TORCH_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64,
    torch.complex128, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
    torch.bool)}
_TORCH_NAMES = {d: name for name, d in TORCH_DTYPES.items()}

#: The kinds of NumPy dtype that travel: booleans, integers, floats, complex numbers.
NUMPY_KINDS = "biufc"

_SCALARS = (bool, int, float, str, type(None))

#: A tensor or array of at most this many bytes travels in the value's shared frame;
#: larger ones in a frame of their own, as they lie in memory (copying them too into the
#: shared frame, new memory, cost more than the frames it saved).
PACKED_BYTES = 1 << 16
#: Where each buffer starts in the shared frame, and where a received frame must start
#: to be used as it is (else it is copied): a multiple of this many bytes, torch's own
#: alignment of a CPU tensor's memory.
ALIGN = 64


def register(*classes: type) -> None:
    """Send ``classes`` (dataclasses) as plain data and buffers whenever Dask moves one,
    alone or nested in another registered class."""
    for cls in classes:
        if not is_dataclass(cls) or _CLASSES.get(cls.__name__, cls) is not cls:
            raise TypeError(f"wire.register: expected dataclasses with distinct names, got "
                            f"{cls!r}")
        _CLASSES[cls.__name__] = cls
        dask_serialize.register(cls)(encode)
        dask_deserialize.register(cls)(partial(decode, expected=cls))


# ------------------------------------------------------------------------------ write

class _Frames:
    """The frames of one value: large buffers as they are, small ones into one shared
    frame (the last), made by :meth:`close`."""

    def __init__(self) -> None:
        self.frames: list[memoryview] = []
        self.small: list[tuple[int, np.ndarray]] = []  # (offset, bytes)
        self.end = 0  # the shared frame's length so far

    def add(self, raw: np.ndarray) -> dict:
        """Where the uint8 array ``raw`` travels, as the header names it."""
        if raw.nbytes > PACKED_BYTES:
            self.frames.append(raw.data)     # (its memoryview)
            return {"frame": len(self.frames) - 1}
        offset = -(-self.end // ALIGN) * ALIGN
        self.small.append((offset, raw))
        self.end = offset + raw.nbytes
        return {"packed": offset}

    def close(self) -> int | None:
        """Append the shared frame; its index (None without small buffers)."""
        if not self.small:
            return None
        shared = np.empty(self.end, dtype=np.uint8)
        for offset, raw in self.small:
            shared[offset:offset + raw.nbytes] = raw
        self.frames.append(shared.data)
        return len(self.frames) - 1


def encode(value: Any) -> tuple[dict, list[memoryview]]:
    """The header (plain data) and frames of ``value``."""
    frames = _Frames()
    header = {"value": _encode(value, frames, type(value).__name__)}
    shared = frames.close()
    if shared is not None:
        header["shared"] = shared
    return header, frames.frames


def _encode(v: Any, frames: _Frames, where: str) -> Any:
    if type(v) in _SCALARS:
        return v
    if isinstance(v, np.generic) and v.dtype.kind in NUMPY_KINDS:
        return v.item()  # a NumPy number travels as the Python number it equals
    if isinstance(v, torch.Tensor):
        return {"tensor": _tensor_frame(v, frames, where)}
    if isinstance(v, np.ndarray):
        return {"array": _array_frame(v, frames, where)}
    if _CLASSES.get(type(v).__name__) is type(v):
        return {"type": type(v).__name__,
                "fields": {f.name: _encode(getattr(v, f.name), frames, f"{where}.{f.name}")
                           for f in fields(v)}}
    if type(v) in (list, tuple):
        return {type(v).__name__: [_encode(x, frames, f"{where}[{i}]")
                                   for i, x in enumerate(v)]}
    if type(v) is dict and all(type(k) is str for k in v):
        return {"dict": {k: _encode(x, frames, f"{where}[{k!r}]") for k, x in v.items()}}
    raise TypeError(f"{where}: expected a tensor, an array, a number, a string, None, a "
                    f"list, a tuple, a dict with str keys or one of {sorted(_CLASSES)}, "
                    f"got {type(v).__qualname__}")


def _tensor_frame(t: torch.Tensor, frames: _Frames, where: str) -> dict:
    if t.device.type != "cpu" or t.layout is not torch.strided:
        raise TypeError(f"{where}: expected a dense tensor on the CPU (task results return "
                        f"there before they travel), got a {t.layout} tensor on {t.device}")
    if t.dtype not in _TORCH_NAMES:
        raise TypeError(f"{where}: expected a tensor of dtype {sorted(TORCH_DTYPES)}, "
                        f"got {t.dtype}")
    flat = t.detach().contiguous().reshape(-1)
    return {**frames.add(flat.view(torch.uint8).numpy()), "dtype": _TORCH_NAMES[t.dtype],
            "shape": list(t.shape)}


def _array_frame(a: np.ndarray, frames: _Frames, where: str) -> dict:
    if a.dtype.kind not in NUMPY_KINDS or a.dtype.fields is not None:
        raise TypeError(f"{where}: expected an array of booleans or numbers, got dtype "
                        f"{a.dtype}")
    flat = np.ascontiguousarray(a).reshape(-1)
    return {**frames.add(flat.view(np.uint8)), "dtype": a.dtype.str, "shape": list(a.shape)}


# ------------------------------------------------------------------------------- read

def decode(header: dict, frames: list, expected: type | None = None) -> Any:
    """The value :func:`encode` wrote (``expected``: the class it must be).

    Raises ValueError, in one line naming the place, what was expected and what arrived,
    for a header this module did not write or one naming an unregistered class."""
    where = expected.__name__ if expected is not None else "value"
    if not isinstance(header, dict) or "value" not in header:
        raise ValueError(f"wire: {where}: expected a header with a 'value', got "
                         f"{_brief(header)}")
    shared = header.get("shared")
    if shared is not None and (type(shared) is not int or not 0 <= shared < len(frames)):
        raise ValueError(f"wire: {where}: expected the shared frame's index below "
                         f"{len(frames)}, got {shared!r}")
    value = _decode(header["value"], _Received(frames, shared), where)
    if expected is not None and type(value) is not expected:
        raise ValueError(f"wire: expected a {expected.__name__}, got a header holding a "
                         f"{type(value).__name__}")
    return value


def _decode(node: Any, frames: _Received, where: str) -> Any:
    if type(node) in _SCALARS:
        return node
    if isinstance(node, dict) and set(node) == {"type", "fields"}:
        return _decode_object(node["type"], node["fields"], frames, where)
    tag, body = None, None
    if isinstance(node, dict) and len(node) == 1:  # {tag: body}
        ((tag, body),) = node.items()
    if tag in ("list", "tuple") and isinstance(body, (list, tuple)):
        items = [_decode(x, frames, f"{where}[{i}]") for i, x in enumerate(body)]
        return items if tag == "list" else tuple(items)
    if tag == "dict" and isinstance(body, dict) and all(type(k) is str for k in body):
        return {k: _decode(x, frames, f"{where}[{k!r}]") for k, x in body.items()}
    if tag == "tensor" and isinstance(body, dict):
        dtype = _lookup(TORCH_DTYPES, body.get("dtype"), f"{where}: tensor dtype")
        raw = frames.buffer(body, dtype.itemsize, where)
        if not raw.size:  # nothing to view as the dtype
            return torch.empty(tuple(body["shape"]), dtype=dtype)
        return torch.from_numpy(raw).view(dtype).reshape(tuple(body["shape"]))
    if tag == "array" and isinstance(body, dict):
        dtype = _numpy_dtype(body.get("dtype"), where)
        raw = frames.buffer(body, dtype.itemsize, where)
        return raw.view(dtype).reshape(tuple(body["shape"]))
    raise ValueError(f"wire: {where}: expected a number, string, None, list, tuple, dict, "
                     f"tensor, array or registered class, got {_brief(node)}")


def _decode_object(name: Any, values: Any, frames: _Received, where: str) -> Any:
    cls = _lookup(_CLASSES, name, f"{where}: class")
    names = {f.name for f in fields(cls)}
    if not isinstance(values, dict) or set(values) != names:
        got = sorted(values, key=str) if isinstance(values, dict) else _brief(values)
        raise ValueError(f"wire: {where}: expected the fields {sorted(names)} of {name}, "
                         f"got {got}")
    return cls(**{k: _decode(v, frames, f"{where}.{k}") for k, v in values.items()})


def _lookup(table: dict, name: Any, what: str) -> Any:
    if not isinstance(name, str) or name not in table:
        raise ValueError(f"wire: {what}: expected one of {sorted(table)}, got {name!r}")
    return table[name]


def _numpy_dtype(name: Any, where: str) -> np.dtype:
    try:
        dtype = np.dtype(name) if isinstance(name, str) else None
    except TypeError:
        dtype = None
    if dtype is None or dtype.kind not in NUMPY_KINDS or dtype.fields is not None:
        raise ValueError(f"wire: {where}: array dtype: expected a boolean or numeric NumPy "
                         f"dtype, got {name!r}")
    return dtype


class _Received:
    """The frames of a received value, and which of them is the shared one."""

    def __init__(self, frames: list, shared: int | None):
        self.frames, self.shared = frames, shared
        self._placed: dict[int, np.ndarray] = {}

    def frame(self, index: int) -> np.ndarray:
        """Frame ``index`` as writable bytes starting on an :data:`ALIGN`-byte boundary:
        the received memory where it is both, else a copy (once per frame) in memory
        torch allocates."""
        placed = self._placed.get(index)
        if placed is None:
            placed = np.frombuffer(self.frames[index], dtype=np.uint8)
            if not placed.flags.writeable or placed.ctypes.data % ALIGN:
                placed = _torch_bytes(placed)
            self._placed[index] = placed
        return placed

    def buffer(self, body: dict, itemsize: int, where: str) -> np.ndarray:
        """The bytes of one tensor or array as a writable uint8 array starting on an
        :data:`ALIGN`-byte boundary (see :func:`_torch_bytes` for why)."""
        shape = body.get("shape")
        if not isinstance(shape, (list, tuple)) or not all(type(n) is int and n >= 0
                                                           for n in shape):
            raise ValueError(f"wire: {where}: expected a shape of non-negative ints, got "
                             f"{shape!r}")
        size = math.prod(shape) * itemsize
        if "packed" in body:
            offset, frame = body["packed"], self.shared
            if frame is None or type(offset) is not int or offset < 0 or offset % ALIGN:
                raise ValueError(f"wire: {where}: expected an offset in the shared frame "
                                 f"(a multiple of {ALIGN}), got {offset!r} (shared frame: "
                                 f"{frame!r})")
            raw = self.frame(frame)
            if offset + size > raw.size:
                raise ValueError(f"wire: {where}: expected {size} bytes for shape "
                                 f"{list(shape)} at offset {offset}, got a shared frame "
                                 f"of {raw.size}")
            return raw[offset:offset + size]
        index = body.get("frame")
        if type(index) is not int or not 0 <= index < len(self.frames):
            raise ValueError(f"wire: {where}: expected a frame index below "
                             f"{len(self.frames)}, got {index!r}")
        raw = self.frame(index)
        if raw.size != size:
            raise ValueError(f"wire: {where}: expected {size} bytes for shape "
                             f"{list(shape)}, got a frame of {raw.size}")
        return raw


def _torch_bytes(raw: np.ndarray) -> np.ndarray:
    """A copy of ``raw`` where torch puts a tensor's memory: on an :data:`ALIGN`-byte
    boundary. A received tensor must lie where a tensor made on the worker would: the
    CPU's small matrix products give other bits for an input that starts off a 16-byte
    boundary (a linear layer of 8 inputs and 2 rows, ``tests/test_wire.py``), so a
    result read from a frame that Dask received at such an address would differ from
    the same result computed on the worker."""
    placed = torch.empty(raw.size, dtype=torch.uint8).numpy()
    placed[...] = raw
    return placed


def _brief(x: Any) -> str:
    text = repr(x)
    return text if len(text) <= 80 else text[:77] + "..."
