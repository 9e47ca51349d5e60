"""The core's modules: strictly typed, and each short enough to read in one sitting.

pyproject's [tool.mypy] files name the public API's modules; these tests hold the rest of the core
(collectives, data, environment, models, tracking, the Horovod layer, the integrations, the benchmarks'
library and the top-level modules) to the same strict settings, and its modules outside the benchmarks
to 500 lines: a longer one holds more than one concept and is split by concept.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_checkers import ROOT, _assert_clean, _run

PACKAGE = ROOT / "src" / "ddpkit"
CORE_PACKAGES = ("comm", "data", "env", "models", "tracking", "horovod", "integrations")
CORE_MODULES = (
    "distributed", "process_group", "prepare", "reduce", "log", "round_store", "served_store", "stacks",
    "allocator", "figures", "gc_pause", "datasets", "ending_threads", "names", "errors", "deprecation", "version",
)  # fmt: skip
MAX_LINES = 500


def _core_files() -> list[Path]:
    """Every module of the core packages and the core's top-level modules (the benchmarks' library apart)."""
    files = [path for name in CORE_PACKAGES for path in sorted((PACKAGE / name).rglob("*.py"))]
    return files + [PACKAGE / f"{name}.py" for name in CORE_MODULES]


def _bench_library() -> list[Path]:
    """The benchmarks' modules but the ``ddpkit bench`` command's own (typed with the commands)."""
    return [path for path in sorted((PACKAGE / "bench").glob("*.py")) if path.name != "cli.py"]


def test_core_modules_are_short() -> None:
    long = {str(p.relative_to(ROOT)): n for p in _core_files() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines; split each by concept: {long}"


@pytest.mark.slow
def test_core_modules_type_check_strictly() -> None:
    """mypy, with pyproject's strict settings, on every core module and the benchmarks' library."""
    paths = [str(p.relative_to(ROOT)) for p in _core_files() + _bench_library()]
    _assert_clean(_run("mypy", "--no-incremental", *paths))
