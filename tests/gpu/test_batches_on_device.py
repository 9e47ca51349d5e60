"""Batches on the GPU, workers matched to GPUs, and a GPU run without torch's device warnings.

- ``ddpkit.DataLoader`` hands out nested batches (dicts, namedtuples,
  dataclasses, tuples, lists) with their tensors on the worker's GPU, from
  pinned memory; the copy of the next batch runs while the loop's step does.
- A README-shaped loop without ``.to(device)`` trains.
- More local workers than GPUs stops before any worker starts (``ddpkit
  run``), and with one line on rank 0 under torchrun (not "invalid device
  ordinal").
- A one-worker nccl run's output has neither "barrier(): using the device
  under current context" nor "Guessing device ID based on global rank".
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

from ddpkit import distributed
from ddpkit.bench import gpu_sleep
from ddpkit.data.loader import DataLoader
from tests.cli_runner import REPO
from tests.gpu.runs import TIMEOUT, environ, train

Pair = namedtuple("Pair", ["image", "label"])
DEVICE_WARNINGS = ("barrier(): using the device under current context", "Guessing device ID based on global rank")


@dataclasses.dataclass
class Record:
    pair: Pair
    extra: dict
    names: list[str]


class Nested(Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int):
        return {"pair": Pair(torch.full((3, 8, 8), float(index)), index), "tags": [torch.tensor(index), "t"]}


def _to_record(samples):
    batch = torch.utils.data.default_collate(samples)
    return Record(batch["pair"], {"tags": batch["tags"], "n": len(samples)}, [f"s{i}" for i in range(len(samples))])


@pytest.fixture
def joined():
    """ddpkit.init() on this process's GPU (one worker, nccl), left at the end."""
    ctx = distributed.init(environ={})
    try:
        yield ctx
    finally:
        distributed.shutdown()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_nested_batches_arrive_on_the_workers_gpu(joined, num_workers):
    assert joined.device.type == "cuda"
    loader = DataLoader(Nested(), batch_size=8, shuffle=True, num_workers=num_workers, collate_fn=_to_record)
    assert loader.device == joined.device and loader.pin_memory
    seen = []
    for record in loader:
        assert type(record) is Record and type(record.pair) is Pair
        assert record.pair.image.device == joined.device and record.pair.label.device == joined.device
        assert record.extra["tags"][0].device == joined.device and list(record.extra["tags"][1]) == ["t"] * 8
        assert record.extra["n"] == 8 and record.names[0] == "s0"
        assert torch.equal(record.pair.image[:, 0, 0, 0].long(), record.pair.label)  # each sample's own values
        seen += record.pair.label.tolist()
    assert sorted(seen) == list(range(64))


def test_device_none_keeps_the_batches_on_the_cpu(joined):
    loader = DataLoader(Nested(), batch_size=8, device=None)
    assert loader.device is None and not loader.pin_memory
    assert next(iter(loader))["pair"].image.device.type == "cpu"


def test_the_tensor_fast_path_is_placed_too(joined):
    dataset = torch.utils.data.TensorDataset(torch.arange(32.0), torch.arange(32))
    batches = list(DataLoader(dataset, batch_size=8))
    assert all(x.device == joined.device and y.device == joined.device for x, y in batches)
    assert sorted(torch.cat([y for _, y in batches]).tolist()) == list(range(32))


def test_the_next_batchs_copy_runs_while_the_loops_step_does(joined, monkeypatch):
    """Batch 2's copy, issued while the GPU still runs the step on batch 0, ends before that step does.

    Steps are 1 s kernels; the loader's copies record the events counted here
    (one per batch, on its side stream). A copy queued on the loop's stream
    would wait for the step before it. The batches come from loader workers
    and torch's pinning thread, which prepare them ahead (here during a pause
    before the steps), so the loop's thread only issues the copies. The step's
    kernels run once before: CUDA loads a kernel's module at its first launch
    (lazy loading), a load that may synchronise the whole context: a first
    ``sum()`` here is the likely reason why, on an H200, batch 2's copy once
    ended just after step 0 although ``next()`` took 1.8 ms.
    """
    sleep_cycles = int(1000 * gpu_sleep.cycles_per_ms())  # 1 s
    real_event = torch.cuda.Event
    copies = []

    def timed_event(*args, **kwargs):
        event = real_event(enable_timing=True)
        copies.append(event)
        return event

    monkeypatch.setattr(torch.cuda, "Event", timed_event)
    # 16 MiB per batch: a copy that takes a while, yet far less than a step.
    dataset = torch.utils.data.TensorDataset(torch.rand(4 * 64, 1024, 64))
    batches = iter(DataLoader(dataset, batch_size=64, num_workers=2))
    start, step_0_end, step_1_end = (real_event(enable_timing=True) for _ in range(3))
    try:
        (first,) = next(batches)  # batch 1's copy is queued before batch 0 is handed out
        assert len(copies) == 2
        first.sum()  # the step's kernels loaded (see above)
        torch.cuda.synchronize()
        time.sleep(2.0)  # the workers and the pinning thread have batches 2 and 3 ready
        start.record()
        queued = time.perf_counter()
        torch.cuda._sleep(sleep_cycles)  # the step on batch 0
        first.sum()
        step_0_end.record()
        issued = time.perf_counter()
        (second,) = next(batches)  # the GPU is still in step 0: batch 2's copy is queued now
        issued, queued = time.perf_counter() - issued, time.perf_counter() - queued
        assert len(copies) == 3
        torch.cuda._sleep(sleep_cycles)
        second.sum()
        step_1_end.record()
        torch.cuda.synchronize()
        copied, step_0 = start.elapsed_time(copies[2]), start.elapsed_time(step_0_end)
        assert copied < step_0, (
            f"batch 2's copy ended {copied:.1f} ms after step 0 began, step 0 at {step_0:.1f} ms "
            f"(next() took {1000 * issued:.1f} ms, {1000 * queued:.1f} ms from step 0's start)"
        )
        assert start.elapsed_time(step_1_end) > step_0
    finally:
        list(batches)  # the workers end here, also when an assertion failed (else they outlive the test)


def test_a_readme_shaped_loop_without_to_device_trains(joined):
    import ddpkit

    torch.manual_seed(0)
    images, labels = torch.rand(512, 1, 28, 28), torch.randint(0, 10, (512,))

    class Images(Dataset):
        def __len__(self):
            return len(labels)

        def __getitem__(self, i):
            return images[i], labels[i]

    model = ddpkit.prepare_model(nn.Sequential(nn.Flatten(), nn.Linear(784, 50), nn.ReLU(), nn.Linear(50, 10)))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loader = ddpkit.DataLoader(Images(), global_batch_size=64, shuffle=True, seed=0, num_workers=2)
    losses = []
    for epoch in range(3):
        loader.set_epoch(epoch)
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    assert losses[-1] < losses[0]


# -- workers matched to GPUs -----------------------------------------------------------------------


def test_ddpkit_run_with_more_workers_than_gpus_stops_before_any_worker(tmp_path):
    script = tmp_path / "hello.py"
    script.write_text("raise SystemExit('a worker started')\n")
    nproc = torch.cuda.device_count() + 1
    out = subprocess.run(
        [sys.executable, "-m", "ddpkit", "run", f"nproc={nproc}", str(script)],
        cwd=tmp_path,
        env=environ(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert out.returncode == 2, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and f"nproc={nproc - 1}" in lines[0] and "device=cpu" in lines[0], out.stderr
    assert "a worker started" not in out.stderr


def test_torchrun_with_more_workers_than_gpus_says_the_line_not_invalid_device_ordinal(tmp_path):
    nproc = torch.cuda.device_count() + 1
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            "-m",
            "ddpkit",
            "train",
            "dataset=synthetic",
            "synthetic_samples=256",
            "epochs=1",
            f"output_dir={tmp_path / 'run'}",
        ],
        cwd=tmp_path,
        env=environ(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    text = out.stdout + out.stderr
    assert out.returncode != 0
    assert f"{nproc} workers on this node but" in text and f"--nproc-per-node {nproc - 1}" in text, text[-3000:]
    assert "invalid device ordinal" not in text, text[-3000:]


# -- no device warnings --------------------------------------------------------------------------


def test_a_one_worker_nccl_run_has_no_device_warnings(tmp_path):
    summary, text = train(tmp_path / "run")
    assert summary["world_size"] == 1
    assert "backend nccl" in text
    for warning in DEVICE_WARNINGS:
        assert warning not in text, text[-3000:]


def test_the_own_loop_example_with_main_process_first_has_no_device_warnings(tmp_path):
    """examples/mlp_fashion_mnist.py: main_process_first (a barrier) and the loop without .to(device)."""
    command = [
        sys.executable,
        "-m",
        "ddpkit",
        "run",
        "nproc=1",
        str(Path(REPO) / "examples" / "mlp_fashion_mnist.py"),
        "--dataset",
        "synthetic",
        "--samples",
        "512",
        "--epochs",
        "1",
        "--out",
        str(tmp_path / "out"),
    ]
    out = subprocess.run(command, cwd=tmp_path, env=environ(), capture_output=True, text=True, timeout=TIMEOUT)
    assert out.returncode == 0, (out.stdout + out.stderr)[-5000:]
    for warning in DEVICE_WARNINGS:
        assert warning not in out.stdout + out.stderr
