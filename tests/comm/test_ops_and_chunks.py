"""Operator rules, chunking and argument errors, in one process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ddpkit import comm
from ddpkit.comm import chunks, ops

R = dist.ReduceOp


def test_check_accepts_both_spellings_of_an_op():
    assert ops.check(R.SUM, torch.float32) == R.SUM
    assert ops.check(R(R.MAX), torch.int64) == R.MAX


@pytest.mark.parametrize(
    ("op", "dtype", "message"),
    [
        (R.BAND, torch.float32, r"ReduceOp.BAND needs an integer or bool tensor, got torch.float32"),
        (R.AVG, torch.bool, r"AVG is undefined for bool"),
        (R.PREMUL_SUM, torch.float32, r"not supported by ddpkit.comm; use one of SUM, PRODUCT, MIN, MAX, AVG"),
    ],
)
def test_check_rejects_unsupported_ops(op, dtype, message):
    with pytest.raises(ValueError, match=message):
        ops.check(op, dtype)


def test_integer_average_rounds_toward_zero():
    t = torch.tensor([-7, 7, -6, 5], dtype=torch.int32)
    ops.finish(t, R.AVG, 2)
    assert t.tolist() == [-3, 3, -3, 2]


def test_combine_keeps_operand_order_and_writes_in_place():
    a, b = torch.tensor([0.0, 2.0]), torch.tensor([-0.0, 1.0])
    out = a.clone()
    ops.combine(out, b, R.MIN, out=out)
    assert out.tolist() == [0.0, 1.0]


@pytest.mark.parametrize("numel", [0, 1, 5, 1023])
@pytest.mark.parametrize("num_chunks", [1, 2, 3, 4, 7])
def test_offsets_match_tensor_split(numel, num_chunks):
    parts = chunks.split(torch.arange(numel), num_chunks)
    bounds = chunks.offsets(numel, num_chunks)
    assert [p.numel() for p in parts] == [b - a for a, b in zip(bounds, bounds[1:])]


def test_segments_cover_the_chunk():
    chunk = torch.arange(1000, dtype=torch.float32)
    segs = chunks.segments(chunk, segment_bytes=400)
    assert len(segs) == 10 and torch.equal(torch.cat(segs), chunk)
    assert len(chunks.segments(torch.empty(0))) == 1


def test_flat_view_writes_back_into_strided_tensors():
    wide = torch.zeros(3, 4)
    view = wide[:, ::2]
    with chunks.flat_view(view) as flat:
        flat.copy_(torch.arange(6.0))
    assert wide.tolist() == [[0, 0, 1, 0], [2, 0, 3, 0], [4, 0, 5, 0]]


@pytest.fixture
def single_rank_group(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.usefixtures("single_rank_group")
@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: comm.all_gather([torch.zeros(2)] * 2, torch.zeros(2)), r"all_gather got 2 output tensors for a group"),
        (lambda: comm.all_gather([torch.zeros(3)], torch.zeros(2)), r"all_gather output 0 is \(3,\)"),
        (lambda: comm.reduce(torch.zeros(2), 1), r"reduce dst rank 1 is outside the group of 1 ranks"),
        (lambda: comm.broadcast(torch.zeros(2), -1), r"broadcast src rank -1 is outside"),
        (lambda: comm.gather(torch.zeros(2), None, dst=0), r"needs gather_list with one tensor per rank \(1\)"),
        (lambda: comm.scatter(torch.zeros(2), [torch.zeros(3)], src=0), r"scatter_list\[0\] is \(3,\)"),
        (lambda: comm.reduce_scatter(torch.zeros(2), []), r"reduce_scatter got 0 inputs for a group of 1"),
        (lambda: comm.reduce_scatter_tensor(torch.zeros(2), torch.zeros(3)), r"needs world_size \* output.numel\(\)"),
        (lambda: comm.all_to_all([], [torch.zeros(1)]), r"all_to_all got 0 outputs and 1 inputs"),
        (
            lambda: comm.all_to_all_single(torch.zeros(2), torch.zeros(2), input_split_sizes=[1]),
            r"input_split_sizes \[1\] must have 1 entries adding up to input.shape\[0\] = 2",
        ),
        (lambda: comm.all_reduce(torch.zeros(2), op=R.BXOR), r"BXOR needs an integer"),
    ],
)
def test_bad_arguments_raise_value_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.usefixtures("single_rank_group")
def test_world_size_one_is_identity_except_avg():
    for name in ["builtin", "naive", "ring", "butterfly", "tree"]:  # shm has its own tests
        t = torch.tensor([3, -5], dtype=torch.int64)
        comm.resolve_allreduce(name)(t, op=R.AVG)
        assert t.tolist() == [3, -5], name
