"""Non-finite weights: found per tensor, marked in the manifest, never counted by prune nor resumed."""

from __future__ import annotations

import math

import pytest
import torch

from ddpkit.checkpoint.disk.finite import (
    FINITE_KEY,
    is_finite_number,
    is_marked_nonfinite,
    last_finite_checkpoint,
    nonfinite_marker,
    nonfinite_tensors,
)
from ddpkit.checkpoint.disk.format import checkpoint_name, list_checkpoints, write_checkpoint
from ddpkit.checkpoint.manager.select import choose_checkpoint


def test_nonfinite_tensors_names_the_floating_tensors_with_nan_or_inf():
    state = {
        "model": {"w": torch.ones(3), "b": torch.tensor([1.0, math.nan]), "steps": torch.tensor([7])},
        "optimizer": {"state": {0: {"exp_avg": torch.tensor([math.inf])}}, "param_groups": [{"lr": 0.1}]},
        "empty": torch.empty(0),
        "half": torch.tensor([1.0], dtype=torch.float16),
    }
    assert nonfinite_tensors(state) == ["model.b", "optimizer.state.0.exp_avg"]
    assert nonfinite_tensors(torch.nn.Linear(2, 2).state_dict()) == []
    assert nonfinite_tensors({}) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64])
def test_each_float_type_is_judged_as_torch_isfinite_judges_it_wherever_the_bad_value_is(dtype):
    """NumPy's chunked check (half types by their exponent bits) agrees with torch.isfinite, past the first chunk."""
    info = torch.finfo(dtype)
    extremes = torch.tensor([info.max, -info.max, info.tiny, info.tiny / 4, 0.0, -0.0], dtype=dtype)
    size = (1 << 20) + 5  # a second chunk
    for bad in (math.nan, math.inf, -math.inf):
        for at in (0, 17, size - 1):
            values = torch.ones(size, dtype=dtype)
            values[at] = bad
            assert nonfinite_tensors({"v": values}) == ["v"], (dtype, bad, at)
    assert nonfinite_tensors({"v": torch.cat([torch.ones(size, dtype=dtype), extremes])}) == []
    strided = torch.ones(8, 8, dtype=dtype)[:, ::2]  # not contiguous
    strided[3, 1] = math.nan
    assert nonfinite_tensors({"v": strided, "neg": -torch.ones(4, dtype=dtype)}) == ["v"]


def test_the_nonfinite_marker_is_what_a_writer_adds_to_the_manifest(tmp_path):
    assert nonfinite_marker(nonfinite_tensors({"model.pt": {"w": torch.ones(2)}})) == {}
    marker = nonfinite_marker(nonfinite_tensors({"model.pt": {"w": torch.tensor([math.nan])}, "train.pt": {"step": 3}}))
    assert marker == {FINITE_KEY: False, "nonfinite_tensors": ["model.pt.w"]}
    path = _write(tmp_path, 1, math.nan, **marker)
    assert not list_checkpoints(tmp_path)[0].finite and path.is_dir()


def test_finite_numbers_and_manifest_marks():
    assert is_finite_number(0.5) and is_finite_number(3)
    assert not is_finite_number(math.nan) and not is_finite_number(-math.inf) and not is_finite_number("x")
    assert is_marked_nonfinite({FINITE_KEY: False})
    assert not is_marked_nonfinite({}) and not is_marked_nonfinite(None) and not is_marked_nonfinite({FINITE_KEY: True})


def _write(root, step, value, **meta):
    objects = {"model.pt": {"w": torch.full((2,), value)}}
    return write_checkpoint(root, checkpoint_name(step), objects, {}, {"global_step": step, **meta})


def test_last_finite_checkpoint_checks_the_suspect_ones_and_trusts_marks(tmp_path):
    _write(tmp_path, 1, 1.0)
    _write(tmp_path, 2, 2.0)
    _write(tmp_path, 3, math.nan)  # not marked: its writer did not check
    _write(tmp_path, 4, 4.0, finite=False)  # marked (whatever its files hold)
    path, bad = last_finite_checkpoint(tmp_path, suspect_from=3)
    assert path.name == checkpoint_name(2)
    assert [p.name for p in bad] == [checkpoint_name(4), checkpoint_name(3)]
    assert last_finite_checkpoint(tmp_path / "none") == (None, [])


def test_resume_never_takes_a_checkpoint_marked_non_finite(tmp_path):
    _write(tmp_path, 1, 1.0)
    _write(tmp_path, 2, math.nan, finite=False)
    path, _ = choose_checkpoint(tmp_path, "auto")
    assert path.name == checkpoint_name(1)
    assert (tmp_path / f"{checkpoint_name(2)}.nonfinite").is_dir()  # set aside, not deleted
    assert [info.path.name for info in list_checkpoints(tmp_path)] == [checkpoint_name(1)]
