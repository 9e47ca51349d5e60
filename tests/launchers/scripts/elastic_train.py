"""A user's own loop for an elastic job: a ddpkit.Checkpointer, a ddpkit.DataLoader, a per-sample record.

    ddpkit run nproc=1 nnodes=1:2 master_addr=A master_port=P elastic_train.py OUT

Every rank appends one JSON line per optimizer step to OUT/records/<round>-rank<r>.jsonl: the round (a
name rank 0 makes in every round), the world size, the epoch, the global step after it and
the sample indices this rank trained at it. Rank 0 touches OUT/step-<global step>-ws<world size> after each step
(the test waits on them) and writes OUT/final.json at the end: loss and accuracy on the whole data set. A step
sleeps STEP_SLEEP seconds (default 0.15), so that a node can be killed mid-epoch; EPOCHS epochs (default 4).
"""

import json
import os
import sys
import time
import uuid
from pathlib import Path

import torch
import torch.distributed
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit

NUM_SAMPLES, GLOBAL_BATCH = 64, 8
"""8 steps per epoch."""

if __name__ == "__main__":
    out = Path(sys.argv[1])
    ctx = ddpkit.init()
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(NUM_SAMPLES, 8, generator=generator)
    y = (x[:, :3].sum(1) > 0).long()
    dataset = TensorDataset(x, y, torch.arange(NUM_SAMPLES))
    torch.manual_seed(0)
    model = ddpkit.prepare_model(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = ddpkit.DataLoader(dataset, global_batch_size=GLOBAL_BATCH, shuffle=True, seed=3)
    ckpt = ddpkit.Checkpointer(out / "ckpt", model=model, optimizer=optimizer, loader=loader, every_steps=2, keep=50)
    start = ckpt.resume("auto")
    round_name = [uuid.uuid4().hex]  # rank 0's, for every rank of this round of workers
    torch.distributed.broadcast_object_list(round_name, src=0)
    round_name = round_name[0]
    (out / "records").mkdir(parents=True, exist_ok=True)
    records = open(out / "records" / f"{round_name}-rank{ctx.rank}.jsonl", "a", encoding="utf-8")
    sleep = float(os.environ.get("STEP_SLEEP", "0.15"))
    for epoch in range(start.epoch, int(os.environ.get("EPOCHS", "4"))):
        loader.set_epoch(epoch)
        for xb, yb, indices in loader:
            loss = F.cross_entropy(model(xb), yb)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            # Recorded before ckpt.step(), which may save this step: a step in a checkpoint is in the record.
            line = dict(
                round=round_name,
                world_size=ctx.world_size,
                epoch=epoch,
                step=ckpt.global_step + 1,
                indices=indices.tolist(),
                start=start.global_step,
                time=time.time(),
            )
            records.write(json.dumps(line) + "\n")
            records.flush()
            ckpt.step()
            if ctx.rank == 0:
                (out / f"step-{ckpt.global_step}-ws{ctx.world_size}").touch()
            time.sleep(sleep)
        ckpt.epoch_end()
    ckpt.close()
    with torch.no_grad():
        logits = model(x)
        final = dict(loss=F.cross_entropy(logits, y).item(), accuracy=(logits.argmax(1) == y).float().mean().item())
    if ctx.rank == 0:
        (out / "final.json").write_text(json.dumps(final))
    print(f"done at world size {ctx.world_size}", flush=True)
