"""Typed configuration: dataclass schemas overridden by YAML files and key=value words.

One mechanism everywhere (OmegaConf structured configs): a schema dataclass
gives every field a type, a default and a docstring; YAML files and
``key=value`` words from the command line are merged on top, in the order
given, and validated against the schema. Dotted keys reach nested groups
(``checkpoint.every_steps=100``).

A ``key=value`` word's value is read by the option's type, not as YAML
(``--help`` says it: :data:`ddpkit.commands.help.VALUE_RULE`): text options take the value exactly as written
(``output_dir=out #1`` is the folder "out #1", ``time=2:00:00`` stays text),
whole numbers, numbers and true/false are converted, a list option takes
comma-separated values. ``${...}`` is never filled in, on the command line or
in a YAML file: a value is what the user wrote, so no environment variable
(a secret) reaches an option or an error line unasked.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import typing
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException, ValidationError

from ddpkit import errors
from ddpkit.errors import UserError

T = TypeVar("T")
_INTEGER = re.compile(r"[-+]?\d+")
_INTERPOLATION = re.compile(r"(\\*)\$\{")
_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


class ConfigError(UserError):
    """A configuration word or file is invalid; the message names it and the fix."""


def parse(
    schema: type[T],
    args: Sequence[str],
    presets: Mapping[str, Any] | None = None,
) -> T:
    """Build a ``schema`` instance from YAML files and ``key=value`` words.

    Args:
        schema: a dataclass type whose fields all have defaults.
        args: words from the command line: ``key=value`` overrides, or paths of
            YAML files (ending in .yaml or .yml), merged in the order given.
        presets: values merged between the schema defaults and ``args``.

    Returns:
        The validated configuration as a ``schema`` instance.

    Raises:
        ConfigError: unknown key, bad value or unreadable file.
    """
    merged = OmegaConf.structured(schema)
    layers = [("presets", dict(presets or {}))] + [(word, _read_layer(word, schema)) for word in args]
    for word, layer in layers:
        _check_groups(word, layer, schema)
        try:
            merged = OmegaConf.merge(merged, layer)
        except OmegaConfBaseException as e:
            raise ConfigError(_explain(e, schema, word)) from None
    _check_finite(merged, schema)  # before the dataclasses' own checks, which compare (NaN passes any bound)
    try:
        config: T = OmegaConf.to_object(merged)  # type: ignore[assignment]  # omegaconf types it as any container; a structured config gives the schema's instance
        return config
    except OmegaConfBaseException as e:
        raise ConfigError(_explain(e, schema, "")) from None
    except UserError as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(str(e)) from None  # the check of a group the core declares (CheckpointOptions)


def _check_finite(merged: DictConfig, schema: type, prefix: str = "") -> None:
    """Raise ConfigError at the first number option of every command that is NaN or infinite.

    YAML reads ``nan``, ``inf`` and ``.inf`` as floats, and every comparison with NaN is false, so
    a NaN would pass each option's own bound (``lr > 0``) and reach torch.
    """
    for field in dataclasses.fields(schema):
        if field.name not in merged:
            continue
        kind = _field_type(schema, field.name)
        if isinstance(kind, type) and dataclasses.is_dataclass(kind):
            _check_finite(merged[field.name], kind, f"{prefix}{field.name}.")
        elif kind is float:
            try:
                value = merged[field.name]
            except OmegaConfBaseException:
                continue  # an interpolation that does not resolve: to_object names it
            if isinstance(value, float):
                errors.check_finite(prefix + field.name, value, ConfigError)


def peek(args: Sequence[str], key: str, schema: type | None = None) -> str | None:
    """The last value given for ``key`` by ``args`` (words or YAML files), if any, as text.

    Args:
        schema: the command's options, which its messages name (a word that is not key=value).
    """
    value = None
    for word in args:
        layer = OmegaConf.create(_read_layer(word, schema))
        found = OmegaConf.select(layer, key, default=None, throw_on_resolution_failure=False)
        if found is not None:
            value = str(found)
    return value


def to_dict(config: Any) -> dict[str, Any]:
    """A plain, JSON-serialisable dict of a config dataclass."""
    return dataclasses.asdict(config)


def to_yaml(config: Any) -> str:
    """The config as YAML text, as printed at start and stored with checkpoints."""
    return OmegaConf.to_yaml(OmegaConf.structured(config))


def _read_layer(word: str, schema: type | None) -> dict[str, Any]:
    """The options one word gives: a YAML file's, or a ``key=value`` word's (read by ``schema``'s types; text
    where ``schema`` is None), with every ``${`` escaped so that OmegaConf fills nothing in."""
    if word.endswith((".yaml", ".yml")) and "=" not in word:
        if not os.path.isfile(word):
            raise ConfigError(f"config file {word!r} does not exist; pass an existing YAML file or key=value words")
        try:
            loaded = OmegaConf.load(word)
        except Exception as e:  # YAML syntax errors come in several types
            raise ConfigError(f"config file {word!r} is not valid YAML: {e}".splitlines()[0]) from None
        if not isinstance(loaded, DictConfig):
            raise ConfigError(
                f"config file {word!r} holds a list, not options; write one option per line as "
                "key: value, e.g. epochs: 5"
            )
        options: dict[str, Any] = _escaped(OmegaConf.to_container(loaded, resolve=False))
        return options
    if "=" not in word:
        raise ConfigError(
            f"{word!r} is neither key=value nor a .yaml file; write it as key=value, e.g. {_first_key(schema)}"
        )
    key, raw = word.split("=", 1)
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"{word!r} has an empty key; write it as key=value, e.g. {_first_key(schema)}")
    value = _escaped(_typed_value(word, raw, _field_type(schema, key) if schema is not None else str, schema))
    layer: dict[str, Any] = {}
    *groups, name = key.split(".")
    leaf = layer
    for group in groups:
        leaf = leaf.setdefault(group, {})
    leaf[name] = value
    return layer


def _first_key(schema: type | None) -> str:
    """``key=DEFAULT`` of the schema's first option, for the messages that show how a word is written."""
    if schema is None or not dataclasses.is_dataclass(schema):
        return "key=value"
    return _example(schema, _field_names(schema)[0])


def _typed_value(word: str, raw: str, kind: Any, schema: type | None) -> Any:
    """``raw`` converted to the option's type ``kind`` (see the module docstring); text for a group or an unknown key, whose
    merge names the problem."""
    if typing.get_origin(kind) is list:
        (item,) = typing.get_args(kind) or (str,)
        text = raw.strip()
        if text.startswith("[") and text.endswith("]"):
            text = text[1:-1]  # workers=[0,1], as YAML writes a list
        return [_typed_value(word, part.strip(), item, schema) for part in text.split(",")] if text.strip() else []
    if kind is not bool and bool in typing.get_args(kind):  # a Literal's word or a bool: checkpoint.async_save=auto
        words = [word for arg in typing.get_args(kind) for word in typing.get_args(arg)]
        if raw.strip() in words:
            return raw.strip()
        if raw.strip().lower() not in _TRUE + _FALSE:
            choices = ", ".join([*words, "true", "false"])
            raise ConfigError(f"{word.split('=', 1)[0]}={raw!r} is not valid; choose one of: {choices}")
        kind = bool
    if kind is bool:
        if raw.strip().lower() in _TRUE + _FALSE:
            return raw.strip().lower() in _TRUE
    elif kind is int:
        if _INTEGER.fullmatch(raw.strip()):
            return int(raw.strip())
    elif kind is float:
        try:
            # YAML's .inf and .nan too, so that the finite check names them (lr=.nan)
            return float(raw.strip().lower().replace(".inf", "inf").replace(".nan", "nan"))
        except ValueError:
            pass
    else:
        return raw
    key = word.split("=", 1)[0]
    example = _example(schema, key) if schema is not None else f"{key}=..."
    raise ConfigError(f"bad value for {key!r}: {key} must be {_TYPE_WORDS[kind]}, e.g. {example} (given {word!r})")


def _escaped(value: Any) -> Any:
    """``value`` with every ``${`` of its text (in lists and mappings too) escaped for OmegaConf: kept as written."""
    if isinstance(value, str):
        return _INTERPOLATION.sub(lambda m: m.group(1) * 2 + "\\${", value)
    if isinstance(value, list):
        return [_escaped(item) for item in value]
    if isinstance(value, dict):
        return {key: _escaped(item) for key, item in value.items()}
    return value


def _explain(error: OmegaConfBaseException, schema: type, word: str) -> str:
    key = getattr(error, "full_key", None) or ""
    message = str(error).splitlines()[0]
    if "not in struct" in message or "Key '" in message and "not in" in message:
        valid = _field_names(schema)
        close = difflib.get_close_matches(key.split(".")[-1], [v.split(".")[-1] for v in valid], n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return f"unknown config key {key!r}{hint}; valid keys: {', '.join(valid)}"
    expected = _field_type(schema, key)
    if isinstance(error, ValidationError) and expected in _TYPE_WORDS:
        given = f" (given {word!r})" if "=" in word else f" (given in {word})" if word else f" ({message})"
        return f"bad value for {key!r}: {key} must be {_TYPE_WORDS[expected]}, e.g. {_example(schema, key)}{given}"
    return f"bad value for {key!r}: {message}"


_TYPE_WORDS = {int: "a whole number", float: "a number", bool: "true or false", str: "a text value"}
"""How a type error names the type a key takes."""


def _field_type(schema: type, key: str) -> Any:
    """The type of the dotted ``key`` in ``schema`` (a dataclass type for a group), or None if it has none."""
    for part in key.split("."):
        hints = typing.get_type_hints(schema) if dataclasses.is_dataclass(schema) else {}
        if part not in hints:
            return None
        schema = hints[part]
    return schema


def _example(schema: type, key: str) -> str:
    """``key=DEFAULT``, the default written as a word (bools as true/false)."""
    value: Any = schema()
    for part in key.split("."):
        value = getattr(value, part)
    text = str(value).lower() if isinstance(value, bool) else str(value)
    return f"{key}={text}" if text else f"{key}=NAME"


def _check_groups(word: str, layer: Mapping[str, Any], schema: type, prefix: str = "") -> None:
    """Raise ConfigError where ``layer`` gives a group of options (``checkpoint``) a single value."""
    for name, value in layer.items():
        expected = _field_type(schema, prefix + str(name))
        if dataclasses.is_dataclass(expected) and not isinstance(value, Mapping):
            group = prefix + str(name)
            example = _example(schema, f"{group}.{dataclasses.fields(expected)[0].name}")
            raise ConfigError(
                f"{group} is a group of options, not a value ({word!r}); set one of its keys as "
                f"{group}.KEY=VALUE, e.g. {example}"
            )
        if dataclasses.is_dataclass(expected):
            _check_groups(word, value, schema, f"{prefix}{name}.")


def _field_names(schema: type, prefix: str = "") -> list[str]:
    """Every option's dotted key, in field order."""
    names = []
    for field in dataclasses.fields(schema):
        nested = field.default_factory if field.default_factory is not dataclasses.MISSING else field.type
        if isinstance(nested, type) and dataclasses.is_dataclass(nested):
            names += _field_names(nested, f"{prefix}{field.name}.")
        else:
            names.append(prefix + field.name)
    return names


def check_choice(name: str, value: str, choices: Sequence[str]) -> None:
    """Raise ConfigError unless ``value`` is one of ``choices``."""
    errors.check_choice(name, value, choices, ConfigError)


def check_positive(name: str, value: float, allow_zero: bool = False) -> None:
    """Raise ConfigError unless ``value`` > 0 (or >= 0 with ``allow_zero``)."""
    errors.check_positive(name, value, allow_zero, ConfigError)


COUNT_LIMIT = 1_000_000_000
"""The most an option that counts work (epochs, steps, samples, workers) may ask: a billion epochs or steps
never end, and numbers beyond it (a 23-digit epochs=) only make the run's sums spin before it starts."""


def check_count(name: str, value: int) -> None:
    """Raise ConfigError when ``value`` exceeds COUNT_LIMIT."""
    if value > COUNT_LIMIT:
        raise ConfigError(
            f"{name}={value} is more than any run can do; use at most {COUNT_LIMIT} (max_steps=N stops a long run)"
        )


HELP, GROUP, COUNTED = "help", "group", "counted"
"""The keys of an option's field metadata: its help text (else its docstring gives it), the group of the command's
help it is listed under, and whether it counts work (held to COUNT_LIMIT)."""


def option(default: T, *, help: str = "", group: str = "", counted: bool = False) -> T:
    """A dataclass field for a key=value option, its help, help group and count limit in the field's metadata.

    The one declaration that ``--help``, the groups of the help and the count checks read
    (:func:`option_names`), so that no list of field names is kept beside the class.
    """
    metadata = {HELP: help, GROUP: group, COUNTED: counted}
    return dataclasses.field(default=default, metadata=metadata)


def option_names(schema: type, *, group: str | None = None, counted: bool | None = None) -> tuple[str, ...]:
    """The names of ``schema``'s fields, in field order, whose metadata matches ``group`` and ``counted``."""
    return tuple(
        field.name
        for field in dataclasses.fields(schema)
        if (group is None or field.metadata.get(GROUP, "") == group)
        and (counted is None or field.metadata.get(COUNTED, False) == counted)
    )


def check_counts(config: Any) -> None:
    """Raise ConfigError when an option of ``config`` declared ``counted`` exceeds COUNT_LIMIT."""
    for name in option_names(type(config), counted=True):
        check_count(name, getattr(config, name))
