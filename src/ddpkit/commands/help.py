"""``--help`` of every command, generated from the command's config dataclass.

Every option of a command is a field of a dataclass with a type, a default
and a docstring (the string literal under the field, as in
:class:`ddpkit.train.config.TrainConfig`). The help lists them all from the class
itself, so it cannot drift from what the parser accepts: nested dataclasses
appear as dotted keys (``checkpoint.every_steps``), and a field that no
group names still appears, under "other options".

Field docstrings are not kept by Python at run time; :func:`field_docs`
reads them from the class's source with :mod:`ast`.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import re
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ddpkit.keyvalue import HELP

HELP_WORDS = ("-h", "--help")
VALUE_RULE = (
    "key=value: the value is taken exactly as written, not as YAML (output_dir=out #1 is the folder 'out #1'; "
    "${...} is never filled in, in YAML files neither); a whole number, number or true/false option converts it; "
    "a list option takes comma-separated values (workers=1,2); a .yaml file sets several options, later words win"
)
"""How a command-line value is read: every command with options says it in its help."""
_WIDTH = 100


@dataclass(frozen=True)
class Option:
    """One key=value option of a command."""

    key: str
    """Dotted key, e.g. ``checkpoint.every_steps``."""
    type: str
    """The field's annotation as written, e.g. ``int``."""
    default: Any
    """The default value."""
    doc: str
    """The field's docstring, one paragraph."""


@dataclass(frozen=True)
class CommandHelp:
    """What ``ddpkit COMMAND --help`` shows."""

    usage: str
    """The usage line(s), after "usage: "."""
    summary: str
    """What the command does, a few sentences."""
    schema: str = ""
    """``module:Class`` of the config dataclass (imported only when the help is shown); empty: no options."""
    groups: tuple[tuple[str, tuple[str, ...]], ...] = ()
    """(title, keys or key prefixes) in display order; options no group names go under "other options"."""
    positional: tuple[tuple[str, str], ...] = ()
    """(NAME, meaning) of the words that are not key=value."""
    examples: tuple[str, ...] = ()
    """Example command lines."""
    exit_statuses: tuple[tuple[str, str], ...] = ()
    """(status, meaning) of the command's exit statuses, for schedulers and scripts."""


def wants_help(words: Sequence[str]) -> bool:
    """True if the words ask for help (-h or --help anywhere)."""
    return any(word in HELP_WORDS for word in words)


def field_docs(schema: type) -> dict[str, str]:
    """The help of each field of a dataclass and of the dataclasses it extends: the help its metadata holds, else
    the docstring under it, read from the source.

    A field a subclass declares again (a new default) takes the subclass's docstring. No docstrings without source.
    """
    docs: dict[str, str] = {}
    for cls in reversed(schema.__mro__):
        if dataclasses.is_dataclass(cls):
            docs.update(_own_field_docs(cls))
    for field in dataclasses.fields(schema):  # an option declared with its help in its metadata (keyvalue.option)
        if field.metadata.get(HELP):
            docs[field.name] = " ".join(str(field.metadata[HELP]).split())
    return docs


def _own_field_docs(cls: type) -> dict[str, str]:
    """The docstrings under the fields that the body of ``cls`` itself declares."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):  # no source (e.g. a frozen executable)
        return {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for statement, following in zip(body, body[1:]):
        if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
            if isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant):
                docs[statement.target.id] = " ".join(str(following.value.value).split())
    return docs


def options(schema: type, prefix: str = "") -> list[Option]:
    """Every option of a config dataclass, nested dataclasses expanded to dotted keys, in field order."""
    docs = field_docs(schema)
    found = []
    for field in dataclasses.fields(schema):
        factory = field.default_factory
        if factory is not dataclasses.MISSING and dataclasses.is_dataclass(factory):
            found += options(factory, f"{prefix}{field.name}.")
            continue
        default = factory() if factory is not dataclasses.MISSING else field.default
        annotation = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", str(field.type))
        found.append(Option(prefix + field.name, shown_type(annotation), default, docs.get(field.name, "")))
    return found


_LITERAL = re.compile(r"Literal\[(.*?)\]")


def shown_type(annotation: str) -> str:
    """An option's type as the command line writes it: ``Literal['auto'] | bool`` is ``auto|true|false``."""
    literal = _LITERAL.search(annotation)
    if literal is None:
        return annotation
    words = [word.strip().strip("'\"") for word in literal.group(1).split(",")]
    return "|".join(words + (["true", "false"] if re.search(r"\bbool\b", annotation) else []))


def load_schema(path: str) -> type:
    """The class named by ``module:Class``."""
    module, _, name = path.partition(":")
    schema: type = getattr(importlib.import_module(module), name)
    return schema


def render_help(help: CommandHelp) -> str:
    """The text of ``--help``: usage, summary, positional words, options by group, exit statuses, examples."""
    parts = [f"usage: {help.usage}", "", _wrap(help.summary, "")]
    if help.positional:
        parts += ["", "arguments:"] + [_entry(name, meaning) for name, meaning in help.positional]
    if help.schema:
        parts += ["", _wrap(VALUE_RULE, "")]
        for title, group in _grouped(options(load_schema(help.schema)), help.groups):
            parts += ["", f"{title}:"] + [_option_entry(option) for option in group]
    if help.exit_statuses:
        parts += ["", "exit status:"] + [_entry(status, meaning) for status, meaning in help.exit_statuses]
    if help.examples:
        parts += ["", "examples:"] + [f"  {line}" for line in help.examples]
    return "\n".join(parts)


def _grouped(found: list[Option], groups: Sequence[tuple[str, Sequence[str]]]) -> list[tuple[str, list[Option]]]:
    if not groups:
        return [("options (key=value)", found)]
    result: list[tuple[str, list[Option]]] = [(title, []) for title, _ in groups]
    other: list[Option] = []
    for option in found:
        index = next((i for i, (_, keys) in enumerate(groups) if _in_group(option.key, keys)), None)
        (other if index is None else result[index][1]).append(option)
    return [(title, group) for title, group in result if group] + ([("other options", other)] if other else [])


def _in_group(key: str, keys: Sequence[str]) -> bool:
    return any(key == k or key.startswith(k + ".") for k in keys)


def _option_entry(option: Option) -> str:
    return _entry(f"{option.key}=<{option.type}>   (default: {_show(option.default)})", option.doc)


def _entry(name: str, text: str) -> str:
    return f"  {name}\n" + _wrap(text, "      ")


def _wrap(text: str, indent: str) -> str:
    return textwrap.fill(text, _WIDTH, initial_indent=indent, subsequent_indent=indent)


def _show(value: Any) -> str:
    if isinstance(value, str):
        return repr(value) if value == "" or " " in value else value
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value) or "(none)"
    return str(value)
