"""The benchmark's training with Hugging Face Accelerate, as its users write it; started by python (or torchrun).

    python benchmarks/peers/accelerate_loop.py --out /tmp/ckpt --result /tmp/r.json

``Accelerator(mixed_precision="bf16")``, ``prepare`` of the model, the
optimizer and a DataLoader with pinned memory (its prepared loader moves the
batches), ``accelerator.backward``, SGD, and ``accelerator.save_state`` at
every epoch end (Accelerate's checkpointing guide).
"""

import time

STARTED = time.time()

import os  # noqa: E402  (the clock starts before the imports it measures)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import workload  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402


def main() -> None:
    timeline = workload.Timeline(STARTED)
    timeline.mark("imports")
    args = workload.arguments(__doc__.splitlines()[0])
    workload.init_cuda(args.device)
    timeline.mark("cuda_init")
    accelerator = Accelerator(mixed_precision="bf16" if args.precision == "bf16" else "no", cpu=args.device == "cpu")
    timeline.mark("process_group")

    model = workload.build_model(args)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loader = DataLoader(
        workload.AugmentedImages(args.samples),
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.num_workers,
        pin_memory=args.device == "cuda",
        persistent_workers=args.num_workers > 0,
        drop_last=True,
    )
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    timeline.mark("setup")

    for epoch in range(args.epochs):
        images = 0
        for x, y in loader:
            timeline.batch(epoch)
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            accelerator.backward(loss)
            optimizer.step()
            timeline.step_done(accelerator.device.type)
            images += len(y) * accelerator.num_processes
        accelerator.save_state(os.path.join(args.out, "accelerate"))
        timeline.epoch_done(epoch, images)
    accelerator.wait_for_everyone()
    if accelerator.device.type == "cuda":
        torch.cuda.synchronize()
    end = time.time() - timeline.t0
    if accelerator.is_main_process:
        result = timeline.result("Accelerate", args, end, world_size=accelerator.num_processes)
        workload.write_result(args.result, result)
    accelerator.end_training()


if __name__ == "__main__":
    main()
