"""``--help`` of every command, generated from the config dataclasses; ``--version``; the top-level usage."""

from __future__ import annotations

import dataclasses

import pytest

from ddpkit import __version__
from ddpkit.commands.bench import KINDS
from ddpkit.commands.dispatch import COMMANDS, main
from ddpkit.commands.help import field_docs, load_schema
from ddpkit.train.config import TrainConfig


def help_text(capsys, *words: str) -> str:
    assert main(list(words)) == 0
    out, err = capsys.readouterr()
    assert err == ""
    return out


def dotted_fields(schema: type, prefix: str = "") -> list[tuple[str, type, str]]:
    """(dotted key, owning class, field name) of every leaf field, walked here independently of the help code."""
    found = []
    for field in dataclasses.fields(schema):
        nested = field.default_factory if field.default_factory is not dataclasses.MISSING else None
        if nested is not None and dataclasses.is_dataclass(nested):
            found += dotted_fields(nested, f"{prefix}{field.name}.")
        else:
            found.append((prefix + field.name, schema, field.name))
    return found


def test_train_help_names_every_config_field_with_its_default_and_docstring(capsys):
    text = help_text(capsys, "train", "--help")
    fields = dotted_fields(TrainConfig)
    assert len(fields) > 50 and any(key.startswith("checkpoint.") for key, _, _ in fields)
    for key, owner, name in fields:
        assert f"\n  {key}=<" in text, f"{key} is missing from ddpkit train --help"
        doc = field_docs(owner)[name]
        assert doc.split()[0] in text.split(f"\n  {key}=<", 1)[1].split("\n  ")[1], key
    assert "(default: 0.001)" in text.split("\n  lr=<float>", 1)[1].splitlines()[0]
    assert "(default: SIGTERM,SIGINT,SIGUSR1,SIGUSR2)" in text
    for group in ("model and data:", "optimization:", "distributed:", "checkpoints:", "output:"):
        assert f"\n{group}\n" in text
    assert "other options:" not in text  # every field is in a group


def test_a_field_in_no_group_is_still_listed(capsys):
    from ddpkit.commands.help import CommandHelp, render_help

    text = render_help(
        CommandHelp(
            usage="x",
            summary="y",
            schema="ddpkit.train.config:CheckpointConfig",
            groups=(("cadence", ("every_steps", "every_seconds")),),
        )
    )
    assert "\ncadence:\n  every_steps=<int>" in text
    assert "\nother options:\n  on_epoch_end=<bool>" in text and "  requeue=<bool>" in text
    assert "  enabled=<bool>" in text  # a field the trainer's CheckpointConfig adds to the Checkpointer's


@pytest.mark.parametrize(
    "words",
    [
        *[[name, flag] for name in COMMANDS for flag in ("--help", "-h")],
        *[["bench", kind, "--help"] for kind in KINDS],
        ["train", "epochs=3", "--help"],
        ["run", "nproc=2", "--help"],
    ],
)
def test_every_command_has_help(capsys, words):
    text = help_text(capsys, *words)
    assert text.startswith("usage: ddpkit ")
    name = words[0] if words[0] != "bench" or words[1].startswith("-") else f"bench {words[1]}"
    assert text.startswith(f"usage: ddpkit {name}")


@pytest.mark.parametrize("name", [name for name, command in COMMANDS.items() if command.help.schema])
def test_each_help_lists_every_field_of_its_schema(capsys, name):
    text = help_text(capsys, name, "--help")
    for key, _, _ in dotted_fields(load_schema(COMMANDS[name].help.schema)):
        assert f"\n  {key}=<" in text, f"{key} is missing from ddpkit {name} --help"


@pytest.mark.parametrize("kind", list(KINDS))
def test_each_benchmark_help_lists_every_field(capsys, kind):
    text = help_text(capsys, "bench", kind, "--help")
    for key, _, _ in dotted_fields(load_schema(KINDS[kind].schema)):
        assert f"\n  {key}=<" in text, f"{key} is missing from ddpkit bench {kind} --help"


def test_help_after_the_script_belongs_to_the_script():
    from ddpkit.launchers.script import wants_run_help

    assert wants_run_help(["nproc=2", "-h"])
    assert not wants_run_help(["nproc=2", "train.py", "--help"])
    assert not wants_run_help(["-m", "pkg.mod", "--help"])


def test_version_and_usage(capsys):
    assert help_text(capsys, "--version") == f"ddpkit {__version__}\n"
    usage = help_text(capsys, "--help")
    assert help_text(capsys) == usage
    for name, command in COMMANDS.items():
        assert f"\n  {name:<12} {command.brief}\n" in usage


def test_unknown_command_suggests_the_close_one(capsys):
    assert main(["trian"]) == 2
    _, err = capsys.readouterr()
    assert err.startswith("error: unknown command 'trian' (did you mean 'train'?); choose one of: train, run,")


@pytest.mark.parametrize("words", [["--help"], *[[name, "--help"] for name in COMMANDS if name != "bench"]])
def test_users_help_never_names_the_benchmarks_workload_labels(capsys, words):
    """W1, W2, W3 are the benchmarks' names of workloads; a user's help names the models (model=mlp)."""
    import re

    text = help_text(capsys, *words)
    assert re.findall(r"\bW[0-9]+\b", text) == [], f"ddpkit {' '.join(words)}"


def test_an_option_of_words_or_a_bool_shows_its_words(capsys):
    from ddpkit.commands.help import shown_type

    assert shown_type("Literal['auto'] | bool") == "auto|true|false"
    assert shown_type("Literal['max', 'min']") == "max|min"
    assert shown_type("int") == "int"
    assert main(["train", "--help"]) == 0
    assert "checkpoint.async_save=<auto|true|false>   (default: auto)" in capsys.readouterr().out
