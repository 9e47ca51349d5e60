"""W2 as people write it: PyTorch's MNIST CNN, with a random augmentation, dropout and StepLR.

Made data-parallel and resumable with ddpkit: the lines marked ``# ddpkit``
are all that changed from the single-process script; on a GPU the batches
arrive there, so no line needs a ``.to(device)``. The random shift in
the Dataset draws the same numbers for a sample whatever the number of
workers or DataLoader workers (ddpkit seeds each sample by seed, epoch and
index), so a resumed run, even at another world size, sees the same data.

    ddpkit run nproc=2 max_restarts=3 examples/cnn_mnist.py --epochs 1
    torchrun --nproc-per-node 2 examples/cnn_mnist.py
"""

import argparse
import random

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

import ddpkit  # ddpkit
from ddpkit.datasets import DataOptions, load_images


class ShiftedImages(Dataset):
    """Images shifted by up to ``shift`` pixels at random, normalized as the MNIST example does."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, shift: int = 0):
        self.images, self.labels, self.shift = images, labels, shift

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        image = (self.images[i].float() / 255 - 0.1307) / 0.3081
        if self.shift:
            dx, dy = random.randint(-self.shift, self.shift), random.randint(-self.shift, self.shift)
            image = torch.roll(image, shifts=(dy, dx), dims=(1, 2))
        return image, self.labels[i]


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 32, 3),
        nn.ReLU(),
        nn.Conv2d(32, 32, 3),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Dropout(0.25),
        nn.Flatten(),
        nn.Linear(4608, 128),
        nn.ReLU(),
        nn.Dropout(0.5),
        nn.Linear(128, 10),
    )


@torch.no_grad()
def accuracy(model: nn.Module, loader) -> float:
    model.eval()
    sums = {"correct": 0, "count": 0}
    for x, y in loader:
        sums["correct"] += (model(x).argmax(1) == y).sum()
        sums["count"] += len(y)
    sums = ddpkit.reduce_sums(sums)  # ddpkit
    model.train()
    return sums["correct"] / sums["count"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--batch-size", type=int, default=32, help="global batch")
    parser.add_argument("--dataset", default="fashion-mnist", help="fashion-mnist, mnist or synthetic")
    parser.add_argument("--samples", type=int, default=60000, help="training samples of --dataset synthetic")
    parser.add_argument("--every-steps", type=int, default=200, help="checkpoint cadence")
    parser.add_argument("--out", default="runs/cnn-mnist")
    args = parser.parse_args()

    ctx = ddpkit.init()  # ddpkit
    torch.manual_seed(0)
    with ddpkit.main_process_first():  # ddpkit
        data = load_images(args.dataset, DataOptions(synthetic_samples=args.samples))
    train_set = ShiftedImages(data.train_images, data.train_labels, shift=2)
    test_set = ShiftedImages(data.test_images, data.test_labels)

    model = ddpkit.prepare_model(cnn())  # ddpkit
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.5)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1000, gamma=0.7)
    loader = ddpkit.DataLoader(
        train_set,
        global_batch_size=args.batch_size,
        shuffle=True,
        seed=0,  # ddpkit
        num_workers=2,
        persistent_workers=True,
    )
    # Persistent: its workers are started once, not again at every evaluation (no fork while another iterator's
    # threads end, which can deadlock the forked worker in CPython 3.11).
    test_loader = ddpkit.DataLoader(
        test_set, global_batch_size=1000, shuffle=False, num_workers=2, persistent_workers=True
    )  # ddpkit
    ckpt = ddpkit.Checkpointer(
        args.out,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,  # ddpkit
        loader=loader,
        every_steps=args.every_steps,
        best_metric="accuracy",
    )  # ddpkit
    start = ckpt.resume("auto")  # ddpkit

    for epoch in range(start.epoch, args.epochs):
        loader.set_epoch(epoch)  # ddpkit
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            ckpt.step()  # ddpkit
        test_accuracy = accuracy(model, test_loader)
        ckpt.epoch_end({"accuracy": test_accuracy})  # ddpkit
        if ctx.is_main_process:
            print(f"epoch {epoch + 1}: test accuracy {test_accuracy:.2%}", flush=True)
    ckpt.close()  # ddpkit


if __name__ == "__main__":
    main()
