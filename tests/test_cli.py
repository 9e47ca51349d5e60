"""Bad input to the ddpkit command: one clear line, a non-zero exit, nothing lost."""

import pytest

from ddpkit.commands.dispatch import main
from ddpkit.models import MODELS, get_model_spec
from tests.cli_runner import run_ddpkit


@pytest.mark.parametrize(
    "words,message",
    [
        (["train", "nproc=0"], "error: nproc=0 is not valid; it must be > 0"),
        (["train", "nproc=3"], "error: global batch size 64 does not divide among 3 workers"),
        (["train", "epoch=2"], "error: unknown config key 'epoch' (did you mean 'epochs'?)"),
        (["fly"], "error: unknown command 'fly'"),
    ],
)
def test_bad_input_is_one_line(tmp_path, monkeypatch, capsys, words, message):
    monkeypatch.chdir(tmp_path)
    assert main(words) == 2  # in-process: the exit path of the command itself is checked below
    out = capsys.readouterr()
    assert out.err.startswith(message) and out.err.count("\n") == 1, out.err
    assert out.out == ""


def test_bad_input_exits_2_from_the_command(tmp_path):
    out = run_ddpkit("train", "nproc=0", cwd=tmp_path, timeout=60)
    assert out.returncode == 2
    assert out.stderr == "error: nproc=0 is not valid; it must be > 0\n", out.stderr


def test_unknown_model_lists_every_registered_one(tmp_path, monkeypatch, capsys):
    get_model_spec("mlp")  # registers the reference models here too
    reference = sorted(name for name, spec in MODELS.items() if spec.build.__module__.startswith("ddpkit.models."))
    assert {"autoencoder", "cnn", "mlp"} <= set(reference)
    monkeypatch.chdir(tmp_path)
    assert main(["train", "model=resnet"]) == 2  # in-process, as above
    assert capsys.readouterr().err == (
        f"error: unknown model 'resnet'; choose one of: {', '.join(reference)}, or give module:function\n"
    )


def test_missing_data_offline_and_corrupt_file(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["train", f"data_dir={tmp_path / 'none'}", "download=false"]) == 2  # in-process, as above
    assert "fashion-mnist not found in" in capsys.readouterr().err
    folder = tmp_path / "fm"
    folder.mkdir()
    for name in (
        "train-images-idx3-ubyte.gz",
        "train-labels-idx1-ubyte.gz",
        "t10k-images-idx3-ubyte.gz",
        "t10k-labels-idx1-ubyte.gz",
    ):
        (folder / name).write_bytes(
            (__import__("pathlib").Path("/usr/share/datasets/fashion-mnist") / name).read_bytes()
        )
    damaged = folder / "train-labels-idx1-ubyte.gz"
    damaged.write_bytes(damaged.read_bytes()[:1000])
    before = damaged.read_bytes()
    assert main(["train", f"data_dir={folder}", "progress=false"]) in (1, 2)  # nproc=1: trains in this process
    err = capsys.readouterr().err
    assert "train-labels-idx1-ubyte.gz is not a complete gzip file" in err
    assert "Traceback" not in err
    assert damaged.read_bytes() == before, "ddpkit must not touch the user's files"
