"""The train and eval lines ``ddpkit train`` writes to metrics.jsonl: which steps they cover and their values.

The loss here is the training step's number (1, 2, ...) for every sample, with no gradient, so a line's
loss must be the mean of the step numbers it covers: a line that divides by more steps than it covers,
or steps that no line covers, show at once.
"""

from __future__ import annotations

import json

import torch

from tests.train.checkpoint_helpers import close, make_trainer

_STEP = [0]


def step_number(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The training step's number (counted from 1) as every sample's loss, no gradient; 0 in evaluation."""
    if torch.is_grad_enabled():
        _STEP[0] += 1
        return output.sum(dim=1) * 0 + _STEP[0]
    return output.sum(dim=1) * 0


def _lines(tmp_path, *words):
    _STEP[0] = 0
    # 101 samples in global batches of 6: 17 steps per epoch, the last one of 5 samples
    trainer = make_trainer(
        0,
        1,
        [
            "model=mlp",
            "synthetic_samples=101",
            "batch_size=6",
            "log_every=5",
            "loss=tests.train.test_metrics_lines:step_number",
            f"output_dir={tmp_path}",
            "checkpoint.enabled=false",
            *words,
        ],
    )
    try:
        trainer.fit()
    finally:
        close(trainer)
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def test_every_step_is_logged_once_and_each_line_is_the_mean_of_its_steps(tmp_path):
    lines = _lines(tmp_path, "epochs=2")
    train = [line for line in lines if line["event"] == "train"]
    assert [line["global_step"] for line in train] == [5, 10, 15, 17, 20, 25, 30, 34]
    ends = [0] + [line["global_step"] for line in train]
    for start, line in zip(ends, train):
        assert line["loss"] == (start + 1 + line["global_step"]) / 2, line  # the mean of steps start+1..end
    assert [line["epoch"] for line in train] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_max_steps_writes_the_final_test_metrics(tmp_path):
    lines = _lines(tmp_path, "epochs=2", "max_steps=22")
    train = [line for line in lines if line["event"] == "train"]
    assert [line["global_step"] for line in train] == [5, 10, 15, 17, 20, 22]
    assert train[-1]["loss"] == 21.5
    evals = [line for line in lines if line["event"] == "eval"]
    assert [(line["global_step"], line["epoch"]) for line in evals] == [(17, 1), (22, 1 + 5 / 17)]
    assert evals[-1]["loss"] == 0.0 and evals[-1]["loss"] == lines[-1]["test"]["loss"]
