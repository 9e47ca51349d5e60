"""W1 as people write it: an MLP on Fashion-MNIST, a torch Dataset, a DataLoader with 2 workers.

Made data-parallel and resumable with ddpkit: the lines marked ``# ddpkit``
are all that changed from the single-process script (README, "Your own script").
On a GPU the loop needs no ``.to(device)``: ``ddpkit.init()`` binds the worker's
GPU, ``prepare_model`` puts the model there and ``ddpkit.DataLoader`` hands out
the batches there.

    ddpkit run nproc=2 examples/mlp_fashion_mnist.py --epochs 5
    torchrun --nproc-per-node 2 examples/mlp_fashion_mnist.py
    srun -n 2 python examples/mlp_fashion_mnist.py
    mpirun -np 2 python examples/mlp_fashion_mnist.py

Stop it at any point (Ctrl-C, kill, preemption) and run it again: it
continues where it was, bit for bit with the same number of workers.
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

import ddpkit  # ddpkit
from ddpkit.datasets import DataOptions, load_images


class Images(Dataset):
    """Images and labels, one sample at a time, pixels scaled to [0, 1]."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor):
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        return self.images[i].float() / 255, self.labels[i]


@torch.no_grad()
def evaluate(model: nn.Module, loader, device: torch.device) -> tuple[float, torch.Tensor]:
    """Test accuracy and the confusion matrix (rows: true class, columns: predicted), over the whole test set."""
    model.eval()
    sums = {"correct": 0, "count": 0, "confusion": torch.zeros(10, 10, dtype=torch.long, device=device)}
    for x, y in loader:
        predicted = model(x).argmax(1)
        sums["correct"] += (predicted == y).sum()
        sums["count"] += len(y)
        sums["confusion"] += torch.bincount(y * 10 + predicted, minlength=100).view(10, 10)
    sums = ddpkit.reduce_sums(sums)  # ddpkit: every rank saw its share of the test set; tensors keep their shape
    model.train()
    return sums["correct"] / sums["count"], sums["confusion"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--dataset", default="fashion-mnist", help="fashion-mnist, mnist or synthetic")
    parser.add_argument("--samples", type=int, default=60000, help="training samples of --dataset synthetic")
    parser.add_argument("--out", default="runs/mlp-fashion-mnist")
    args = parser.parse_args()

    ctx = ddpkit.init()  # ddpkit
    torch.manual_seed(0)
    with ddpkit.main_process_first():  # ddpkit: one download per node
        data = load_images(args.dataset, DataOptions(synthetic_samples=args.samples))
    train_set = Images(data.train_images, data.train_labels)
    test_set = Images(data.test_images, data.test_labels)

    model = nn.Sequential(nn.Flatten(), nn.Linear(784, 50), nn.ReLU(), nn.Linear(50, 10))
    model = ddpkit.prepare_model(model)  # ddpkit
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    loader = ddpkit.DataLoader(train_set, global_batch_size=64, shuffle=True, seed=0, num_workers=2)  # ddpkit
    # Persistent: its workers are started once, not again at every evaluation (no fork while another iterator's
    # threads end, which can deadlock the forked worker in CPython 3.11).
    test_loader = ddpkit.DataLoader(
        test_set, global_batch_size=1000, shuffle=False, num_workers=2, persistent_workers=True
    )  # ddpkit
    ckpt = ddpkit.Checkpointer(
        args.out,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        loader=loader,
        every_steps=500,
        best_metric="accuracy",
    )  # ddpkit
    start = ckpt.resume("auto")  # ddpkit

    for epoch in range(start.epoch, args.epochs):
        loader.set_epoch(epoch)  # ddpkit
        for i, (x, y) in ckpt.enumerate(loader):  # ddpkit: i counts the epoch's batches, after a resume too
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            ckpt.step()  # ddpkit
            if i % 200 == 0 and ctx.is_main_process:  # ddpkit: rank 0 prints
                print(f"  batch {i}: loss {loss.item():.3f}", flush=True)
        scheduler.step()
        test_accuracy, confusion = evaluate(model, test_loader, ctx.device)
        ckpt.epoch_end({"accuracy": test_accuracy})  # ddpkit: the best-* checkpoint follows it
        if ctx.is_main_process:  # ddpkit
            worst = int((confusion.diag() / confusion.sum(1)).argmin())
            print(f"epoch {epoch + 1}: test accuracy {test_accuracy:.2%} (worst class {worst})", flush=True)
    ckpt.close()  # ddpkit: writes the steps since the last checkpoint


if __name__ == "__main__":
    main()
