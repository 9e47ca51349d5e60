"""A regression loop over node-sharded data, for tests/traps/test_shards.py.

    ddpkit run nproc=1 nnodes=2 node_rank=R ... shards_train.py DATA OUT FINAL [RECORDS]

DATA is a node's shard folder, ``{node}`` replaced by this process's node. Each rank appends
"epoch sample-id" lines to RECORDS-rank<r>.txt for every sample it trains on. Rank 0 saves the
model's state_dict to FINAL at the end.

STAGE_FROM=folder: first copy this node's shards from that data set into DATA (stage_node_shards).

Test hook: KILL_AT_STEP=n: the last rank sends itself SIGKILL after the optimizer step of global step n,
before ckpt.step() counts it.
"""

import os
import signal
import sys

import torch
from torch import nn

import ddpkit
from ddpkit.data.node_shards import NodeShards, stage_node_shards

EPOCHS = 2


def main(data: str, out: str, final: str, records: str = "") -> None:
    ctx = ddpkit.init()
    folder = data.format(node=ctx.rank // ctx.local_world_size)
    if os.environ.get("STAGE_FROM"):
        stage_node_shards(os.environ["STAGE_FROM"], folder)
    shards = NodeShards(folder)
    loader = ddpkit.DataLoader(shards, batch_size=4, shuffle=True, seed=1)
    torch.manual_seed(0)
    model = ddpkit.prepare_model(nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ckpt = ddpkit.Checkpointer(out, model=model, optimizer=optimizer, loader=loader, every_steps=1)
    start = ckpt.resume("auto")
    print(f"rank {ctx.rank}: start epoch={start.epoch} step_in_epoch={start.step_in_epoch}", flush=True)
    log = open(f"{records}-rank{ctx.rank}.txt", "a") if records else None
    for epoch in range(start.epoch, EPOCHS):
        loader.set_epoch(epoch)
        for ids, x, y in loader:
            if log:
                log.writelines(f"{epoch} {i}\n" for i in ids.tolist())
            loss = loader.global_mean(((model(x).squeeze(1) - y) ** 2).sum())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if ckpt.global_step + 1 == int(os.environ.get("KILL_AT_STEP", "0")) and ctx.rank == ctx.world_size - 1:
                print(f"rank {ctx.rank}: sending myself SIGKILL after step {ckpt.global_step + 1}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            ckpt.step()
    if log:
        log.close()
    if ctx.rank == 0:
        torch.save(model.state_dict(), final)
    ckpt.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
