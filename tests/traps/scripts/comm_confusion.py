"""An evaluation that sums a 10x10 confusion matrix, a loss and a count over the ranks with reduce_sums."""

import torch

import ddpkit

ctx = ddpkit.init()
confusion = torch.zeros(10, 10, dtype=torch.int64)
for i in range(5):  # rank r's samples: true class (r + i) % 10 predicted as (r + 2 * i) % 10
    confusion[(ctx.rank + i) % 10, (ctx.rank + 2 * i) % 10] += 1
total = ddpkit.reduce_sums({"confusion": confusion, "loss": torch.tensor(0.5 * (ctx.rank + 1)), "count": 5})
if ctx.rank == 0:
    matrix = total["confusion"]
    print(f"confusion {tuple(matrix.shape)} {matrix.dtype} sum={int(matrix.sum())} trace={int(matrix.trace())}")
    print(f"loss={total['loss']} count={total['count']}", flush=True)
ddpkit.shutdown()
