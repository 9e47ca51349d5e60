"""A user's own loop whose checkpoints go to object storage: the Checkpointer given an s3:// URL, nothing else.

    ddpkit run nproc=2 remote_loop.py URL FINAL_PT

pytorch/examples' shape: torch's DataLoader over a DistributedSampler given as loader=, ckpt.enumerate, a
StepLR stepped after each epoch's batch loop; a checkpoint every 2 steps, 3 epochs of 5 steps.

Test hooks, on the first attempt only (TORCHELASTIC_RESTART_COUNT=0):
    KILL_MID_UPLOAD=n  rank 0 sends itself SIGKILL right after ckpt.step() of global step n, which staged
                       that step's checkpoint and started its upload
    PREEMPT_AT=n       rank 1 sends itself SIGTERM after global step n (a scheduler's notice)
RESUME=never|auto  what ckpt.resume() is given (auto by default).
NODE_CACHE=FOLDER: the staging folder (checkpoint cache=), "{node}" in it replaced by the node's rank.
At the end rank 0 saves the model's state_dict to FINAL_PT.
"""

import os
import signal
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import ddpkit

url, final = sys.argv[1], sys.argv[2]
first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
ctx = ddpkit.init()
generator = torch.Generator().manual_seed(5)
x = torch.randn(40, 8, generator=generator)
dataset = TensorDataset(x, (x[:, :3].sum(1) > 0).long())
sampler = DistributedSampler(dataset, shuffle=True, seed=3)
loader = DataLoader(dataset, batch_size=4, sampler=sampler)
torch.manual_seed(0)
model = ddpkit.prepare_model(nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Dropout(0.3), nn.Linear(64, 2)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
# NODE_CACHE (e.g. cache-{node}): each node's own staging folder, as on machines that share no disk.
cache = os.environ.get("NODE_CACHE", "").format(node=ctx.node_rank)
ckpt = ddpkit.Checkpointer(
    url,
    model=model,
    optimizer=optimizer,
    scheduler=scheduler,
    loader=loader,
    every_steps=2,
    on_epoch_end=False,
    cache=cache,
)
start = ckpt.resume(os.environ.get("RESUME", "auto"))
print(f"rank {ctx.rank}: start epoch={start.epoch} step_in_epoch={start.step_in_epoch}", flush=True)
for epoch in range(start.epoch, 3):
    sampler.set_epoch(epoch)
    for _, (xb, yb) in ckpt.enumerate(loader):
        loss = F.cross_entropy(model(xb + 0.1 * torch.randn_like(xb)), yb)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        ckpt.step()
        if first_attempt and ctx.rank == 0 and ckpt.global_step == int(os.environ.get("KILL_MID_UPLOAD", "0")):
            print(f"rank 0: SIGKILL while checkpoint {ckpt.global_step} uploads", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if first_attempt and ctx.rank == 1 and ckpt.global_step == int(os.environ.get("PREEMPT_AT", "0")):
            os.kill(os.getpid(), signal.SIGTERM)
    scheduler.step()
ckpt.close()
if ctx.is_main_process:
    torch.save(ddpkit.unwrap_model(model).state_dict(), final)
ddpkit.shutdown()
