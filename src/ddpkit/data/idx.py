"""Reading IDX files, the format of MNIST and Fashion-MNIST (optionally gzip-compressed).

An IDX file is a big-endian header (two zero bytes, a type code, the number of
dimensions, then one uint32 per dimension) followed by the values. Only the
unsigned-byte type (0x08) is used by the MNIST family.

:func:`map_idx` serves a ``.gz`` file from a decompressed copy kept in a
cache folder, memory-mapped: the workers of a job (and later jobs) share its
pages instead of each decompressing the file again (about 0.5 s for
Fashion-MNIST); :func:`map_pixels` does the same for the images as float32
pixels in [0, 1], the form training reads.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import os
import struct
import tempfile
import zlib
from pathlib import Path

import numpy as np
import numpy.typing as npt

from ddpkit.errors import UserError

_UBYTE = 0x08


class CorruptDataError(UserError):
    """A data file is truncated, corrupt or not of the expected shape."""


def read_idx(path: str | Path) -> npt.NDArray[np.uint8]:
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


def map_idx(path: str | Path, cache_dir: str | Path) -> npt.NDArray[np.uint8]:
    """An IDX file of unsigned bytes as a copy-on-write memory map; a ``.gz`` file through a decompressed copy.

    The decompressed copy lives in ``cache_dir``, named after the file and a
    key of its absolute path, size and modification time: a changed source
    gets a new copy (and the old one is removed). The copy is written to a
    temporary name and renamed, so a reader never sees half of one, and
    processes racing to write it write the same bytes. Writes to the returned
    array stay private to the process. Without a writable ``cache_dir`` the
    file is read into memory as by :func:`read_idx`.

    Raises:
        CorruptDataError: as :func:`read_idx`.
    """
    path = Path(path)
    if not str(path).endswith(".gz"):
        return _mapped(path)
    stat = path.stat()
    key = hashlib.sha1(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    stem = path.name[: -len(".gz")]
    copy = Path(cache_dir) / f"{stem}-{key}"
    if not copy.is_file():
        array = read_idx(path)  # checked before it is cached
        try:
            _write_atomically(copy, _header(array) + array.tobytes())
        except OSError:
            copied: npt.NDArray[np.uint8] = array.copy()  # (numpy's stub returns Any here)
            return copied
        for old in copy.parent.glob(f"{stem}-*"):
            if old != copy and not old.name.endswith((".part", ".npy")):
                with contextlib.suppress(OSError):
                    old.unlink()
    return _mapped(copy)


def map_pixels(path: str | Path, cache_dir: str | Path) -> npt.NDArray[np.float32]:
    """An IDX image file as float32 pixels in [0, 1] (``value / 255``), memory-mapped from a copy in ``cache_dir``.

    The copy (``.npy``, beside :func:`map_idx`'s and keyed the same way) is
    made once; every worker then maps the same pages instead of converting
    the images itself (about 0.2 s and 188 MB each for Fashion-MNIST's
    training set). The values are those of ``torch.from_numpy(images).float() / 255``.
    Without a writable ``cache_dir`` they are computed in memory.

    Raises:
        CorruptDataError: as :func:`read_idx`.
    """
    images = map_idx(path, cache_dir)
    path = Path(path)
    stat = path.stat()
    key = hashlib.sha1(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:f32".encode()).hexdigest()[:16]
    stem = path.name[: -len(".gz")] if path.name.endswith(".gz") else path.name
    copy = Path(cache_dir) / f"{stem}-pixels-{key}.npy"
    if not copy.is_file():
        pixels: npt.NDArray[np.float32] = np.divide(images, np.float32(255.0), dtype=np.float32)
        try:
            _write_atomically(copy, _npy_bytes(pixels))
        except OSError:
            return pixels
        for old in copy.parent.glob(f"{stem}-pixels-*.npy"):
            if old != copy:
                with contextlib.suppress(OSError):
                    old.unlink()
    mapped: npt.NDArray[np.float32] = np.load(copy, mmap_mode="c")
    return mapped


def write_idx(path: str | Path, array: np.ndarray) -> None:
    """Write a uint8 array as an IDX file (gzip-compressed when the name ends in .gz)."""
    array = np.ascontiguousarray(array, dtype=np.uint8)
    header = _header(array)
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wb") as f:
        f.write(header + array.tobytes())


def _header(array: np.ndarray) -> bytes:
    return bytes([0, 0, _UBYTE, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)


def _mapped(path: Path) -> npt.NDArray[np.uint8]:
    """A raw IDX file as a copy-on-write memory map, its header checked against its size."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(4)
        if len(head) < 4 or head[0:2] != b"\x00\x00" or head[2] != _UBYTE:
            return read_idx(path)  # its own message for what is wrong
        dims = f.read(4 * head[3])
    header_size = 4 + 4 * head[3]
    if len(dims) < 4 * head[3]:
        return read_idx(path)
    shape = struct.unpack(f">{head[3]}I", dims)
    if size != header_size + int(np.prod(shape, dtype=np.int64)) or 0 in shape:
        return read_idx(path)  # a size mismatch says so; an empty array cannot be mapped
    return np.memmap(path, dtype=np.uint8, mode="c", offset=header_size, shape=shape)


def _npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def _write_atomically(target: Path, data: bytes) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)  # as the downloaded files (mkstemp makes it private)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _read_bytes(path: Path) -> bytes:
    if not str(path).endswith(".gz"):
        return path.read_bytes()
    try:
        with gzip.open(path, "rb") as f:
            return f.read()
    except (EOFError, OSError, zlib.error) as e:
        raise CorruptDataError(f"{path} is not a complete gzip file ({e}); delete it so it is fetched again") from None
