"""How the C library of the shared-memory all_reduce is compiled.

One source of truth for setup.py (which builds it at install time) and for
``_lib.py`` (which builds it at run time when the installed copy is missing or
older than the source). Standard library only: setup.py runs this file by
path, without importing ddpkit or torch.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

SOURCE_NAME = "shm_all_reduce.c"
"""The C source, beside this file."""

EXTENSION_NAME = "ddpkit.comm.shm._shm_all_reduce"
"""Dotted name setuptools builds the library under (loaded with ctypes, not imported)."""

COMPILE_ARGS = (
    "-std=gnu11",
    # -O3 vectorizes the reduction loops; the AVX2 variants come from
    # target_clones in the source, never from -march=native, so the library
    # runs on any x86-64 machine the wheel lands on.
    "-O3",
    "-fvisibility=hidden",
    "-fno-math-errno",
    # No FP exception semantics needed; lets the compiler vectorize the
    # branch-free half-precision conversions. Values are unchanged.
    "-fno-trapping-math",
    # No fused multiply-add: every rank must compute bit-identical results.
    "-ffp-contract=off",
    "-pthread",
)
"""Compiler flags (besides -fPIC and -shared, which every build adds)."""

LINK_ARGS = ("-pthread",)
"""Linker flags."""

LIBRARIES = ("rt",)
"""Libraries to link: shm_open lives in librt before glibc 2.34."""

HASH_MACRO = "DDPKIT_SHM_SOURCE_HASH"
"""Preprocessor macro carrying :func:`source_hash` into the library."""


def source_hash(source: Path) -> str:
    """Fingerprint of the C source and the flags it is compiled with.

    Args:
        source: path of the C source.

    Returns:
        16 hex digits; the library reports the fingerprint it was built from, so
        a library older than its source is recognized and rebuilt.
    """
    digest = hashlib.sha256(source.read_bytes())
    digest.update("\0".join(COMPILE_ARGS + LINK_ARGS + LIBRARIES).encode())
    return digest.hexdigest()[:16]
