"""A task's loss: the mean the training step uses is the sum over the samples divided by their number."""

import pytest
import torch

from ddpkit.train.task import Task


def _per_sample_l1(output, target):
    return (output - target).abs().mean(dim=1)


@pytest.mark.parametrize(
    ("task", "target"),
    [
        (Task("classification"), torch.tensor([0, 3, 1, 2, 3, 0, 1])),
        (Task("regression"), torch.randn(7, 4, generator=torch.Generator().manual_seed(1))),
        (Task("reconstruction"), None),
        (Task("regression", custom_loss=_per_sample_l1), torch.randn(7, 4, generator=torch.Generator().manual_seed(2))),
    ],
    ids=["classification", "regression", "reconstruction", "custom"],
)
def test_loss_mean_is_the_loss_sum_over_the_number_of_samples(task, target):
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(7, 4, generator=generator)
    output = torch.randn(7, 4, generator=generator, requires_grad=True)
    mean = task.loss_mean(output, inputs, target)
    (grad_of_mean,) = torch.autograd.grad(mean, output)
    total = task.loss_sum(output, inputs, target)
    (grad_of_sum,) = torch.autograd.grad(total, output)
    torch.testing.assert_close(mean, total / 7)
    torch.testing.assert_close(grad_of_mean, grad_of_sum / 7)
