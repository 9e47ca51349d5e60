"""Every python, bash and console block of README.md and docs/ runs, or is marked a fragment with a reason.

The blocks that run (see tests/docs/markdown.py for the markers) run in a temporary folder per page, in page
order, with this checkout's ``ddpkit`` on PATH: a python block as a script under ``ddpkit run nproc=2``, a bash
block with bash, after the page's ``file:`` blocks were saved there. The README's own script and the getting-
started script are then stopped with SIGTERM mid-run, as a scheduler preempts a job, and run again: the resumed
run must end with the uninterrupted run's weights, tensor for tensor.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.cli_runner import PYTHONPATH
from tests.docs.markdown import CHECKED, ROOT, CodeBlock, code_blocks, pages

TIMEOUT = 180
"""Seconds one block, or one launch, may take before the test fails (a run takes about 10 s on 2 cores)."""
RESUMED_SCRIPTS = ["README.md", "docs/getting-started.md"]
"""Pages whose ``file: train.py`` script is stopped and resumed."""


def _environ() -> dict[str, str]:
    """This interpreter's ``ddpkit`` first on PATH, and this checkout's sources importable."""
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return {**os.environ, "PATH": path, "PYTHONPATH": PYTHONPATH}


def _run_block(block: CodeBlock, folder: Path) -> subprocess.CompletedProcess:
    if block.language == "python":
        script = folder / f"block_{block.line}.py"
        script.write_text(block.code)
        command = [sys.executable, "-m", "ddpkit", "run", "nproc=2", script.name]
        if block.marker == "run-with":
            assert block.argument == "python", f"{block}: run-with: {block.argument}; only python is known"
            command = [sys.executable, script.name]
    else:
        code = block.code
        if block.language == "console":
            code = "\n".join(line[2:] for line in code.splitlines() if line.startswith("$ "))
        command = ["bash", "-euo", "pipefail", "-c", code]
    return subprocess.run(command, cwd=folder, env=_environ(), capture_output=True, text=True, timeout=TIMEOUT)


def _runnable_pages() -> list[Path]:
    return [page for page in pages() if any(b.marker != "fragment" for b in code_blocks(page) if _checked(b))]


def _checked(block: CodeBlock) -> bool:
    return block.language in CHECKED


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


@pytest.fixture(scope="module")
def page_runs(tmp_path_factory) -> dict[str, tuple[Path, list[tuple[CodeBlock, subprocess.CompletedProcess]]]]:
    """Each page with runnable blocks, run once: its folder and each block's result."""
    runs = {}
    for page in _runnable_pages():
        folder = tmp_path_factory.mktemp(page.stem)
        results = []
        for block in filter(_checked, code_blocks(page)):
            if block.marker == "file":
                (folder / block.argument).write_text(block.code)
            elif block.marker != "fragment":
                results.append((block, _run_block(block, folder)))
        runs[_name(page)] = (folder, results)
    return runs


@pytest.mark.parametrize("page", pages(), ids=_name)
def test_every_code_block_runs_or_says_why_not(page):
    """A fragment names its reason; a saved file is run by a later block of its page."""
    blocks = [block for block in code_blocks(page) if _checked(block)]
    reasonless = [str(b) for b in blocks if b.marker == "fragment" and not b.argument]
    assert not reasonless, f"fragments without a reason: {reasonless}"
    for index, block in enumerate(blocks):
        if block.marker == "file":
            later = [b for b in blocks[index + 1 :] if b.marker in ("", "run-with") and block.argument in b.code]
            assert later, f"{block} is saved as {block.argument} but no later block of the page runs it"


@pytest.mark.slow
@pytest.mark.parametrize("page", [_name(page) for page in _runnable_pages()])
def test_the_runnable_blocks_run(page_runs, page):
    _, results = page_runs[page]
    for block, result in results:
        assert result.returncode == 0, f"{block} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"


@pytest.mark.slow
@pytest.mark.parametrize("page", RESUMED_SCRIPTS)
def test_the_script_stopped_mid_run_and_run_again_ends_with_the_uninterrupted_weights(page_runs, page, tmp_path):
    reference_folder, results = page_runs[page]
    assert all(result.returncode == 0 for _, result in results), f"the uninterrupted run of {page} failed"
    shutil.copy(reference_folder / "train.py", tmp_path / "train.py")
    command = [sys.executable, "-m", "ddpkit", "run", "nproc=2", "train.py"]

    stopped = _stopped_after_first_checkpoint(command, tmp_path)
    assert stopped.returncode == 75, f"exit {stopped.returncode}, not 75 (preempted):\n{stopped.stdout}"
    assert "ddpkit: preempted by SIGTERM: the workers checkpointed and exited 75" in stopped.stdout
    assert not (tmp_path / "model.pt").exists(), "the run ended before SIGTERM reached it"

    resumed = subprocess.run(command, cwd=tmp_path, env=_environ(), capture_output=True, text=True, timeout=TIMEOUT)
    assert resumed.returncode == 0, f"{resumed.stdout}\n{resumed.stderr}"
    assert "resumed from runs/" in resumed.stdout + resumed.stderr
    expected = torch.load(reference_folder / "model.pt", weights_only=True)
    got = torch.load(tmp_path / "model.pt", weights_only=True)
    differing = [key for key in expected if not torch.equal(expected[key], got[key])]
    assert not differing, f"final weights differ from the uninterrupted run's in {differing}"


def _stopped_after_first_checkpoint(command: list[str], folder: Path) -> subprocess.CompletedProcess:
    """Start ``command``, send its launcher SIGTERM once the first checkpoint is complete, and wait for it."""
    process = subprocess.Popen(
        command, cwd=folder, env=_environ(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + TIMEOUT
        while not any((path / "manifest.json").exists() for path in folder.glob("runs/*/step-*")):
            assert process.poll() is None, f"the run ended before its first checkpoint:\n{process.communicate()[0]}"
            assert time.monotonic() < deadline, "no checkpoint within the timeout"
            time.sleep(0.01)
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=TIMEOUT)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    return subprocess.CompletedProcess(command, process.returncode, output, "")
