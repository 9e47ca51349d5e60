"""A Horovod training script, as Horovod's PyTorch guide writes it, with only its import changed.

Horovod's steps: hvd.init(); pin the GPU of the local rank; a
DistributedSampler over hvd.size() replicas; the learning rate scaled by
hvd.size(); DistributedOptimizer with named_parameters and compression;
broadcast of the initial parameters and optimizer state from rank 0; test
metrics averaged with hvd.allreduce(name=...).

    mpirun -np 2 python examples/horovod_mnist.py
    ddpkit run nproc=2 examples/horovod_mnist.py
    torchrun --nproc-per-node 2 examples/horovod_mnist.py
    srun -n 2 python examples/horovod_mnist.py

Data: Fashion-MNIST (MNIST's format; torchvision's ``datasets.MNIST`` in
Horovod's script), read with ddpkit's IDX reader; ``--dataset synthetic``
for a quick run without files.
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn, optim
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler

import ddpkit.horovod as hvd  # was: import horovod.torch as hvd
from ddpkit.datasets import DataOptions, load_images


class Net(nn.Module):
    """The convolutional network of Horovod's PyTorch MNIST example."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = x.view(-1, 320)
        x = F.relu(self.fc1(x))
        x = F.dropout(x, training=self.training)
        return F.log_softmax(self.fc2(x), dim=1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options of Horovod's example, plus the dataset, its size and where to write the weights."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=64, help="input batch size for training per worker")
    parser.add_argument("--test-batch-size", type=int, default=1000, help="input batch size for testing")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.01, help="learning rate of one worker")
    parser.add_argument("--momentum", type=float, default=0.5)
    parser.add_argument("--no-cuda", action="store_true", default=False)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--log-interval", type=int, default=10, help="batches between logged training losses")
    parser.add_argument("--fp16-allreduce", action="store_true", default=False, help="fp16 compression")
    parser.add_argument("--gradient-predivide-factor", type=float, default=1.0)
    parser.add_argument("--dataset", default="fashion-mnist", help="fashion-mnist, mnist or synthetic")
    parser.add_argument("--train-samples", type=int, default=0, help="use the first N training samples (0: all)")
    parser.add_argument("--test-samples", type=int, default=0, help="use the first N test samples (0: all)")
    parser.add_argument("--save-weights", default="", help="rank 0 writes the final state_dict here")
    return parser.parse_args(argv)


def datasets(args: argparse.Namespace) -> tuple[torch.utils.data.Dataset, torch.utils.data.Dataset]:
    """Train and test sets, cut to --train-samples and --test-samples."""
    options = DataOptions(synthetic_samples=args.train_samples or 60000)
    train, test = load_images(args.dataset, options).datasets()
    if args.train_samples:
        train = Subset(train, range(min(args.train_samples, len(train))))
    if args.test_samples:
        test = Subset(test, range(min(args.test_samples, len(test))))
    return train, test


def train_epoch(
    model: nn.Module,
    optimizer: optim.Optimizer,
    loader: DataLoader,
    sampler: DistributedSampler,
    epoch: int,
    args: argparse.Namespace,
    device: torch.device,
    log: bool,
) -> None:
    """One epoch over this worker's share of the training set."""
    model.train()
    sampler.set_epoch(epoch)  # a different shuffle every epoch, the same on every worker
    for batch_idx, (data, target) in enumerate(loader):
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        loss = F.nll_loss(model(data), target)
        loss.backward()
        optimizer.step()
        if log and batch_idx % args.log_interval == 0:
            print(f"train epoch {epoch} [{batch_idx * len(data)}/{len(sampler)}]  loss {loss.item():.6f}")


@torch.no_grad()
def evaluate(model: nn.Module, loader: DataLoader, device: torch.device) -> tuple[float, float]:
    """Summed loss and number of correct predictions over this worker's share of the test set."""
    model.eval()
    test_loss, correct = 0.0, 0.0
    for data, target in loader:
        data, target = data.to(device), target.to(device)
        output = model(data)
        test_loss += F.nll_loss(output, target, reduction="sum").item()
        correct += (output.argmax(1) == target).sum().item()
    return test_loss, correct


def metric_average(value: float, name: str) -> float:
    """The mean of ``value`` over the workers."""
    return hvd.allreduce(torch.tensor(value), name=name).item()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    use_cuda = not args.no_cuda and torch.cuda.is_available()

    hvd.init()
    torch.manual_seed(args.seed)
    if use_cuda:
        torch.cuda.set_device(hvd.local_rank())  # one GPU per process
        torch.cuda.manual_seed(args.seed)
    device = torch.device("cuda", hvd.local_rank()) if use_cuda else torch.device("cpu")

    train_set, test_set = datasets(args)
    # Each worker reads its own 1 / hvd.size() of the data.
    train_sampler = DistributedSampler(train_set, num_replicas=hvd.size(), rank=hvd.rank())
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler)
    test_sampler = DistributedSampler(test_set, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=False)
    test_loader = DataLoader(test_set, batch_size=args.test_batch_size, sampler=test_sampler)

    model = Net().to(device)
    # The effective batch is hvd.size() times larger: scale the learning rate with it.
    optimizer = optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=args.momentum)
    # Every worker starts from rank 0's weights and optimizer state.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(
        optimizer,
        named_parameters=model.named_parameters(),
        compression=compression,
        op=hvd.Average,
        gradient_predivide_factor=args.gradient_predivide_factor,
    )

    for epoch in range(1, args.epochs + 1):
        train_epoch(model, optimizer, train_loader, train_sampler, epoch, args, device, log=hvd.rank() == 0)
        test_loss, correct = evaluate(model, test_loader, device)
        test_loss = metric_average(test_loss / len(test_sampler), "avg_loss")
        accuracy = metric_average(correct / len(test_sampler), "avg_accuracy")
        if hvd.rank() == 0:
            print(f"epoch {epoch}: test loss {test_loss:.4f}, test accuracy {100 * accuracy:.2f}%")

    if args.save_weights and hvd.rank() == 0:
        torch.save(model.state_dict(), args.save_weights)
    hvd.shutdown()


if __name__ == "__main__":
    main()
