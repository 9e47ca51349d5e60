"""A Lightning Trainer script as a user writes it for ``ddpkit run nproc=N lightning_trainer.py OUT``.

The one-line additions: ``plugins=[DdpkitEnvironment()]`` (ranks, master and
network interface from ddpkit's detection), ddpkit's DataLoader, and
``use_distributed_sampler=False`` so that Lightning keeps its sampler. Each
rank saves what it saw and its final weights to OUT/rank-R.pt.
"""

import sys

import lightning as L
import torch
from torch import nn

import ddpkit
from ddpkit.integrations.lightning import DdpkitEnvironment


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.first_batch: torch.Tensor | None = None

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.first_batch is None:
            self.first_batch = x.clone()
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


env = DdpkitEnvironment()
L.seed_everything(0, verbose=False)
g = torch.Generator().manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g))
loader = ddpkit.DataLoader(
    data, global_batch_size=16, shuffle=True, rank=env.global_rank(), world_size=env.world_size()
)
model = Regression()
trainer = L.Trainer(
    accelerator="cpu",
    strategy="ddp",
    devices=env.devices,
    num_nodes=env.num_nodes,
    plugins=[env],
    use_distributed_sampler=False,  # keep ddpkit's sampler: the same global batches at any world size
    max_epochs=2,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)
trainer.fit(model, loader)
torch.save(
    {
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "source": env.job.source,
        "loader_kept": trainer.train_dataloader is loader,
        "first_batch": model.first_batch,
        "weights": model.net.state_dict(),
    },
    f"{sys.argv[1]}/rank-{trainer.global_rank}.pt",
)
