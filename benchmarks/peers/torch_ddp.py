"""The benchmark's training in plain PyTorch + DDP, as its users write it; started by torchrun.

    torchrun --standalone --nproc-per-node 1 benchmarks/peers/torch_ddp.py --out /tmp/ckpt --result /tmp/r.json

A DistributedSampler with set_epoch, a DataLoader with pinned memory, the
batch moved with ``.to(device, non_blocking=True)``, bf16 autocast, SGD, and
rank 0 saving ``{model, optimizer, epoch}`` with ``torch.save`` at every
epoch end (pytorch/examples' multigpu_torchrun.py saves its snapshot so).
"""

import time

STARTED = time.time()

import os  # noqa: E402  (the clock starts before the imports it measures)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import workload  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler  # noqa: E402


def main() -> None:
    timeline = workload.Timeline(STARTED)
    timeline.mark("imports")
    args = workload.arguments(__doc__.splitlines()[0])
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank) if args.device == "cuda" else torch.device("cpu")
    workload.init_cuda(device.type)
    timeline.mark("cuda_init")
    if device.type == "cuda":
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    timeline.mark("process_group")

    model = workload.build_model(args).to(device)
    model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    dataset = workload.AugmentedImages(args.samples)
    sampler = DistributedSampler(dataset, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(
        dataset,
        batch_size=args.batch_size,
        sampler=sampler,
        num_workers=args.num_workers,
        pin_memory=device.type == "cuda",
        persistent_workers=args.num_workers > 0,
        drop_last=True,
    )
    os.makedirs(args.out, exist_ok=True)
    timeline.mark("setup")

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        images = 0
        for x, y in loader:
            timeline.batch(epoch)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16"):
                loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            timeline.step_done(device.type)
            images += len(y) * dist.get_world_size()
        if rank == 0:
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch + 1}
            torch.save(state, os.path.join(args.out, "checkpoint.pt"))
        timeline.epoch_done(epoch, images)
    if device.type == "cuda":
        torch.cuda.synchronize()
    end = time.time() - timeline.t0
    if rank == 0:
        workload.write_result(args.result, timeline.result("torch+DDP", args, end, world_size=dist.get_world_size()))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
