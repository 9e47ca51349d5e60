"""The README's and the manual's Markdown as data: code blocks with their markers, links, headings' anchors.

A code block is marked by an HTML comment on the line before its fence:

- ``<!-- fragment: why -->``: not run (part of a script, needs a cluster, trains for minutes...); the reason
  says why, and where the real thing is tested;
- ``<!-- file: NAME -->``: saved as NAME in the page's folder, for the blocks after it on the page to run;
- ``<!-- run-with: python -->``: a python block that starts its own workers (``ddpkit.launch``), run with python;
- no marker: run (tests/docs/test_snippets.py): ``python`` as a script under ``ddpkit run nproc=2``,
  ``bash`` with bash, ``console`` its ``$ `` lines with bash.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
CHECKED = ("python", "bash", "console")
"""The languages whose blocks either run or say why not."""

_FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
_MARKER = re.compile(r"^\s*<!-- (fragment|file|run-with): *(.*?) *-->\s*$")
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^(#{1,6}) +(.*?) *#*$")


@dataclass(frozen=True)
class CodeBlock:
    """One fenced code block of a page."""

    page: Path
    line: int
    """Line of the opening fence, counted from 1."""
    language: str
    code: str
    marker: str
    """``fragment``, ``file``, ``run-with`` or empty (run)."""
    argument: str
    """The fragment's reason, the file's name, or the program that runs the block."""

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line} ({self.language})"


def pages() -> list[Path]:
    """README.md and every page of the manual."""
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def code_blocks(page: Path) -> list[CodeBlock]:
    """Every fenced code block of ``page``, in order, with the marker on the line before it."""
    lines = page.read_text().splitlines()
    blocks, index = [], 0
    while index < len(lines):
        opening = _FENCE.match(lines[index])
        if not opening or not opening.group(2):
            index += 1
            continue
        indent, language = opening.groups()
        end = next(i for i in range(index + 1, len(lines)) if lines[i].strip() == "```")
        body = "\n".join(line[len(indent) :] for line in lines[index + 1 : end]) + "\n"
        before = next((lines[i] for i in range(index - 1, -1, -1) if lines[i].strip()), "")
        marker = _MARKER.match(before)
        kind, argument = marker.groups() if marker else ("", "")
        blocks.append(CodeBlock(page, index + 1, language, body, kind, argument))
        index = end + 1
    return blocks


def prose(page: Path) -> str:
    """The page without its code blocks (links and headings inside them are not links and headings)."""
    text = page.read_text()
    return re.sub(r"^(\s*)```.*?^\1```", "", text, flags=re.MULTILINE | re.DOTALL)


def links(page: Path) -> list[str]:
    """The targets of the page's Markdown links, images excluded."""
    return _LINK.findall(prose(page))


def anchors(page: Path) -> set[str]:
    """The anchors of the page's headings, as GitHub and MkDocs' toc both make them from plain headings."""
    found = set()
    for line in prose(page).splitlines():
        heading = _HEADING.match(line)
        if heading:
            text = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.group(2)).lower()
            found.add(re.sub(r"[^\w\- ]", "", text).strip().replace(" ", "-"))
    return found
