"""Reading IDX files, the format of MNIST and Fashion-MNIST (optionally gzip-compressed).

An IDX file is a big-endian header (two zero bytes, a type code, the number of
dimensions, then one uint32 per dimension) followed by the values. Only the
unsigned-byte type (0x08) is used by the MNIST family.
"""

from __future__ import annotations

import gzip
import struct
import zlib
from pathlib import Path

import numpy as np

from ddpkit.errors import UserError

_UBYTE = 0x08


class CorruptDataError(UserError):
    """A data file is truncated, corrupt or not of the expected shape."""


def read_idx(path: str | Path) -> np.ndarray:
    """Read an IDX file of unsigned bytes (``.gz`` or raw) into an array.

    Args:
        path: the file; names ending in ``.gz`` are decompressed.

    Returns:
        A uint8 array whose shape is the one in the header.

    Raises:
        CorruptDataError: the file is truncated, not gzip, or its header and
            size disagree.
    """
    path = Path(path)
    data = _read_bytes(path)
    if len(data) < 4 or data[0:2] != b"\x00\x00":
        raise CorruptDataError(f"{path} is not an IDX file (bad magic number); delete it so it is fetched again")
    type_code, ndim = data[2], data[3]
    if type_code != _UBYTE:
        raise CorruptDataError(f"{path} holds IDX type 0x{type_code:02x}, expected unsigned bytes (0x08)")
    header_size = 4 + 4 * ndim
    if len(data) < header_size:
        raise CorruptDataError(f"{path} is truncated inside its header; delete it so it is fetched again")
    shape = struct.unpack(f">{ndim}I", data[4:header_size])
    expected = header_size + int(np.prod(shape, dtype=np.int64))
    if len(data) != expected:
        raise CorruptDataError(
            f"{path} has {len(data)} bytes but its header {shape} needs {expected}; "
            "it is truncated or corrupt: delete it so it is fetched again"
        )
    return np.frombuffer(data, dtype=np.uint8, offset=header_size).reshape(shape)


def write_idx(path: str | Path, array: np.ndarray) -> None:
    """Write a uint8 array as an IDX file (gzip-compressed when the name ends in .gz)."""
    array = np.ascontiguousarray(array, dtype=np.uint8)
    header = bytes([0, 0, _UBYTE, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wb") as f:
        f.write(header + array.tobytes())


def _read_bytes(path: Path) -> bytes:
    if not str(path).endswith(".gz"):
        return path.read_bytes()
    try:
        with gzip.open(path, "rb") as f:
            return f.read()
    except (EOFError, OSError, zlib.error) as e:
        raise CorruptDataError(f"{path} is not a complete gzip file ({e}); delete it so it is fetched again") from None
