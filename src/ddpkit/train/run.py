"""One worker's whole training run: join the job, load data, train, report."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ddpkit import distributed
from ddpkit.config import TrainConfig, to_dict
from ddpkit.data.datasets import DataOptions, TensorDataset, load_dataset
from ddpkit.launch.failure import record_for_launcher
from ddpkit.log import get_logger, setup_logging
from ddpkit.models.registry import get_model_spec
from ddpkit.train.checkpointing import attach_checkpointing
from ddpkit.train.loop import Trainer


def data_options(cfg: TrainConfig) -> DataOptions:
    """The dataset options of a training config."""
    return DataOptions(
        data_dir=cfg.data_dir,
        download=cfg.download,
        mirrors=(cfg.data_mirror,) if cfg.data_mirror else (),
        synthetic_samples=cfg.synthetic_samples,
        seed=cfg.seed,
    )


def run_worker(cfg: TrainConfig) -> dict[str, Any]:
    """Train as one worker of the job this process belongs to; returns the summary.

    Works the same under ddpkit's launcher, torchrun, srun, mpirun or alone.
    """
    ctx = distributed.init(cfg.backend, cfg.device, cfg.timeout, cfg.threads)
    try:
        log = setup_logging(ctx.rank, ctx.world_size)
        log.info(
            f"{ctx.env.source}: world_size {ctx.world_size} on {ctx.env.num_nodes} node(s), "
            f"master {ctx.env.master_addr}:{ctx.env.master_port}, backend {ctx.backend}, device {ctx.device}"
        )
        log.info("config: " + " ".join(f"{k}={v}" for k, v in to_dict(cfg).items()))
        spec = get_model_spec(cfg.model)
        with distributed.main_process_first(local=True):  # one download per node
            dataset: TensorDataset = load_dataset(cfg.dataset, data_options(cfg))
        trainer = Trainer(cfg, ctx, dataset, spec)
        checkpoints = attach_checkpointing(trainer, os.environ)
        try:
            summary = trainer.fit()
        finally:
            if checkpoints is not None:
                checkpoints.close()
        if ctx.is_main_process:
            path = Path(cfg.output_dir) / "summary.json"
            path.write_text(json.dumps(summary, indent=2) + "\n")
            get_logger().info(_final_line(summary))
        return summary
    except Exception as error:
        # Under an elastic agent: record the error with the time it happened, then exit at once
        # without leaving the group, so the peers (which fail because this rank is gone) cannot
        # fail, record and exit before it and be taken for the root cause.
        if record_for_launcher(error) and ctx.world_size > 1:
            distributed.exit_process(1, leave_group=False)
        raise
    finally:
        distributed.shutdown()


def _final_line(summary: dict[str, Any]) -> str:
    test = summary["test"]
    quality = f"test accuracy {100 * test['accuracy']:.2f}%" if "accuracy" in test else f"test MSE {test['mse']:.5f}"
    return (
        f"done: {summary['model']} on {summary['dataset']}, {summary['world_size']} worker(s), "
        f"{quality}, train time {summary['train_time_s']:.2f}s, {summary['samples_per_s']:,.0f} samples/s"
    )
