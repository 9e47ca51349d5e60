"""Your own training loop, made data-parallel with ddpkit's pieces.

Run it alone, or as N workers of any launcher:

    python examples/own_training_loop.py
    torchrun --nproc-per-node 2 examples/own_training_loop.py
    srun -n 2 python examples/own_training_loop.py
    mpirun -np 2 python examples/own_training_loop.py

ddpkit.init() finds out who this process is, picks the device and backend and
joins the process group; GlobalBatchSampler gives each worker its share of
the same global batches whatever the number of workers.
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpkit
from ddpkit.data.datasets import DataOptions, load_dataset
from ddpkit.data.sampler import GlobalBatchSampler
from ddpkit.train.metrics import reduce_sums

GLOBAL_BATCH = 64


def main() -> None:
    ctx = ddpkit.init()
    with ddpkit.main_process_first():  # download once per node, the others wait
        data = load_dataset("synthetic", DataOptions(synthetic_samples=4096)).to(ctx.device)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(784, 64), nn.ReLU(), nn.Linear(64, 10)).to(ctx.device)
    if ctx.world_size > 1:
        model = DDP(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    sampler = GlobalBatchSampler(len(data.train_labels), GLOBAL_BATCH, ctx.rank, ctx.world_size)

    for epoch in range(2):
        for indices in sampler.epoch(epoch):
            x = data.train_images[indices].float() / 255
            loss = F.cross_entropy(model(x), data.train_labels[indices])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

        # Exact accuracy over the whole test set: each rank counts its part, then sum.
        part = torch.tensor_split(torch.arange(len(data.test_labels)), ctx.world_size)[ctx.rank]
        with torch.no_grad():
            correct = (model(data.test_images[part].float() / 255).argmax(1) == data.test_labels[part]).sum()
        totals = reduce_sums({"correct": correct, "count": len(part)})
        if ctx.is_main_process:
            print(f"epoch {epoch + 1}: test accuracy {100 * totals['correct'] / totals['count']:.2f}%")
    ddpkit.shutdown()


if __name__ == "__main__":
    main()
