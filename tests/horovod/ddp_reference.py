"""examples/horovod_mnist.py trained with stock DDP instead of ddpkit.horovod, for its tests to compare against.

The same batches, in the same order, from the same seed and the example's
own functions: only DistributedOptimizer and the broadcasts are replaced by
torch's DistributedDataParallel (which broadcasts rank 0's weights itself).
"""

from __future__ import annotations

import functools
import importlib.util
from types import ModuleType

import torch

from tests.cli_runner import REPO
from tests.helpers.workers import run_on_ranks

SCRIPT = REPO / "examples" / "horovod_mnist.py"
TINY = [
    "--dataset",
    "synthetic",
    "--train-samples",
    "512",
    "--test-samples",
    "256",
    "--epochs",
    "2",
    "--batch-size",
    "32",
    "--log-interval",
    "1000",
]
"""Arguments for a run of a few seconds: 2 epochs of 8 steps on each of 2 workers."""


def load_example() -> ModuleType:
    """The example as a module (it only runs when executed as a script)."""
    spec = importlib.util.spec_from_file_location("horovod_mnist", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _train_with_ddp(rank: int, world_size: int, argv: list[str]) -> dict[str, torch.Tensor]:
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    example = load_example()
    args = example.parse_args(argv)
    device = torch.device("cpu")
    torch.manual_seed(args.seed)
    train_set, test_set = example.datasets(args)
    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler)
    test_sampler = DistributedSampler(test_set, num_replicas=world_size, rank=rank, shuffle=False)
    test_loader = DataLoader(test_set, batch_size=args.test_batch_size, sampler=test_sampler)
    model = DDP(example.Net())
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * world_size, momentum=args.momentum)
    for epoch in range(1, args.epochs + 1):
        example.train_epoch(model, optimizer, train_loader, train_sampler, epoch, args, device, log=False)
        example.evaluate(model, test_loader, device)  # draws from the RNG as the example's test does
    return {name: t.detach().clone() for name, t in model.module.state_dict().items()}


@functools.cache
def ddp_weights(argv: tuple[str, ...] = tuple(TINY), world_size: int = 2) -> dict[str, torch.Tensor]:
    """Rank 0's final weights of the example's training under stock DDP (computed once per session)."""
    return run_on_ranks(_train_with_ddp, world_size, list(argv), timeout=240)[0]


def assert_same_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Every tensor equal to float32 rounding (the two all_reduces may add in different orders)."""
    assert got.keys() == want.keys()
    for name in want:
        assert torch.allclose(got[name], want[name], rtol=1e-5, atol=1e-6), (
            f"{name} differs from stock DDP by {(got[name] - want[name]).abs().max():.3g}"
        )
