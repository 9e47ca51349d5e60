"""Finds, builds if needed, and loads the C library with ctypes.

Where the library comes from, in order:

1. the copy setuptools built at install time beside this file
   (``_shm_all_reduce.<abi tag>.so``; ``pip install -e .`` builds it in place),
   when it was built from the source beside it (its fingerprint matches) or no
   source is shipped (a wheel);
2. otherwise a copy built now from that source with the system C compiler,
   cached under ``$XDG_CACHE_HOME/ddpkit`` (``~/.cache/ddpkit``) by fingerprint,
   so an edited source or a checkout never installed still works;
3. otherwise an installed copy with a stale fingerprint but the right ABI.

If none loads, :func:`load` reports why and the collective is unavailable.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.machinery
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ddpkit.comm.shm import build_config

ABI_VERSION = 1
"""Must equal DDPKIT_SHM_ABI_VERSION in the C source."""

# Return codes of the C functions (see the C source for what info[] holds).
RC_OK = 0
RC_AGAIN = 1
RC_TIMEOUT = -1
RC_PEER_DEAD = -2
RC_ABORTED = -3
RC_MISMATCH = -4
RC_BROKEN = -5
RC_BAD_ARG = -6
RC_BAD_SEGMENT = -7
RC_RANK_TAKEN = -8

_HERE = Path(__file__).resolve().parent
_SOURCE = _HERE / build_config.SOURCE_NAME
_BUILD_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Loaded:
    """The outcome of :func:`load`.

    Args:
        lib: the loaded library with its signatures declared, or None.
        reason: why it could not be loaded (empty when ``lib`` is set).
    """

    lib: ctypes.CDLL | None
    reason: str


@functools.lru_cache(maxsize=1)
def load() -> Loaded:
    """Load the library once per process (see the module docstring for where from).

    Returns:
        The library, or None with the reason.
    """
    if not sys.platform.startswith("linux"):
        return Loaded(None, f"it needs Linux (POSIX shared memory, open file description locks), not {sys.platform}")
    expected = build_config.source_hash(_SOURCE) if _SOURCE.exists() else None
    problems: list[str] = []
    stale: list[Path] = []
    for path in _installed_copies():
        lib, problem = _open(path)
        if lib is None:
            problems.append(problem)
        elif expected is None or lib.ddpkit_shm_source_hash().decode() == expected:
            return Loaded(lib, "")
        else:
            stale.append(path)
    if expected is not None:
        built, problem = _build_cached(expected)
        if built is not None:
            lib, problem = _open(built)
            if lib is not None:
                return Loaded(lib, "")
        problems.append(problem)
    for path in stale:
        lib, problem = _open(path)
        if lib is not None:
            return Loaded(lib, "")
    if not problems:
        problems.append(f"no compiled library and no source {build_config.SOURCE_NAME} in {_HERE}")
    return Loaded(None, "; ".join(problems))


def _installed_copies() -> list[Path]:
    stem = build_config.EXTENSION_NAME.rsplit(".", 1)[1]
    candidates = [_HERE / (stem + suffix) for suffix in importlib.machinery.EXTENSION_SUFFIXES]
    return [path for path in candidates if path.exists()]


def _open(path: Path) -> tuple[ctypes.CDLL | None, str]:
    try:
        lib = ctypes.CDLL(str(path))  # CDLL releases the GIL during calls: peers' threads keep running
        version = lib.ddpkit_shm_abi_version()
    except (OSError, AttributeError) as e:
        return None, f"cannot load {path}: {e}"
    if version != ABI_VERSION:
        return None, f"{path} has ABI version {version}, this ddpkit needs {ABI_VERSION}; reinstall ddpkit"
    _declare(lib)
    return lib, ""


def _declare(lib: ctypes.CDLL) -> None:
    c_int, c_u64, c_f64, c_p, c_s = ctypes.c_int, ctypes.c_uint64, ctypes.c_double, ctypes.c_void_p, ctypes.c_char_p
    info = ctypes.POINTER(ctypes.c_int64)
    signatures = {
        "ddpkit_shm_source_hash": (c_s, []),
        "ddpkit_shm_open": (c_int, [c_s, c_int, c_int, c_u64, c_u64, c_f64, c_f64, ctypes.POINTER(c_p)]),
        "ddpkit_shm_close": (None, [c_p]),
        "ddpkit_shm_unlink": (c_int, [c_s]),
        "ddpkit_shm_is_abandoned": (c_int, [c_s]),
        "ddpkit_shm_abort": (None, [c_p]),
        "ddpkit_shm_all_reduce": (c_int, [c_p, c_p, c_u64, c_int, c_int, info]),
        "ddpkit_shm_resume": (c_int, [c_p, info]),
    }
    for name, (restype, argtypes) in signatures.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "ddpkit" / "shm"


def _build_cached(fingerprint: str) -> tuple[Path | None, str]:
    """Compile the source into the per-user cache unless a copy with this fingerprint is there."""
    target = _cache_dir() / f"{build_config.EXTENSION_NAME.rsplit('.', 1)[1]}-{fingerprint}.so"
    if target.exists():
        return target, ""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None, "no C compiler (cc) to build it from source; install gcc and reinstall ddpkit"
    try:
        # 0700: a library loaded into the process must not be writable by others.
        target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        from filelock import FileLock  # ranks starting together build once, not once each

        with FileLock(str(target.parent / "build.lock"), timeout=_BUILD_TIMEOUT_S):
            if target.exists():
                return target, ""
            fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
            os.close(fd)
            command = [
                compiler,
                "-shared",
                "-fPIC",
                *build_config.COMPILE_ARGS,
                f'-D{build_config.HASH_MACRO}="{fingerprint}"',
                "-o",
                tmp,
                str(_SOURCE),
                *build_config.LINK_ARGS,
                *(f"-l{name}" for name in build_config.LIBRARIES),
            ]
            try:
                result = subprocess.run(command, capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S)
                if result.returncode != 0:
                    return None, f"building {_SOURCE} failed: {result.stderr.strip()[-2000:]}"
                os.replace(tmp, target)  # atomic: a concurrent loader sees all or nothing
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"building {_SOURCE} into {target.parent} failed: {e}"
    return target, ""
