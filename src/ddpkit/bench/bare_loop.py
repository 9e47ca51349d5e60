"""The reference ddpkit's overhead is measured against: a bare PyTorch loop.

Same model, optimizer, global batches, in-memory tensors and batch
indexing (``index_select``) as ``ddpkit train`` with one worker, and nothing
else: no process group, no sampler object, no metrics, no checkpoints. Run as ``python -m ddpkit.bench.bare_loop key=value ...``
(the TrainConfig words); prints one JSON line with the train time, the
steps taken and the test accuracy. ``max_steps`` stops it after that many
steps (``ddpkit bench train``'s T2 rows match another run's step count).
"""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.nn.functional as F

from ddpkit.checkpoint import seed_everything
from ddpkit.data.datasets import load_images
from ddpkit.data.sampler import epoch_permutation
from ddpkit.distributed import default_num_threads
from ddpkit.models.registry import get_model_spec
from ddpkit.train.config import parse_train_config
from ddpkit.train.loop import build_optimizer
from ddpkit.train.run import data_options


def bare_loop(words: list[str]) -> dict[str, float]:
    """Train as a textbook loop and return train time, steps, samples and test accuracy."""
    cfg = parse_train_config(words)
    torch.set_num_threads(cfg.threads or default_num_threads(1))
    spec = get_model_spec(cfg.model)
    assert spec.task == "classification", "the bare loop covers classifiers"
    data = load_images(cfg.dataset, data_options(cfg))
    seed_everything(cfg.seed)
    model = spec.build()
    optimizer = build_optimizer(cfg, model.parameters(), 1)
    # Pixels in [0, 1] once, as the dataset hands them to ddpkit's loader.
    images, labels = data.train_images.float().div_(255.0), data.train_labels
    steps, samples = 0, 0
    start = time.perf_counter()
    for epoch in range(cfg.epochs):
        order = epoch_permutation(len(labels), cfg.seed, epoch)
        for batch in order.split(cfg.batch_size):
            if cfg.max_steps and steps == cfg.max_steps:
                break
            loss = F.cross_entropy(model(images.index_select(0, batch)), labels.index_select(0, batch))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            steps, samples = steps + 1, samples + len(batch)
    train_time = time.perf_counter() - start
    with torch.no_grad():
        accuracy = (model(data.test_images.float() / 255.0).argmax(1) == data.test_labels).float().mean().item()
    return {"train_time_s": train_time, "steps": steps, "samples": samples, "test_accuracy": accuracy}


if __name__ == "__main__":
    from ddpkit.distributed import exit_process

    print(json.dumps(bare_loop(sys.argv[1:])))
    exit_process(0)  # without the interpreter's teardown of torch, as the ddpkit command ends
