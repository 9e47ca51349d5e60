"""The README is a front door: short, the own script on its first screen, its set-up commands true.

The rest lives in the manual (docs/); tests/docs/test_snippets.py runs the README's code.
"""

from __future__ import annotations

from tests.docs.markdown import ROOT, code_blocks

README = ROOT / "README.md"
FIRST_SCREEN = 45
"""Lines a newcomer sees without scrolling far: the own script starts within them."""


def test_the_readme_is_at_most_250_lines():
    assert len(README.read_text().splitlines()) <= 250


def test_a_complete_own_script_starts_on_the_first_screen():
    script = next(block for block in code_blocks(README) if block.marker == "file")
    assert script.line <= FIRST_SCREEN, f"the own script starts at line {script.line}"
    assert len(script.code.splitlines()) <= 30
    for call in ("ddpkit.init()", "ddpkit.prepare_model(", "ddpkit.DataLoader(", "ddpkit.Checkpointer(", "resume("):
        assert call in script.code, call


def test_the_two_commands_are_the_ones_ci_and_the_main_job_run():
    """``bash scripts/test.sh`` is what .ci/run calls; ``bash scripts/train.sh`` runs ``ddpkit train``."""
    text = README.read_text()
    assert "bash scripts/train.sh" in text and "bash scripts/test.sh" in text
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text()
    assert 'ddpkit" train nproc=2' in (ROOT / "scripts" / "train.sh").read_text()


def test_the_readme_says_how_to_serve_the_manual():
    assert "bash scripts/docs.sh" in README.read_text()
    assert "mkdocs serve" in (ROOT / "scripts" / "docs.sh").read_text()
