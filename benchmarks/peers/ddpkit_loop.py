"""The benchmark's training as an own loop on ddpkit's public API, as its users write it; started by ``ddpkit run``.

    ddpkit run nproc=1 benchmarks/peers/ddpkit_loop.py --out /tmp/ckpt --result /tmp/r.json

``ddpkit.init()``, ``prepare_model``, a ``ddpkit.DataLoader`` (batches
handed out on the GPU: no ``.to(device)`` in the loop), bf16 autocast, SGD,
and a ``ddpkit.Checkpointer`` holding the loader, which saves at every epoch
end (the README's loop, with its default options).
"""

import time

STARTED = time.time()

import os  # noqa: E402  (the clock starts before the imports it measures)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import workload  # noqa: E402

import ddpkit  # noqa: E402


def main() -> None:
    timeline = workload.Timeline(STARTED)
    timeline.mark("imports")
    args = workload.arguments(__doc__.splitlines()[0])
    workload.init_cuda(args.device)
    timeline.mark("cuda_init")
    ctx = ddpkit.init(device=args.device)
    timeline.mark("process_group")

    model = ddpkit.prepare_model(workload.build_model(args))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loader = ddpkit.DataLoader(
        workload.AugmentedImages(args.samples),
        batch_size=args.batch_size,
        shuffle=True,
        seed=0,
        num_workers=args.num_workers,
        persistent_workers=args.num_workers > 0,
        drop_last=True,
    )
    ckpt = ddpkit.Checkpointer(os.path.join(args.out, "ddpkit"), model=model, optimizer=optimizer, loader=loader)
    start = ckpt.resume("auto")
    timeline.mark("setup")

    for epoch in range(start.epoch, args.epochs):
        loader.set_epoch(epoch)
        images = 0
        for x, y in loader:
            timeline.batch(epoch)
            with torch.autocast(ctx.device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16"):
                loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            ckpt.step()
            timeline.step_done(ctx.device.type)
            images += len(y) * ctx.world_size
        timeline.epoch_done(epoch, images)
    ckpt.close()  # the last epoch's checkpoint complete
    if ctx.device.type == "cuda":
        torch.cuda.synchronize()
    end = time.time() - timeline.t0
    if ctx.is_main_process:
        workload.write_result(args.result, timeline.result("ddpkit", args, end, world_size=ctx.world_size))


if __name__ == "__main__":
    main()
