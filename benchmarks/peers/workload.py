"""The workload the three training scripts of ``benchmarks/gpu_peers.py`` share: data, models, settings, the clock.

The scripts (``torch_ddp.py``, ``ddpkit_loop.py``, ``accelerate_loop.py``)
train the same model on the same data with the same settings, each written
as its users write it; only what differs between the frameworks differs
between them. Each is started as a whole process by its own launcher
(torchrun, ``ddpkit run``, plain python) and rank 0 writes one JSON result.

- Data: :class:`AugmentedImages`, N CIFAR-size uint8 images (random, seeded)
  read one sample at a time with a random crop (padding 4) and a random
  horizontal flip, as torchvision's CIFAR recipe does, in plain torch.
- Models: :func:`resnet18` (the CIFAR variant of ResNet-18, 11.2M
  parameters at width 64: launch-bound on a large GPU) and :func:`mlp`
  (3072-1024-10: loader-bound), both starting with :class:`Normalize`, which
  turns the uint8 batch into normalized floats on the device.
- The clock: :class:`Timeline` counts from ``GPU_PEERS_T0``, the moment the
  benchmark started the command, so "time to the first step" includes the
  launcher and the interpreter.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

T0_VARIABLE = "GPU_PEERS_T0"
"""Seconds since the epoch at which the benchmark started the command (set by gpu_peers.py)."""

CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)


def arguments(description: str) -> argparse.Namespace:
    """The settings every script takes; gpu_peers.py passes the same to all three."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", choices=("resnet18", "mlp"), default="resnet18")
    parser.add_argument("--samples", type=int, default=25_000)
    parser.add_argument("--epochs", type=int, default=3, help="the first one is a warm-up, the others are timed")
    parser.add_argument("--batch-size", type=int, default=256, help="per process")
    parser.add_argument("--num-workers", type=int, default=8, help="loader worker processes")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--precision", choices=("bf16", "fp32"), default="bf16", help="bf16: autocast")
    parser.add_argument("--width", type=int, default=64, help="ResNet-18's first channels (64: the real size)")
    parser.add_argument("--out", required=True, help="folder for the checkpoints")
    parser.add_argument("--result", required=True, help="JSON file rank 0 writes its measurements into")
    return parser.parse_args()


class AugmentedImages(Dataset):
    """``num_samples`` 3x32x32 uint8 images and labels, each read with a random crop and a random flip."""

    def __init__(self, num_samples: int, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        self.images = torch.randint(0, 256, (num_samples, 3, 32, 32), dtype=torch.uint8, generator=generator)
        self.labels = torch.randint(0, 10, (num_samples,), generator=generator)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        padded = F.pad(self.images[index], (4, 4, 4, 4))
        top, left = torch.randint(0, 9, (2,)).tolist()
        image = padded[:, top : top + 32, left : left + 32]
        if torch.rand(()) < 0.5:
            image = image.flip(2)
        return image.contiguous(), self.labels[index]


class Normalize(nn.Module):
    """uint8 images to floats in [0, 1], normalized with CIFAR-10's mean and std (on the device, in the model)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.tensor(CIFAR_MEAN).view(1, 3, 1, 1) * 255)
        self.register_buffer("std", torch.tensor(CIFAR_STD).view(1, 3, 1, 1) * 255)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.float() - self.mean) / self.std


class BasicBlock(nn.Module):
    def __init__(self, inputs: int, outputs: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, outputs, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(outputs)
        self.conv2 = nn.Conv2d(outputs, outputs, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(outputs)
        self.shortcut = nn.Sequential()
        if stride != 1 or inputs != outputs:
            self.shortcut = nn.Sequential(nn.Conv2d(inputs, outputs, 1, stride, bias=False), nn.BatchNorm2d(outputs))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


def resnet18(width: int = 64, num_classes: int = 10) -> nn.Module:
    """ResNet-18 for 32x32 images (a 3x3 stem, no max-pool), as CIFAR recipes write it: 11.2M parameters at 64."""
    layers: list[nn.Module] = [Normalize(), nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU()]
    channels = width
    for stage, stride in enumerate((1, 2, 2, 2)):
        outputs = width * 2**stage
        layers += [BasicBlock(channels, outputs, stride), BasicBlock(outputs, outputs, 1)]
        channels = outputs
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, num_classes)]
    return nn.Sequential(*layers)


def mlp() -> nn.Module:
    """3072-1024-10: so little compute per image that the loader sets the pace."""
    return nn.Sequential(Normalize(), nn.Flatten(), nn.Linear(3072, 1024), nn.ReLU(), nn.Linear(1024, 10))


def build_model(args: argparse.Namespace) -> nn.Module:
    torch.manual_seed(0)  # the same initial weights in every script
    return resnet18(args.width) if args.model == "resnet18" else mlp()


def init_cuda(device_type: str) -> None:
    """Bind this process's GPU and create its CUDA context: a step of its own, so its time is reported apart.

    Every framework would do it in its own init (set_device, then the first
    CUDA call); here it is done the same way for all three before they start.
    """
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        torch.empty(1, device="cuda")


class Timeline:
    """Seconds since the command started (``GPU_PEERS_T0``) at named points; the training's epochs."""

    PHASES = ("launch", "imports", "cuda_init", "process_group", "setup", "first_batch", "first_step")
    """Each mark, in order: the interpreter's start and the launcher (until the script's first line), the
    imports, CUDA, the process group, model/optimizer/loader/checkpointer, the first batch, the first step."""

    def __init__(self, started: float):
        self.t0 = float(os.environ.get(T0_VARIABLE) or started)
        self.marks: dict[str, float] = {"launch": started - self.t0}
        self.epoch_ends: list[float] = []
        self.images = 0
        self.timed_from: float | None = None

    def mark(self, name: str) -> None:
        assert name in self.PHASES, name
        self.marks[name] = time.time() - self.t0

    def batch(self, epoch: int) -> None:
        """As each batch arrives: the first is marked; the timed window opens with epoch 1's first.

        By then every peer has saved epoch 0 or started to: plain torch and
        Accelerate after their batch loop, ddpkit's Checkpointer when the next
        epoch's loop begins (after the code that follows the batch loop). The
        window then holds the same saves for all: those of epochs 1 to the last.
        """
        if epoch == 1 and self.timed_from is None:
            self.timed_from = time.time() - self.t0
        elif "first_batch" not in self.marks:
            self.mark("first_batch")

    def step_done(self, device_type: str) -> None:
        """After each optimizer step: the first one is waited for (once) and marked."""
        if "first_step" not in self.marks:
            if device_type == "cuda":
                torch.cuda.synchronize()
            self.mark("first_step")

    def epoch_done(self, epoch: int, images: int) -> None:
        """At the end of an epoch (after its save, where the peer saves there): the timed epochs' images."""
        self.epoch_ends.append(time.time() - self.t0)
        if epoch > 0:
            self.images += images

    def result(self, peer: str, args: argparse.Namespace, end: float, **extra: Any) -> dict[str, Any]:
        """The measurements; ``end`` is when the last checkpoint was complete (seconds since the command)."""
        start = self.timed_from if self.timed_from is not None else self.marks["first_step"]
        steps = {name: self.marks[name] for name in self.PHASES if name in self.marks}
        phases, before = {}, 0.0
        for name, at in steps.items():
            phases[name] = at - before
            before = at
        device = torch.device(args.device)
        memory = None
        if device.type == "cuda":
            memory = {
                "max_allocated_bytes": torch.cuda.max_memory_allocated(),
                "max_reserved_bytes": torch.cuda.max_memory_reserved(),
            }
        return {
            "peer": peer,
            "model": args.model,
            "images_per_s": self.images / (end - start) if self.images else None,
            "timed_images": self.images,
            "timed_seconds": end - start,
            "epoch_ends_s": self.epoch_ends,
            "time_to_first_step_s": self.marks.get("first_step"),
            "startup_phases_s": phases,
            "gpu_memory": memory,
            "checkpoint_bytes": folder_bytes(Path(args.out)),
            **extra,
        }


def folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file()) if folder.exists() else 0


def write_result(path: str, result: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(result, indent=2) + "\n")
