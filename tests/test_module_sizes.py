"""Every module of the package outside the benchmarks is short enough to read in one sitting.

A module over 500 lines holds more than one concept and is split by concept (the benchmarks' reports and
specs are long tables, and exempt). mypy strict covers the whole package: pyproject's [tool.mypy] files is
``src/ddpkit``, and tests/test_checkers.py runs it.
"""

from __future__ import annotations

import tomllib

from tests.test_checkers import ROOT

PACKAGE = ROOT / "src" / "ddpkit"
MAX_LINES = 500


def test_no_module_outside_the_benchmarks_is_over_500_lines() -> None:
    paths = [path for path in sorted(PACKAGE.rglob("*.py")) if "bench" not in path.relative_to(PACKAGE).parts]
    assert len(paths) > 150, "the package's modules were found"
    long = {str(p.relative_to(ROOT)): n for p in paths if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines; split each by concept: {long}"


def test_mypy_checks_the_whole_package() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    assert config["files"] == ["src/ddpkit"] and config["strict"] is True
