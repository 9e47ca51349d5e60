"""What ddpkit.horovod does not support fails at once, with one line naming what to use instead."""

from __future__ import annotations

import pytest
import torch

import ddpkit.horovod as hvd
from ddpkit.horovod import HorovodUnsupportedError


@pytest.mark.parametrize(
    ("call", "alternative"),
    [
        (lambda: hvd.allreduce(torch.ones(2), op=hvd.Adasum), "use op=hvd.Average"),
        (lambda: hvd.allreduce_async_(torch.ones(2), op=hvd.Adasum), "use op=hvd.Average"),
        (
            lambda: hvd.DistributedOptimizer(torch.optim.SGD([torch.zeros(1, requires_grad=True)]), op=hvd.Adasum),
            "use op=hvd.Average",
        ),
        (lambda: hvd.elastic.run, r"ddpkit.Checkpointer .* `ddpkit run max_restarts=N`"),
        (lambda: hvd.elastic.TorchState, r"ddpkit.Checkpointer"),
        (lambda: hvd.ProcessSet([0, 1]), "process_set=hvd.global_process_set"),
        (lambda: hvd.add_process_set([0]), "torch.distributed.new_group"),
        (lambda: hvd.remove_process_set(hvd.global_process_set), "torch.distributed.new_group"),
        (lambda: hvd.allreduce(torch.ones(2), process_set=object()), "process_set=hvd.global_process_set"),
        (lambda: hvd.broadcast_parameters({}, root_rank=0, process_set=object()), "global_process_set"),
        (lambda: hvd.init(process_sets=[object()]), "global_process_set"),
        (lambda: hvd.init(comm=[0, 1]), r"call hvd.init\(\) with no arguments"),
        (lambda: hvd.SyncBatchNorm, r"torch.nn.SyncBatchNorm through ddpkit.prepare_model"),
    ],
)
def test_unsupported_names_raise_one_line_with_the_alternative(call, alternative):
    with pytest.raises(HorovodUnsupportedError, match=alternative) as raised:
        call()
    assert isinstance(raised.value, ValueError)
    assert "\n" not in str(raised.value)


def test_before_init_every_query_says_to_call_init():
    assert not hvd.is_initialized()
    for query in (hvd.rank, hvd.size, hvd.local_rank, hvd.cross_size, hvd.is_homogeneous):
        with pytest.raises(ValueError, match=r"call hvd.init\(\) first"):
            query()
    with pytest.raises(ValueError, match=r"call hvd.init\(\) first"):
        hvd.allreduce(torch.ones(1))


def test_unknown_names_stay_attribute_errors():
    with pytest.raises(AttributeError, match="no attribute 'bogus'"):
        hvd.bogus  # noqa: B018


def test_distributed_optimizer_rejects_bad_arguments_before_any_collective():
    param = torch.zeros(1, requires_grad=True)
    with pytest.raises(ValueError, match="backward_passes_per_step=0 must be >= 1"):
        hvd.DistributedOptimizer(torch.optim.SGD([param]), backward_passes_per_step=0)
    with pytest.raises(ValueError, match="gradient_predivide_factor needs op=hvd.Average"):
        hvd.DistributedOptimizer(torch.optim.SGD([param]), op=hvd.Sum, gradient_predivide_factor=2.0)
