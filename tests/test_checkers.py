"""The checkers configured in pyproject.toml, run as tests so that CI (scripts/test.sh) fails on a finding.

Each runs the tool from this venv on this checkout and shows its output on failure. A tool that is not
installed fails the test (it is in the ``test`` extra): a check that cannot run must not pass.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import ddpkit
from tests.docs.markdown import code_blocks, pages

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ["src", "tests", "examples", "benchmarks", "docs"]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    """Run a checker module of this interpreter in the repository root."""
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=240)


def _assert_clean(result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == 0, f"{' '.join(map(str, result.args))}\n{result.stdout}\n{result.stderr}"


def test_import_layers() -> None:
    """import-linter's contracts: the core never imports the commands, trainer or benchmarks, and so on."""
    lint_imports = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(lint_imports), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=240)
    _assert_clean(result)


def test_ruff_lint() -> None:
    _assert_clean(_run("ruff", "check", "--no-cache", *SOURCES))


def test_ruff_format() -> None:
    """The code is as ``ruff format`` writes it (after a merge: run ``ruff format src tests examples benchmarks``)."""
    _assert_clean(_run("ruff", "format", "--check", "--no-cache", *SOURCES))


@pytest.mark.slow
def test_mypy() -> None:
    """mypy on the modules pyproject's [tool.mypy] names (strict on the public API's modules)."""
    _assert_clean(_run("mypy", "--no-incremental"))


def test_ruff_format_markdown_code() -> None:
    """The python blocks of README.md and docs/ are as ``ruff format`` writes them (those that are whole Python;
    a fragment with lines elided inside a loop is not)."""
    unformatted = []
    for page in pages():
        for block in code_blocks(page):
            if block.language != "python" or not _parses(block.code):
                continue
            result = subprocess.run(
                [sys.executable, "-m", "ruff", "format", "--check", "--no-cache", "--stdin-filename", "block.py", "-"],
                input=block.code,
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=60,
            )
            if result.returncode:
                unformatted.append(f"{block}: {result.stdout}{result.stderr}")
    assert not unformatted, "\n".join(unformatted)


def _parses(code: str) -> bool:
    try:
        ast.parse(code)
    except SyntaxError:
        return False
    return True


def test_public_names_are_visible() -> None:
    """dir(ddpkit) lists __all__ (not the helpers the package imports), and the TYPE_CHECKING imports name the
    objects the lazy loading returns."""
    assert set(ddpkit.__all__) <= set(dir(ddpkit))
    assert not {"Any", "TYPE_CHECKING", "annotations", "importlib", "types"} & set(dir(ddpkit)), dir(ddpkit)
    source = Path(ddpkit.__file__).read_text()
    block = source.split("if TYPE_CHECKING:", 1)[1].split("\ndef ", 1)[0]
    imported = {}
    for line in block.splitlines():
        line = line.strip()
        if line.startswith("from "):
            module, names = line[len("from ") :].split(" import ")
            imported.update({name.strip(): module for name in names.split(",")})
    assert imported == ddpkit._PUBLIC
