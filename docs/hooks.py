"""MkDocs hook: the tables of options, commands and exit statuses, generated from the code at build time.

A page asks for a table with a marker on a line of its own; the hook replaces it:

- ``<!-- options: train -->``: every option of ``ddpkit train`` (``run``: of ``ddpkit run``), one row per
  field of the command's config dataclass: key (nested dataclasses as dotted keys), type, default, and the
  field's docstring, read by the same code that writes ``--help`` (``ddpkit.commands.help.options``), so the
  manual, ``--help`` and the parser cannot drift apart;
- ``<!-- command-help: NAME -->``: the text of ``ddpkit NAME --help``;
- ``<!-- command-list -->``: every command with its one-line description;
- ``<!-- exit-statuses: NAME -->``: the exit statuses ``ddpkit NAME --help`` lists.

An unknown marker fails the build (``mkdocs build --strict`` runs in the tests).
"""

from __future__ import annotations

import html
import re
from collections.abc import Sequence
from typing import Any

from ddpkit.commands.help import CommandHelp, options, render_help

_MARKER = re.compile(r"^<!-- (options|command-help|exit-statuses|command-list)(?:: *([\w-]+))? -->$", re.MULTILINE)


def _sources() -> tuple[dict[str, type], dict[str, CommandHelp], dict[str, str]]:
    """The config dataclasses, each command's help and one-line description: the one place that imports them.

    When a class moves to another module, the import here is the one line to change.
    """
    from ddpkit.commands.dispatch import COMMANDS
    from ddpkit.launchers.script import RunConfig
    from ddpkit.train.config import TrainConfig

    schemas: dict[str, type] = {"train": TrainConfig, "run": RunConfig}
    helps = {name: command.help for name, command in COMMANDS.items()}
    briefs = {name: command.brief for name, command in COMMANDS.items()}
    return schemas, helps, briefs


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    """Replace every marker of the page with its generated Markdown."""
    return _MARKER.sub(lambda match: _render(match.group(1), match.group(2) or ""), markdown)


def _render(kind: str, name: str) -> str:
    schemas, helps, briefs = _sources()
    if kind == "options":
        return options_table(schemas[name])
    if kind == "command-help":
        return f"```text\n{render_help(helps[name])}\n```"
    if kind == "exit-statuses":
        rows = [(f"`{status}`", _text(meaning)) for status, meaning in helps[name].exit_statuses]
        return _table(("status", "meaning"), rows)
    return _table(("command", "what it does"), [(f"[`ddpkit {n}`](#ddpkit-{n})", _text(b)) for n, b in briefs.items()])


def options_table(schema: type) -> str:
    """A Markdown table of every option of a config dataclass: key, type, default, meaning."""
    rows = [(f"`{o.key}`", f"`{o.type}`", _default(o.default), _text(o.doc)) for o in options(schema)]
    return _table(("option", "type", "default", "meaning"), rows)


def _text(plain: str) -> str:
    """Plain text (a docstring) as Markdown that shows it as written: ``<tmp>`` is no HTML tag, ``*`` no emphasis."""
    return re.sub(r"([\\`*_\[\]])", r"\\\1", html.escape(plain, quote=False))


def _default(value: Any) -> str:
    if value == "" or value == [] or value == ():
        return "(empty)"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, (list, tuple)):
        return "`" + ",".join(str(v) for v in value) + "`"
    return f"`{value}`"


def _table(header: tuple[str, ...], rows: Sequence[tuple[str, ...]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines)
