"""Config words and files: overrides, presets and one-line errors."""

import dataclasses
import re

import pytest

from ddpkit.keyvalue import ConfigError, parse
from ddpkit.train.config import TrainConfig, parse_train_config


def test_words_files_and_order(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("epochs: 3\nlr: 0.5\n")
    cfg = parse(TrainConfig, [str(path), "lr=0.25"])
    assert (cfg.epochs, cfg.lr) == (3, 0.25)


@pytest.mark.parametrize(
    "word,resume",
    [("resume=false", "never"), ("resume=true", "auto"), ("resume=False", "never"), ("resume=a/b", "a/b")],
)
def test_resume_takes_true_and_false_as_auto_and_never(word, resume):
    assert parse(TrainConfig, [word]).resume == resume


def test_a_text_option_keeps_the_word_yaml_would_read_as_a_number(tmp_path):
    cfg = parse(TrainConfig, ["output_dir=1e3", "checkpoint.dir=007", "init_from=yes"])
    assert (cfg.output_dir, cfg.checkpoint.dir, cfg.init_from) == ("1e3", "007", "yes")
    path = tmp_path / "run.yaml"
    path.write_text("resume: false\n")
    assert parse(TrainConfig, [str(path)]).resume == "never"


def test_a_value_is_text_as_written_neither_yaml_nor_interpolated(tmp_path, monkeypatch):
    monkeypatch.setenv("DDPKIT_TEST_SECRET", "hunter2")
    cfg = parse(
        TrainConfig,
        [
            "output_dir=out #c",
            "data_mirror=${oc.env:DDPKIT_TEST_SECRET}",
            "init_from=\\${x}",
            "lr= 1e-2",
            "scale_lr=yes",
        ],
    )
    assert (cfg.output_dir, cfg.data_mirror, cfg.init_from) == ("out #c", "${oc.env:DDPKIT_TEST_SECRET}", "\\${x}")
    assert (cfg.lr, cfg.scale_lr) == (0.01, True)
    path = tmp_path / "run.yaml"
    path.write_text("data_mirror: ${oc.env:DDPKIT_TEST_SECRET}  # a comment, as YAML has them\n")
    assert parse(TrainConfig, [str(path)]).data_mirror == "${oc.env:DDPKIT_TEST_SECRET}"
    with pytest.raises(ConfigError) as error:
        parse(TrainConfig, ["epochs=${oc.env:DDPKIT_TEST_SECRET}"])
    assert "hunter2" not in str(error.value)


@pytest.mark.parametrize(
    "word, workers", [("workers=1", [1]), ("workers=1,2", [1, 2]), ("workers=[2]", [2]), ("workers=[1, 2]", [1, 2])]
)
def test_a_list_option_takes_one_value_or_several_with_or_without_brackets(word, workers):
    from ddpkit.bench.train import TrainBenchConfig

    assert parse(TrainBenchConfig, [word]).workers == workers


def test_model_recipe_is_default_and_overridable():
    cnn = parse_train_config(["model=cnn"])
    assert (cnn.optimizer, cnn.lr, cnn.momentum, cnn.batch_size, cnn.batch_scope) == (
        "sgd",
        0.01,
        0.5,
        16,
        "per_worker",
    )
    assert parse_train_config(["model=cnn", "lr=0.1"]).lr == 0.1


@pytest.mark.parametrize(
    "words,message",
    [
        (["epoch=3"], "unknown config key 'epoch' (did you mean 'epochs'?)"),
        (["epochs=many"], "bad value for 'epochs'"),
        (["nproc=0"], "nproc=0 is not valid; it must be > 0"),
        (["optimizer=rmsprop"], "optimizer='rmsprop' is not valid; choose one of: adam, sgd"),
        (["fast"], "'fast' is neither key=value nor a .yaml file"),
        (["missing.yaml"], "config file 'missing.yaml' does not exist"),
        (["master_port=70000"], "master_port=70000 is not a TCP port"),
        (["nproc=two"], "bad value for 'nproc': nproc must be a whole number, e.g. nproc=1 (given 'nproc=two')"),
        (["nproc=2.5"], "nproc must be a whole number, e.g. nproc=1 (given 'nproc=2.5')"),
        (["lr=fast"], "lr must be a number, e.g. lr=0.001 (given 'lr=fast')"),
        (["progress=maybe"], "progress must be true or false, e.g. progress=true (given 'progress=maybe')"),
        (
            ["checkpoint.keep="],
            "checkpoint.keep must be a whole number, e.g. checkpoint.keep=2 (given 'checkpoint.keep=')",
        ),
        # ${...} is never filled in: the line shows what was written, never the variable's value
        (["epochs=${oc.env:HOME}"], "epochs must be a whole number, e.g. epochs=5 (given 'epochs=${oc.env:HOME}')"),
        (["epochs=${nothing}"], "bad value for 'epochs': epochs must be a whole number, e.g. epochs=5 (given"),
        (
            ["checkpoint=5"],
            "checkpoint is a group of options, not a value ('checkpoint=5'); set one of its keys as "
            "checkpoint.KEY=VALUE, e.g. checkpoint.every_steps=0",
        ),
        (["task='"], 'task="\'" is not valid; choose one of: auto, classification'),  # text as written, not YAML
    ],
)
def test_bad_words_give_one_line(words, message):
    with pytest.raises(ConfigError) as info:
        parse(TrainConfig, words)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_type_errors_in_a_file_name_the_file(tmp_path):
    (tmp_path / "run.yaml").write_text("nproc: two\n")
    (tmp_path / "list.yaml").write_text("- epochs: 2\n")
    with pytest.raises(ConfigError, match=r"nproc must be a whole number, e.g. nproc=1 \(given in .*run.yaml\)$"):
        parse(TrainConfig, [str(tmp_path / "run.yaml")])
    with pytest.raises(ConfigError, match=r"list.yaml' holds a list, not options; write one option per line"):
        parse(TrainConfig, [str(tmp_path / "list.yaml")])


def test_unknown_model_lists_choices():
    with pytest.raises(
        ValueError,
        match="unknown model 'resnet'; choose one of: autoencoder, cnn, cnn_bn, mlp, or give module:function",
    ):
        parse_train_config(["model=resnet"])


def test_checkpoint_group_is_the_checkpointers_options_plus_the_trainers():
    from ddpkit.checkpoint.options import CheckpointOptions

    cfg = parse(TrainConfig, ["checkpoint.keep=3", "checkpoint.preempt_signals=USR1"])
    options = cfg.checkpoint.for_run("accuracy")
    assert type(options) is CheckpointOptions
    assert (options.keep, options.best_metric, options.best_mode, options.signal_names()) == (
        3,
        "accuracy",
        "max",
        ("SIGUSR1",),
    )
    assert (parse(TrainConfig, []).checkpoint.for_run("mse").best_mode) == "min"
    off = parse(TrainConfig, ["checkpoint.enabled=false", "checkpoint.every_steps=5"]).checkpoint.for_run("mse")
    assert (off.every_steps, off.on_epoch_end, off.best_metric, off.signal_names()) == (0, False, "", ())


@pytest.mark.parametrize(
    "word,message",
    [
        ("checkpoint.keep=0", "checkpoint.keep=0 is not valid; it must be > 0"),
        ("checkpoint.best_mode=up", "checkpoint.best_mode='up' is not valid; choose one of: auto, max, min"),
        ("checkpoint.best_metric=f1", "checkpoint.best_metric='f1' is not valid; choose one of: , auto, accuracy,"),
        ("checkpoint.preempt_signals=SIGKILL", "checkpoint.preempt_signals='SIGKILL' is not valid; choose one of:"),
        ("checkpoint.on_write_error=skip", "checkpoint.on_write_error='skip' is not valid; choose one of: stop, warn"),
    ],
)
def test_a_bad_checkpoint_option_names_its_dotted_key(word, message):
    with pytest.raises(ConfigError) as info:
        parse(TrainConfig, [word])
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


@pytest.mark.parametrize(
    "words,message",
    [
        (["nproc=0"], "nproc=0 is not valid; it must be > 0"),
        (["nproc=2000000000"], "nproc=2000000000 is more than any run can do"),
        (["nnodes=2", "master_port=29500"], "nnodes=2 needs master_addr=HOST"),
        (["show_ranks=first"], "show_ranks='first' is not valid"),
    ],
)
def test_train_and_run_take_the_launch_options_of_one_declaration(words, message):
    """TrainConfig and RunConfig extend LaunchOptions: the same words, help and checks (nproc's included, once)."""
    from ddpkit.commands.help import field_docs
    from ddpkit.launchers.options import LAUNCH_OPTIONS, LaunchOptions
    from ddpkit.launchers.script import RunConfig

    assert issubclass(TrainConfig, LaunchOptions) and issubclass(RunConfig, LaunchOptions)
    train_docs, run_docs = field_docs(TrainConfig), field_docs(RunConfig)
    assert all(train_docs[name] == run_docs[name] != "" for name in LAUNCH_OPTIONS)
    for schema in (TrainConfig, RunConfig, LaunchOptions):
        with pytest.raises(ConfigError, match="^" + re.escape(message)):
            parse(schema, words)


def test_the_help_groups_and_the_count_limits_come_from_each_options_declaration():
    from ddpkit.keyvalue import GROUP, option_names
    from ddpkit.train.config import TRAIN_GROUP_TITLES, TRAIN_OPTION_GROUPS

    grouped = [name for _, names in TRAIN_OPTION_GROUPS for name in names]
    assert sorted(grouped) == sorted(field.name for field in dataclasses.fields(TrainConfig))  # each in one group
    assert [title for title, _ in TRAIN_OPTION_GROUPS] == list(TRAIN_GROUP_TITLES)
    assert {"nproc", "max_restarts", "epochs"} <= set(option_names(TrainConfig, counted=True))
    assert all(field.metadata[GROUP] for field in dataclasses.fields(TrainConfig))
    with pytest.raises(ConfigError, match="^max_restarts=2000000000 is more than any run can do"):
        parse(TrainConfig, ["max_restarts=2000000000"])
