"""Publishing and reusing weights: export, init_from with a report, freeze, and the checkpoint listing."""

import json
import stat

import pytest
import torch

from ddpkit.checkpoint.disk.format import CheckpointError, checkpoint_name
from ddpkit.checkpoint.publishing.export import load_exported
from ddpkit.checkpoint.publishing.transfer import freeze_parameters, load_matching
from ddpkit.commands.dispatch import main
from tests.train.checkpoint_helpers import LogRecords, close, make_trainer, mlp_dropout, mlp_dropout_new_head, train
from tests.train.test_checkpoint import Payload, plant_payload

WORDS = ["model=tests.train.checkpoint_helpers:mlp_dropout", "synthetic_samples=90", "batch_size=8", "epochs=1"]


def _train(words):
    trainer, _ = train(0, 1, words)
    return trainer


@pytest.fixture
def trained(tmp_path):
    """A run stopped at step 5 with checkpoints every 2 steps: step-4 and step-5 are kept."""
    trainer = _train([*WORDS, f"output_dir={tmp_path}", "max_steps=5", "checkpoint.every_steps=2"])
    return trainer, tmp_path / "checkpoints"


def test_export_then_init_from_reports_the_changed_layer(trained, tmp_path, capsys):
    trainer, root = trained
    assert main(["export", str(root / checkpoint_name(5)), str(tmp_path / "exported")]) == 0
    assert "exported" in capsys.readouterr().out
    info = json.loads((tmp_path / "exported" / "model.json").read_text())
    assert (
        info["model"]["name"] == "tests.train.checkpoint_helpers:mlp_dropout"
        and info["model"]["task"] == "classification"
    )
    assert info["source"]["global_step"] == 5
    assert stat.S_IMODE((tmp_path / "exported" / "model.pt").stat().st_mode) == 0o600

    model, _ = load_exported(tmp_path / "exported")
    trained_weights = trainer.module.state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, trained_weights[name])

    with LogRecords() as logs:
        new = make_trainer(
            0,
            1,
            [
                "model=tests.train.checkpoint_helpers:mlp_dropout_new_head",
                "epochs=1",
                "synthetic_samples=90",
                f"init_from={tmp_path / 'exported'}",
                f"output_dir={tmp_path}/new",
            ],
        )
    close(new)
    report = "\n".join(message for _, message in logs.messages)
    assert "loaded 2 tensor(s)" in report, report
    assert "shape mismatch (not loaded): 4.weight: (10, 32) in the source, (5, 32) in the model" in report, report
    assert "shape mismatch (not loaded): 4.bias: (10,) in the source, (5,) in the model" in report, report
    assert "missing (kept their initialisation): 5.weight, 5.bias" in report, report
    fresh = new.module.state_dict()
    assert torch.equal(fresh["1.weight"], trained_weights["1.weight"])
    assert torch.equal(fresh["1.bias"], trained_weights["1.bias"])
    assert not torch.equal(fresh["4.bias"], trained_weights["4.bias"][:5])


def test_unexpected_keys_are_reported():
    report = load_matching(mlp_dropout(), mlp_dropout_new_head().state_dict(), "a file")
    assert report.unexpected == ("5.weight", "5.bias")
    assert [m[0] for m in report.mismatched] == ["4.weight", "4.bias"]


def test_init_from_a_checkpoints_folder_then_freeze_keeps_frozen_layers_fixed(trained, tmp_path):
    trainer, root = trained
    source = trainer.module.state_dict()
    tuned = _train([*WORDS, f"output_dir={tmp_path}/tuned", f"init_from={root}", "freeze=1"])
    after = tuned.module.state_dict()
    assert torch.equal(after["1.weight"], source["1.weight"]) and torch.equal(after["1.bias"], source["1.bias"])
    assert not torch.equal(after["4.weight"], source["4.weight"])  # the head trained on


def test_freeze_of_an_unknown_name_lists_the_parameters():
    with pytest.raises(ValueError, match=r"freeze='7' matches no parameter .* 1\.weight, 1\.bias, 4\.weight, 4\.bias"):
        freeze_parameters(mlp_dropout(), "7")


def test_export_and_init_from_refuse_a_crafted_pickle(trained, tmp_path, capsys):
    _, root = trained
    sentinel = tmp_path / "sentinel"
    plant_payload(root / checkpoint_name(5), sentinel)
    assert main(["export", str(root / checkpoint_name(5)), str(tmp_path / "out")]) == 2
    assert "refused to load" in capsys.readouterr().err
    torch.save({"w": Payload(sentinel)}, tmp_path / "evil.pt")
    with pytest.raises(CheckpointError, match="refused to load"):
        make_trainer(0, 1, [*WORDS, f"init_from={tmp_path / 'evil.pt'}"])
    assert not sentinel.exists()


def test_checkpoints_listing_shows_step_epoch_metric_size_and_verification(trained, tmp_path, capsys):
    _, root = trained
    _train([*WORDS, f"output_dir={tmp_path}", "resume=auto"])  # on to the epoch end, evaluated: step-12
    model_file = root / checkpoint_name(5) / "model.pt"
    model_file.write_bytes(model_file.read_bytes()[:-10])
    (root / checkpoint_name(13)).mkdir()  # an interrupted write
    assert main(["checkpoints", str(tmp_path)]) == 1  # the newest folder is not a checkpoint (yet)
    out, err = capsys.readouterr()
    assert err.strip().splitlines()[-1] == (
        f"ddpkit: the newest checkpoint {checkpoint_name(13)} is not usable (incomplete); "
        f"resume=auto would continue from {checkpoint_name(12)}"
    )
    lines = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert lines[checkpoint_name(12)].split()[1:3] == ["12", "1"], lines
    assert "accuracy" in lines[checkpoint_name(12)] and "KB" in lines[checkpoint_name(12)]
    assert lines[checkpoint_name(12)].endswith("ok, newest")
    assert "CORRUPT" in lines[checkpoint_name(5)] and "model.pt is truncated" in lines[checkpoint_name(5)]
    assert lines[checkpoint_name(5)].split()[2] == "0+5/12"
    assert "incomplete" in lines[checkpoint_name(13)]
    assert lines["best-000000012"].endswith("ok, best")
