"""A user's own loop over data that torch scripts pass to their DataLoader, stopped and resumed by the tests.

    ddpkit run nproc=2 own_data.py --data hf-stream --out DIR

Data (``--data``):
    hf-stream   a Hugging Face streaming dataset made here: 96 rows as
                ``Dataset.from_dict(...).to_iterable_dataset(num_shards=4)``
                with ``with_format("torch")``; batch_size=4 per rank,
                num_workers=2 (so each worker streams one shard)
    uneven      a plain IterableDataset of 21 numbers, dealt round-robin to
                the ranks: rank 0 gets 11, rank 1 gets 10 (6 and 5 batches of 2)
    weighted    a map-style dataset of 50 samples drawn by a
                ``WeightedRandomSampler(num_samples=58, generator=...)``,
                global_batch_size=8 with drop_last=True (the last global
                batch of 2 would leave one row per rank on 2 ranks), through
                a model with BatchNorm in training mode

Environment: STOP_AT_STEP=k saves a checkpoint after global step k (counted
over all launches) and exits 0; RECORD=PREFIX makes every rank append one line
``epoch sample`` per sample it trained on to ``PREFIX.<rank>``.
"""

import argparse
import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, IterableDataset, WeightedRandomSampler

import ddpkit

WEIGHTED_SAMPLES = 50
WEIGHTED_DRAWS = 58
WEIGHTED_SEED = 3
UNEVEN_SAMPLES = 21
HF_ROWS = 96


def weights() -> torch.Tensor:
    """Sample i weighs 1 + (i % 5): some samples are drawn several times an epoch, some never."""
    return 1.0 + torch.arange(WEIGHTED_SAMPLES) % 5


def weighted_sampler() -> WeightedRandomSampler:
    return WeightedRandomSampler(weights(), WEIGHTED_DRAWS, replacement=True, generator=torch.Generator())


class Indexed(Dataset):
    def __len__(self) -> int:
        return WEIGHTED_SAMPLES

    def __getitem__(self, index: int):
        return {"x": torch.tensor([float(index)]), "y": torch.tensor([index % 3 - 1.0]), "id": index}


class Numbers(IterableDataset):
    def __iter__(self):
        for i in range(UNEVEN_SAMPLES):
            yield {"x": torch.tensor([float(i)]), "y": torch.tensor([i % 3 - 1.0]), "id": i}


def hf_stream():
    import datasets

    rows = {
        "x": [[float(i)] for i in range(HF_ROWS)],
        "y": [[i % 3 - 1.0] for i in range(HF_ROWS)],
        "id": list(range(HF_ROWS)),
    }
    return datasets.Dataset.from_dict(rows).to_iterable_dataset(num_shards=4).with_format("torch")


def loader_and_model(data: str):
    if data == "hf-stream":
        return ddpkit.DataLoader(hf_stream(), batch_size=4, num_workers=2), nn.Linear(1, 1)
    if data == "uneven":
        return ddpkit.DataLoader(Numbers(), batch_size=2), nn.Linear(1, 1)
    # global_batch_size: the same global batches at any world size, so a resume at another one is exact.
    loader = ddpkit.DataLoader(
        Indexed(), global_batch_size=8, sampler=weighted_sampler(), drop_last=True, seed=WEIGHTED_SEED
    )
    return loader, nn.Sequential(nn.Linear(1, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, choices=["hf-stream", "uneven", "weighted"])
    parser.add_argument("--out", required=True)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    stop_at = int(os.environ.get("STOP_AT_STEP", "0"))
    record = os.environ.get("RECORD", "")

    ctx = ddpkit.init()
    torch.manual_seed(0)
    loader, model = loader_and_model(args.data)
    model = ddpkit.prepare_model(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    ckpt = ddpkit.Checkpointer(args.out, model=model, optimizer=optimizer, loader=loader, every_steps=0)
    start = ckpt.resume("auto")
    records = open(f"{record}.{ctx.rank}", "a") if record else None
    for epoch in range(start.epoch, args.epochs):
        loader.sampler.set_epoch(epoch)  # the DistributedSampler habit
        for batch in loader:
            loss = loader.global_mean(F.mse_loss(model(batch["x"]), batch["y"], reduction="sum"))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if records is not None:
                records.writelines(f"{epoch} {int(i)}\n" for i in batch["id"])
                records.flush()
            ckpt.step()
            if stop_at and ckpt.global_step == stop_at:
                ckpt.save()
                ckpt.close()
                print(f"rank {ctx.rank}: stopped after global step {stop_at}", flush=True)
                return
    ckpt.close()
    print(f"rank {ctx.rank}: done at global step {ckpt.global_step}", flush=True)


if __name__ == "__main__":
    main()
