"""Load the launcher environments recorded in tests/env/recorded/ (see its README)."""

from __future__ import annotations

from pathlib import Path

RECORDED = Path(__file__).parent / "recorded"


def recorded(name: str) -> dict[str, str]:
    """The variables of recorded/<name>.env as a plain dict."""
    lines = (RECORDED / f"{name}.env").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line)
