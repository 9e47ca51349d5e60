"""The DDP tutorial's Trainer class (multigpu_torchrun.py), ported as the README says: no ``.to`` anywhere.

The model goes to the worker's GPU through ``ddpkit.prepare_model`` and the
batches through ``ddpkit.DataLoader``; the tutorial's snapshot is a
``ddpkit.Checkpointer``. Prints each epoch's line with the device the first
batch arrived on, and the last loss.

    ddpkit run nproc=1 tests/gpu/scripts/multigpu_trainer.py --epochs 2 --out snapshots
"""

import argparse

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

import ddpkit


class MyTrainDataset(Dataset):
    def __init__(self, size: int):
        generator = torch.Generator().manual_seed(0)
        self.data = [(torch.rand(20, generator=generator), torch.rand(1, generator=generator)) for _ in range(size)]

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        return self.data[index]


class Trainer:
    def __init__(self, model, train_data, optimizer, save_every: int, snapshot_path: str):
        self.model = ddpkit.prepare_model(model)
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.ckpt = ddpkit.Checkpointer(snapshot_path, model=self.model, optimizer=optimizer, loader=train_data)
        self.epochs_run = self.ckpt.resume("auto").epoch
        self.loss = float("nan")

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.mse_loss(output, targets)
        loss.backward()
        self.optimizer.step()
        self.loss = loss.item()

    def _run_epoch(self, epoch):
        self.train_data.set_epoch(epoch)
        devices = set()
        for source, targets in self.train_data:
            devices.add(str(source.device))
            devices.add(str(targets.device))
            self._run_batch(source, targets)
            self.ckpt.step()
        print(f"epoch {epoch}: batches on {','.join(sorted(devices))}, loss {self.loss:.4f}", flush=True)

    def train(self, max_epochs: int):
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
        self.ckpt.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--out", default="snapshots")
    args = parser.parse_args()
    ddpkit.init()  # the tutorial's ddp_setup()
    torch.manual_seed(0)
    model = torch.nn.Linear(20, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    train_data = ddpkit.DataLoader(MyTrainDataset(2048), global_batch_size=args.batch_size, shuffle=True, num_workers=2)
    Trainer(model, train_data, optimizer, save_every=1, snapshot_path=args.out).train(args.epochs)


if __name__ == "__main__":
    main()
