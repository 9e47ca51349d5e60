"""W3 as people write it: an autoencoder on Fashion-MNIST images (no labels), trained on MSE.

Made data-parallel and resumable with ddpkit: the lines marked ``# ddpkit``
are all that changed from the single-process script; on a GPU the batches
arrive there, so no line needs a ``.to(device)``. The loss is summed per
sample and turned into the exact mean over the global batch by
``loader.global_mean``, so the last, smaller batch of an epoch weighs each
sample as the others do, whatever the number of workers.

    ddpkit run nproc=2 examples/autoencoder_fashion_mnist.py --epochs 2
    torchrun --nproc-per-node 2 examples/autoencoder_fashion_mnist.py
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

import ddpkit  # ddpkit
from ddpkit.datasets import DataOptions, load_images


class Pixels(Dataset):
    """Images alone, flattened, pixels in [0, 1]."""

    def __init__(self, images: torch.Tensor):
        self.images = images

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.images[i].flatten().float() / 255


def autoencoder() -> nn.Module:
    return nn.Sequential(
        nn.Linear(784, 128),
        nn.ReLU(),
        nn.Linear(128, 32),
        nn.ReLU(),
        nn.Linear(32, 128),
        nn.ReLU(),
        nn.Linear(128, 784),
        nn.Sigmoid(),
    )


def per_sample_mse(output: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, x, reduction="none").mean(dim=1)


@torch.no_grad()
def test_mse(model: nn.Module, loader) -> float:
    model.eval()
    sums = {"mse": 0.0, "count": 0}
    for x in loader:
        sums["mse"] += per_sample_mse(model(x), x).sum()
        sums["count"] += len(x)
    sums = ddpkit.reduce_sums(sums)  # ddpkit
    model.train()
    return sums["mse"] / sums["count"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--dataset", default="fashion-mnist", help="fashion-mnist, mnist or synthetic")
    parser.add_argument("--samples", type=int, default=60000, help="training samples of --dataset synthetic")
    parser.add_argument("--out", default="runs/autoencoder-fashion-mnist")
    args = parser.parse_args()

    ctx = ddpkit.init()  # ddpkit
    torch.manual_seed(0)
    with ddpkit.main_process_first():  # ddpkit
        data = load_images(args.dataset, DataOptions(synthetic_samples=args.samples))
    train_set, test_set = Pixels(data.train_images), Pixels(data.test_images)

    model = ddpkit.prepare_model(autoencoder())  # ddpkit
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    loader = ddpkit.DataLoader(train_set, global_batch_size=128, shuffle=True, seed=0, num_workers=2)  # ddpkit
    # Persistent: its workers are started once, not again at every evaluation (no fork while another iterator's
    # threads end, which can deadlock the forked worker in CPython 3.11).
    test_loader = ddpkit.DataLoader(
        test_set, global_batch_size=1000, shuffle=False, num_workers=2, persistent_workers=True
    )  # ddpkit
    ckpt = ddpkit.Checkpointer(
        args.out,
        model=model,
        optimizer=optimizer,
        loader=loader,  # ddpkit
        every_steps=500,
        best_metric="mse",
        best_mode="min",
    )  # ddpkit
    start = ckpt.resume("auto")  # ddpkit

    for epoch in range(start.epoch, args.epochs):
        loader.set_epoch(epoch)  # ddpkit
        for x in loader:
            loss = loader.global_mean(per_sample_mse(model(x), x).sum())  # ddpkit: exact mean of the global batch
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            ckpt.step()  # ddpkit
        mse = test_mse(model, test_loader)
        ckpt.epoch_end({"mse": mse})  # ddpkit
        if ctx.is_main_process:
            print(f"epoch {epoch + 1}: test mse {mse:.5f}", flush=True)
    ckpt.close()  # ddpkit


if __name__ == "__main__":
    main()
