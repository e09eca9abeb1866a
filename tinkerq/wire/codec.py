"""msgpack encoding with numpy arrays as an ExtType; the serializer Celery is restricted to.

An array travels as ``ExtType(ARRAY_EXT, header + raw bytes)`` where the header is
``<dtype code: u8><ndim: u8><shape: ndim x u64 little-endian>``. Only the dtypes in
:data:`ARRAY_DTYPES` are accepted, the byte count must match the shape exactly, and decoding is a
zero-copy ``np.frombuffer`` view (read-only: copy before writing). Nothing here ever unpickles.
"""

from __future__ import annotations

import datetime as _dt
import struct
import uuid
from typing import Any

import msgpack
import numpy as np
from kombu.serialization import register

from tinkerq.errors import MalformedMessageError

CONTENT_TYPE = "application/x-tinkerq-msgpack"
SERIALIZER_NAME = "tinkerq-msgpack"

ARRAY_EXT = 1
MAX_NDIM = 8

# code <-> dtype; little-endian only, so a message means the same on every host.
ARRAY_DTYPES: dict[int, np.dtype] = {
    1: np.dtype("<i8"),
    2: np.dtype("<i4"),
    3: np.dtype("<i2"),
    4: np.dtype("i1"),
    5: np.dtype("u1"),
    6: np.dtype("<f4"),
    7: np.dtype("<f8"),
    8: np.dtype("<f2"),
    9: np.dtype("?"),
}
_CODE_BY_DTYPE = {dt: code for code, dt in ARRAY_DTYPES.items()}


def _encode_array(array: np.ndarray) -> msgpack.ExtType:
    dtype = array.dtype.newbyteorder("<") if array.dtype.byteorder == ">" else array.dtype
    code = _CODE_BY_DTYPE.get(dtype)
    if code is None:
        raise MalformedMessageError(
            f"arrays of dtype {array.dtype} cannot travel on the wire; "
            f"use one of {sorted(str(d) for d in ARRAY_DTYPES.values())}"
        )
    if array.ndim > MAX_NDIM:
        raise MalformedMessageError(f"arrays may have at most {MAX_NDIM} dimensions, got {array.ndim}")
    array = np.ascontiguousarray(array, dtype=dtype)
    header = struct.pack(f"<BB{array.ndim}Q", code, array.ndim, *array.shape)
    return msgpack.ExtType(ARRAY_EXT, header + array.tobytes())


def _decode_array(data: bytes) -> np.ndarray:
    if len(data) < 2:
        raise MalformedMessageError("array extension is truncated")
    code, ndim = data[0], data[1]
    dtype = ARRAY_DTYPES.get(code)
    if dtype is None:
        raise MalformedMessageError(f"array extension uses unknown dtype code {code}")
    if ndim > MAX_NDIM:
        raise MalformedMessageError(f"array extension has {ndim} dimensions (max {MAX_NDIM})")
    offset = 2 + 8 * ndim
    if len(data) < offset:
        raise MalformedMessageError("array extension header is truncated")
    shape = struct.unpack_from(f"<{ndim}Q", data, 2)
    count = 1
    for n in shape:
        count *= n
    if count * dtype.itemsize != len(data) - offset:
        raise MalformedMessageError(
            f"array extension of shape {tuple(shape)} and dtype {dtype} should carry "
            f"{count * dtype.itemsize} bytes, carries {len(data) - offset}"
        )
    return np.frombuffer(data, dtype=dtype, count=count, offset=offset).reshape(shape)


def _default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return _encode_array(obj)
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, (_dt.datetime, _dt.date)):
        return obj.isoformat()  # Celery puts date_done in result metadata
    if isinstance(obj, uuid.UUID):
        return str(obj)
    if isinstance(obj, memoryview):
        return obj.tobytes()
    raise TypeError(f"{type(obj).__name__} cannot travel on the tinkerq wire")


def _ext_hook(code: int, data: bytes) -> Any:
    if code == ARRAY_EXT:
        return _decode_array(data)
    raise MalformedMessageError(f"unknown msgpack extension type {code}")


def packb(obj: Any) -> bytes:
    """Encode ``obj`` (maps, lists, scalars, bytes, numpy arrays) to msgpack bytes."""
    try:
        return msgpack.packb(obj, default=_default, use_bin_type=True)
    except MalformedMessageError:
        raise
    except (TypeError, ValueError, OverflowError) as exc:
        raise MalformedMessageError(f"cannot encode message: {exc}") from exc


def unpackb(data: bytes | bytearray | memoryview, *, max_bytes: int | None = None) -> Any:
    """Decode msgpack bytes made by :func:`packb`; any defect becomes a MalformedMessageError."""
    size = len(data)
    if max_bytes is not None and size > max_bytes:
        raise MalformedMessageError(f"message of {size} bytes exceeds the limit of {max_bytes} bytes")
    try:
        return msgpack.unpackb(
            data,
            ext_hook=_ext_hook,
            raw=False,
            strict_map_key=True,
            use_list=True,
        )
    except MalformedMessageError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types for garbage input
        raise MalformedMessageError(
            f"message is not valid tinkerq msgpack ({type(exc).__name__}: {exc}); "
            f"first bytes: {bytes(data[:32])!r}"
        ) from exc


def register_kombu_serializer() -> None:
    """Make ``tinkerq-msgpack`` known to kombu (idempotent). Celery is configured to accept only it."""
    register(SERIALIZER_NAME, packb, unpackb, content_type=CONTENT_TYPE, content_encoding="binary")


register_kombu_serializer()
