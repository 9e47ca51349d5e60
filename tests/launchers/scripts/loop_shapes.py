"""Training loops in the shapes public scripts have, ported to ddpkit as the README says, with kill hooks.

The shape is a Trainer class like pytorch/examples' ``multigpu_torchrun.py``
(``_run_batch``, ``_run_epoch``, ``train``), configured with argparse like
``mnist/main.py``; ``--shape`` picks what the loop does between and inside
epochs:

    readme       the README's loop
    step_sched   a per-step LambdaLR, stepped after ckpt.step() (the body goes on after it)
    epoch_sched  a per-epoch StepLR stepped after the batch loop (mnist/main.py)
    peek         b_sz = len(next(iter(loader))[0]) before set_epoch and the batch loop (the tutorial)
    from1        epochs numbered from 1 (minGPT, mnist/main.py): resume(first_epoch=1)
    from1_wrong  epochs numbered from 1 with range(start.epoch + 1, ...): refused on resume
    no_set_epoch the loader's set_epoch is never called
    accum        gradient accumulation: 2 micro-batches, the first inside ddpkit.no_sync
    eval         exact evaluation between epochs, epoch_end(metrics) (best checkpoint), then a per-epoch
                 scheduler stepped after it, GradScaler and gradient clipping (minGPT's trainer)
    compiled     torch.compile(prepare_model(net), backend="eager")
    big          a model with more than 1 MiB of gradients (DDP)
    nanogpt      karpathy/nanoGPT's train.py: no loader, batches sampled from each rank's own generator,
                 the next batch prefetched (per_rank=), gradient accumulation by toggling
                 model.require_backward_grad_sync, iteration counters in a plain dict (extra=), no epochs
    imagenet     pytorch/examples' imagenet/main.py: validate after each epoch, StepLR stepped after it,
                 best_acc1 kept in a plain dict, epoch_end(metrics) for the best checkpoint
    gan          pytorch/examples' DCGAN: two models (netD as model=, netG with BatchNorm and its optimizer as
                 extra=), noise drawn per batch from a seed of each rank's own, the batch counter of
                 ckpt.enumerate driving an `if i % 2 == 0` block (a train-mode forward of netG whose output
                 rank 0 alone writes)
    rank0_save   a save under `if rank == 0` (the tutorials' pattern): refused

Kill hooks, from the environment:
    KILLS="round:where:n,..."  In restart round ``round`` (TORCHELASTIC_RESTART_COUNT), rank KILL_RANK
        sends itself SIGNAL (default SIGKILL) at ``where``: ``step`` after the body of global step n
        (after ckpt.step()), ``epoch_end`` after the code following epoch n's batch loop.
    SIGNAL=SIGTERM: sent only by a run that did not resume (so the same command again completes).

--shard: the model sharded (``prepare_model(shard=True)``, FSDP2), its checkpoints written by every rank.
--async-save: checkpoints written in the background (``async_save=True``; on the CPU "auto" is synchronous).

At the end rank 0 saves {"weights", "global_step"} to --final (full weights, gathered when sharded).
"""

import argparse
import os
import signal

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit

NUM_TRAIN, NUM_TEST, GLOBAL_BATCH = 44, 20, 8
"""6 global batches an epoch, the last one of 4 samples."""


def data(num: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num, 16, generator=generator)
    return TensorDataset(x, (x[:, :4].sum(1) > 0).long() + 2 * (x[:, 4] > 0).long())


def network(shape: str) -> nn.Module:
    if shape == "gan":  # the discriminator: is a sample real?
        return nn.Sequential(nn.Linear(16, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
    width = 640 if shape == "big" else 32  # 640 * 640 float32 weights: 1.6 MB of gradients
    return nn.Sequential(
        nn.Linear(16, width), nn.ReLU(), nn.Dropout(0.2), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 4)
    )


class Killer:
    """Sends the configured signal at the configured points of the configured round."""

    def __init__(self, rank: int, resumed: bool):
        self.signal = getattr(signal, os.environ.get("SIGNAL", "SIGKILL"))
        this_round = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.points = set()
        for spec in filter(None, os.environ.get("KILLS", "").split(",")):
            round_, where, n = spec.split(":")
            if round_ == this_round and not (resumed and self.signal == signal.SIGTERM):
                self.points.add((where, int(n)))
        self.active = rank == int(os.environ.get("KILL_RANK", "1"))

    def at(self, where: str, n: int) -> None:
        if self.active and (where, n) in self.points:
            print(f"sending myself {self.signal.name} at {where} {n}", flush=True)
            os.kill(os.getpid(), self.signal)


class Trainer:
    def __init__(self, args: argparse.Namespace, ctx: ddpkit.Context):
        self.args, self.ctx, shape = args, ctx, args.shape
        torch.manual_seed(0)
        self.model = ddpkit.prepare_model(network(shape), shard=args.shard)
        if shape == "compiled":
            self.model = torch.compile(self.model, backend="eager")
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        self.scheduler = None
        if shape in ("epoch_sched", "eval", "imagenet"):
            self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=1, gamma=0.5)
        elif shape == "step_sched":
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: 1 / (1 + step))
        self.scaler = torch.amp.GradScaler("cpu", enabled=shape == "eval")
        if shape == "gan":  # the generator, with BatchNorm: its running statistics move at every forward
            generator = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 16))
            self.netG = ddpkit.prepare_model(generator)
            self.optG = torch.optim.Adam(self.netG.parameters(), lr=2e-3, betas=(0.5, 0.999))
            self.fixed_noise = torch.randn(4, 8)
            torch.manual_seed(1000 + ctx.rank)  # each rank draws noise of its own
        self.train_data = ddpkit.DataLoader(data(NUM_TRAIN, 1), global_batch_size=GLOBAL_BATCH, shuffle=True, seed=3)
        self.test_data = ddpkit.DataLoader(data(NUM_TEST, 2), global_batch_size=GLOBAL_BATCH, shuffle=False)
        # nanoGPT's: each rank seeds its own stream, samples its batches from it and prefetches the next one.
        self.progress = {"iter_num": 0, "best_acc1": 0.0}
        self.batch: dict[str, torch.Tensor] = {}
        if shape == "nanogpt":
            torch.manual_seed(1337 + ctx.rank)
            self.batch["x"], self.batch["y"] = self._get_batch()
        self.ckpt = ddpkit.Checkpointer(
            args.out,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            scaler=self.scaler if shape == "eval" else None,
            loader=None if shape == "nanogpt" else self.train_data,
            extra=self._extra(),
            per_rank={"batch": self.batch} if shape == "nanogpt" else None,
            every_steps=args.every_steps,
            sync_seconds=0.005,
            best_metric="accuracy" if shape in ("eval", "imagenet") else "",
            async_save=True if args.async_save else "auto",
        )
        self.start = self.ckpt.resume("auto", first_epoch=1 if shape == "from1" else 0)
        self.killer = Killer(ctx.rank, self.start.resumed)

    def _extra(self) -> dict | None:
        if self.args.shape in ("nanogpt", "imagenet"):
            return {"progress": self.progress}
        if self.args.shape == "gan":
            return {"netG": self.netG, "optG": self.optG}
        return None

    def _get_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """nanoGPT's get_batch: a random batch of this rank's, drawn from torch's generator."""
        train = self.train_data.dataset.tensors  # the TensorDataset (the loader indexes it directly)
        index = torch.randint(len(train[0]), (GLOBAL_BATCH // self.ctx.world_size,))
        return train[0][index], train[1][index]

    def _train_nanogpt(self, iterations: int) -> None:
        """nanoGPT's loop: accumulate over micro-steps, syncing gradients on the last, prefetching as it goes."""
        micro_steps = 2
        while self.progress["iter_num"] < iterations:
            self.optimizer.zero_grad(set_to_none=True)
            for micro_step in range(micro_steps):
                self.model.require_backward_grad_sync = micro_step == micro_steps - 1
                loss = F.cross_entropy(self.model(self.batch["x"]), self.batch["y"]) / micro_steps
                self.batch["x"], self.batch["y"] = self._get_batch()  # prefetch while the GPU would work
                loss.backward()
            self.optimizer.step()
            self.progress["iter_num"] += 1
            self.ckpt.step()
            self.killer.at("step", self.ckpt.global_step)
        self.ckpt.close()

    def _run_batch(self, source: torch.Tensor, targets: torch.Tensor) -> None:
        self.optimizer.zero_grad()
        if self.args.shape == "accum":
            half = len(source) // 2
            with ddpkit.no_sync(self.model):
                self._loss(source[:half], targets[:half]).backward()
            self._loss(source[half:], targets[half:]).backward()
        else:
            self.scaler.scale(self._loss(source, targets)).backward()
        if self.args.shape == "eval":
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.scaler.step(self.optimizer)
        self.scaler.update()

    def _run_gan_batch(self, real: torch.Tensor) -> None:
        """DCGAN's step: the discriminator on real and generated samples, then the generator through it."""
        ones, zeros = torch.ones(len(real), 1), torch.zeros(len(real), 1)
        self.optimizer.zero_grad()
        fake = self.netG(torch.randn(len(real), 8))
        error_d = F.binary_cross_entropy_with_logits(self.model(real), ones)
        error_d = error_d + F.binary_cross_entropy_with_logits(self.model(fake.detach()), zeros)
        error_d.backward()
        self.optimizer.step()
        self.optG.zero_grad()
        F.binary_cross_entropy_with_logits(self.model(fake), ones).backward()
        self.optG.step()

    def _run_gan_epoch(self) -> None:
        for i, (real, _) in self.ckpt.enumerate(self.train_data):
            self._run_gan_batch(real)
            self.ckpt.step()
            if i % 2 == 0:  # DCGAN's `if i % 100 == 0` block: netG in train mode, its output written by rank 0
                samples = self.netG(self.fixed_noise).detach()
                if self.ctx.rank == 0:
                    torch.save(samples, os.devnull)
            self.killer.at("step", self.ckpt.global_step)

    def _loss(self, source: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.train_data.global_mean(F.cross_entropy(self.model(source), targets, reduction="sum"))

    def _run_epoch(self, epoch: int) -> None:
        if self.args.shape == "peek":
            b_sz = len(next(iter(self.train_data))[0])
            print(f"[rank {self.ctx.rank}] epoch {epoch} | batch size {b_sz}", flush=True)
        if self.args.shape != "no_set_epoch":
            self.train_data.set_epoch(epoch)
        if self.args.shape == "gan":
            self._run_gan_epoch()
            return
        for source, targets in self.train_data:
            self._run_batch(source, targets)
            if self.scheduler is not None and self.args.shape == "step_sched":
                self.ckpt.step()
                self.scheduler.step()  # after ckpt.step(): the body goes on after it
            else:
                self.ckpt.step()
            if self.args.shape == "rank0_save" and self.ckpt.global_step == 3 and self.ctx.rank == 0:
                self.ckpt.save()
            self.killer.at("step", self.ckpt.global_step)

    def _evaluate(self) -> dict[str, float]:
        self.model.eval()
        sums = {"correct": 0.0, "count": 0.0}
        with torch.no_grad():
            for source, targets in self.test_data:
                sums["correct"] += (self.model(source).argmax(1) == targets).sum().item()
                sums["count"] += len(targets)
        self.model.train()
        sums = ddpkit.reduce_sums(sums)
        return {"accuracy": sums["correct"] / sums["count"]}

    def train(self, epochs: int) -> None:
        shape, start = self.args.shape, self.start
        if shape == "nanogpt":
            self._train_nanogpt(epochs * len(self.train_data))  # as many optimizer steps as the other shapes
            return
        if shape == "from1":
            epoch_numbers = range(start.epoch, epochs + 1)
        elif shape == "from1_wrong":
            epoch_numbers = range(start.epoch + 1, epochs + 1)
        else:
            epoch_numbers = range(start.epoch, epochs)
        for epoch in epoch_numbers:
            self._run_epoch(epoch)
            if shape == "eval":
                metrics = self._evaluate()
                self.ckpt.epoch_end(metrics)
                self.scheduler.step()  # after epoch_end: the checkpoint must still hold it
            elif shape == "epoch_sched":
                self.scheduler.step()
            elif shape == "imagenet":
                acc1 = self._evaluate()["accuracy"]
                self.scheduler.step()  # before the checkpoint, as main.py does
                self.progress["best_acc1"] = max(acc1, self.progress["best_acc1"])
                print(f"[rank {self.ctx.rank}] Epoch: [{epoch}] Acc@1 {acc1:.3f}", flush=True)
                self.ckpt.epoch_end({"accuracy": acc1})
            self.killer.at("epoch_end", epoch)
        self.ckpt.close()


def main() -> None:
    parser = argparse.ArgumentParser(description="a training loop shaped like a public script")
    parser.add_argument("--shape", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--final", required=True)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--every-steps", type=int, default=0)
    parser.add_argument("--shard", action="store_true")
    parser.add_argument("--async-save", action="store_true")
    args = parser.parse_args()
    ctx = ddpkit.init()
    trainer = Trainer(args, ctx)
    print(
        f"rank {ctx.rank}: start epoch={trainer.start.epoch} step_in_epoch={trainer.start.step_in_epoch} "
        f"global_step={trainer.start.global_step} resumed={trainer.start.resumed}",
        flush=True,
    )
    trainer.train(args.epochs)
    weights = ddpkit.unwrap_model(trainer.model).state_dict()
    if args.shape == "gan":
        weights.update({f"G.{k}": v for k, v in ddpkit.unwrap_model(trainer.netG).state_dict().items()})
    if args.shard:  # every rank takes part in gathering the full weights
        weights = {name: tensor.full_tensor() for name, tensor in weights.items()}
    if ctx.is_main_process:
        torch.save({"weights": weights, "global_step": trainer.ckpt.global_step}, args.final)
        print(f"done after global step {trainer.ckpt.global_step}", flush=True)


if __name__ == "__main__":
    main()
