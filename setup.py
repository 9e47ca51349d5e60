"""Builds the C library of ddpkit's shared-memory all_reduce; all other metadata is in pyproject.toml.

The library is plain C (no Python headers), built as an extension so that
``pip install .`` and ``pip install -e .`` (in place, beside its source) both
compile it, and loaded with ctypes at run time. ``optional=True``: without a
C compiler the install still succeeds, and ddpkit falls back to gloo's
all_reduce with a warning.
"""

import runpy
from pathlib import Path

from setuptools import Extension, setup

_SHM_DIR = "src/ddpkit/comm/shm"  # relative: setuptools wants relative source paths
_config = runpy.run_path(str(Path(__file__).resolve().parent / _SHM_DIR / "build_config.py"))
_source = f"{_SHM_DIR}/{_config['SOURCE_NAME']}"
_fingerprint = _config["source_hash"](Path(__file__).resolve().parent / _source)

setup(
    ext_modules=[
        Extension(
            _config["EXTENSION_NAME"],
            sources=[_source],
            extra_compile_args=list(_config["COMPILE_ARGS"]),
            extra_link_args=list(_config["LINK_ARGS"]),
            libraries=list(_config["LIBRARIES"]),
            define_macros=[(_config["HASH_MACRO"], f'"{_fingerprint}"')],
            optional=True,
        )
    ]
)
