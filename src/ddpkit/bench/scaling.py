"""``ddpkit bench scaling``: where a workload's step time goes as workers, nodes and all_reduce change.

For every configuration of the matrix ``workers x allreduce x nodes`` it
starts fresh workers, trains the workload for a fixed number of steps and
reports the time per step split into data, forward, backward, optimizer and
the communication that backward does not hide; samples/s; speedup and
efficiency against 1 worker. An alpha-beta model fitted in the same run
predicts every step time, and projects the workload onto other networks up
to 1,000 nodes::

    ddpkit bench scaling                                  # W1, workers [1,2] x [builtin,shm] x nodes [1,2]
    ddpkit bench scaling workload=W3 workers=[1,2,4] allreduce=[builtin,shm,ring] nodes=[1]
    ddpkit bench scaling smoke=true output_dir=/tmp/out   # a check that it works (about a minute)

Nodes
    ``nodes=1``: the workers are started on this machine by ddpkit's launcher
    (torch's elastic agent). ``nodes=2``: two emulated hosts, network
    namespaces joined by a veth pair (:mod:`ddpkit.bench.netns`, needs root),
    with one ``torchrun`` in each and ``workers / 2`` workers per host. The
    hosts still share the cores, memory and ``/dev/shm``: the shm all_reduce
    works across them only because of that, which real nodes never allow.
    Every worker gets ``cores / workers`` torch threads (at least one), or ``threads``.

How a step is split (each rank, ``perf_counter``)
    Up to four passes over the same batches, interleaved in blocks of
    ``block_steps`` steps (a barrier before each block) so that load from
    elsewhere on a shared machine hits them alike:

    (a) compute: a copy of the model with no gradient synchronisation and
        its own optimizer; timed are data (index the in-memory images and
        convert them), forward (with the loss), backward and optimizer
        (step and zero_grad);
    (b) real: ``Trainer.train_step`` with the run's gradient sync (DDP or
        flat, see ``ddpkit.comm.grad_sync``) and all_reduce algorithm,
        timed as a whole;
    (c) sync without communication: another copy synchronised the same
        way (the same ``GradientSync``) with an all_reduce that moves
        nothing; (c) - (a) is the synchronisation's own cost (DDP's
        autograd hooks and bucket copies, plus the hand-off of the
        communication hook's thread, which DDP's built-in all_reduce does
        not pay; the flat buffer's hooks, copies and division);
    (d) probes: a compute step (a), then one timed all_reduce call, the
        sizes of the fit taken in turn.

    Exposed communication = (b) - (a): the all_reduce time that backward did
    not hide, the synchronisation's bookkeeping and the wait for the slowest rank. Each
    figure is the median over the measured steps, then the maximum over
    ranks (the slowest rank sets the pace).

The model (:mod:`ddpkit.bench.perfmodel`)
    ``t(n) = alpha + beta n`` is fitted by least squares to the probes (d):
    all_reduce calls made the way training makes them, one per step after
    the step's compute, ranks arriving apart by their compute's jitter,
    caches cold, a waiting rank possibly descheduled. On a loaded 2-core
    machine these cost several times what back-to-back calls after a
    barrier cost (``ddpkit bench comm``'s method, measured too and reported
    as "isolated"): fitted to those, the model under-predicts by 30-70%.
    The predicted step is (a) + ((c) - (a)) + ``t(gradient bytes)``, made
    for each round from that round's measurements (so that prediction and
    measurement saw the same load), then the median over rounds, with
    no credit for overlap with backward (W1's gradients are reduced in one
    call after backward, so there is nothing to overlap). The projection fits compute
    against the per-worker batch, timed in the 1-worker run at the batch
    halved down to 1 sample (one process: no contention between workers, as
    on nodes with their own cores), and uses the ring all_reduce cost on
    each named network, one worker per node.

Results go to ``<output_dir>/scaling-<model>-<machine>-<date>[-smoke]`` ``.json``, ``.md`` and ``.png``
(rendered by :mod:`ddpkit.bench.scaling_report`).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddpkit.bench import perfmodel
from ddpkit.bench.report import file_stem, write_report
from ddpkit.bench.scaling_report import plot_report, render_markdown, render_projection_sentence, render_table
from ddpkit.bench.scaling_spec import PARTS
from ddpkit.bench.system import machine_info, machine_tag
from ddpkit.errors import UserError
from ddpkit.figures import format_bytes
from ddpkit.keyvalue import ConfigError, check_positive, parse

if TYPE_CHECKING:
    from ddpkit.distributed import Context

WORKLOADS = {"W1": "mlp", "W2": "cnn", "W3": "autoencoder"}
"""Reference workloads (WORKLOADS.md) by id, and the registered model each trains."""

SMOKE_PRESETS = {"warmup": 2, "steps": 8, "block_steps": 4, "comm_iterations": 3, "comm_repeats": 2}
"""What ``smoke=true`` changes; words on the command line still win."""

SMOKE_SAMPLES = 2048
"""Synthetic training samples of a smoke run."""


@dataclasses.dataclass
class ScalingBenchConfig:
    """Options of ``ddpkit bench scaling``."""

    workload: str = "W1"
    """W1, W2, W3 (see WORKLOADS.md) or a registered model name, trained with its recipe."""
    dataset: str = "fashion-mnist"
    """Dataset to train on (smoke runs use synthetic data)."""
    train: list[str] = dataclasses.field(default_factory=list)
    """Extra ``ddpkit train`` words for every run, e.g. [batch_size=128,optimizer=sgd]."""
    workers: list[int] = dataclasses.field(default_factory=lambda: [1, 2])
    """Worker counts (in all, over the nodes); more workers than cores are time-shared."""
    allreduce: list[str] = dataclasses.field(default_factory=lambda: ["builtin", "shm"])
    """all_reduce algorithms for runs with more than one worker (builtin, shm, ring, tree, ...)."""
    nodes: list[int] = dataclasses.field(default_factory=lambda: [1, 2])
    """Node counts: 1 (this machine) or 2 (two emulated hosts, network namespaces; needs root)."""
    warmup: int = 20
    """Untimed steps of each pass before measuring."""
    steps: int = 200
    """Measured steps of each pass (compute-only and real)."""
    block_steps: int = 50
    """Steps per block; the two passes alternate block by block."""
    comm_iterations: int = 20
    """all_reduce calls per timed batch, for the alpha-beta fit."""
    comm_repeats: int = 5
    """Timed batches per all_reduce size."""
    threads: int = 0
    """Torch threads per worker; 0 shares this machine's cores among all the workers (at least 1 each)."""
    repeats: int = 1
    """Rounds of the whole matrix (each configuration once per round, in order); figures are medians over rounds."""
    max_nodes: int = 1000
    """Largest node count of the projection."""
    smoke: bool = False
    """A tiny run (synthetic data, a few steps) to check that the benchmark works."""
    output_dir: str = "benchmarks"
    """Folder for the JSON, Markdown and PNG results."""
    tag: str = ""
    """Suffix of the result files' names, after the date."""
    timeout: float = 600.0
    """Seconds one configuration may take (and a collective may wait) before the benchmark fails."""

    def __post_init__(self) -> None:
        from ddpkit.comm.registry import ALLREDUCE_ALGORITHMS

        check_positive("threads", self.threads, allow_zero=True)
        for name in (
            "warmup",
            "steps",
            "block_steps",
            "comm_iterations",
            "comm_repeats",
            "repeats",
            "max_nodes",
            "timeout",
        ):
            check_positive(name, getattr(self, name))
        if not self.workers or any(n < 1 for n in self.workers):
            raise ConfigError(f"workers={self.workers} is not valid; give worker counts >= 1, e.g. workers=[1,2]")
        if not self.nodes or any(n not in (1, 2) for n in self.nodes):
            raise ConfigError(f"nodes={self.nodes} is not valid; emulated node counts are 1 and 2, e.g. nodes=[1,2]")
        for name in self.allreduce:
            if name not in ALLREDUCE_ALGORITHMS:
                raise ConfigError(
                    f"allreduce: {name!r} is not an all_reduce algorithm; "
                    f"choose among: {', '.join(ALLREDUCE_ALGORITHMS)}"
                )
        if not self.allreduce and any(n > 1 for n in self.workers):
            raise ConfigError("allreduce is empty; name at least one algorithm, e.g. allreduce=[builtin]")
        if "/" in self.tag or self.tag.startswith("."):
            raise ConfigError(f"tag={self.tag!r} is not valid in a file name; use letters, digits and '-'")

    @property
    def model(self) -> str:
        """The registered model name of the workload."""
        return WORKLOADS.get(self.workload, self.workload)


def parse_config(words: Sequence[str]) -> ScalingBenchConfig:
    """The configuration from ``key=value`` words, with the smoke presets under ``smoke=true``.

    Raises:
        ConfigError: unknown key or invalid value.
    """
    smoke = parse(ScalingBenchConfig, words).smoke
    return parse(ScalingBenchConfig, words, presets=SMOKE_PRESETS if smoke else None)


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One configuration of the matrix."""

    workers: int
    nodes: int
    allreduce: str
    """Algorithm name; "none" for one worker."""

    @property
    def name(self) -> str:
        """How tables name it, e.g. ``2 workers, 2 nodes, shm``."""
        if self.workers == 1:
            return "1 worker"
        return f"{self.workers} workers, {self.nodes} node{'s' if self.nodes > 1 else ''}, {self.allreduce}"


def configurations(cfg: ScalingBenchConfig) -> list[RunSpec]:
    """The matrix, in run order: one 1-worker baseline, then workers x nodes x allreduce.

    Combinations with fewer workers than nodes, or workers not divisible by nodes, are left out.
    """
    runs = []
    for workers in sorted(set(cfg.workers)):
        if workers == 1:
            runs.append(RunSpec(1, 1, "none"))
            continue
        for nodes in sorted(set(cfg.nodes)):
            if workers % nodes:
                continue
            runs.extend(RunSpec(workers, nodes, name) for name in cfg.allreduce)
    return runs


# --- inside each worker --------------------------------------------------------------------------


def _train_words(cfg: ScalingBenchConfig, allreduce: str, output_dir: str, threads: int) -> list[str]:
    words = [
        f"model={cfg.model}",
        f"dataset={cfg.dataset}",
        "progress=false",
        f"output_dir={output_dir}",
        f"threads={threads}",
        "eval_every_epoch=false",
        "checkpoint.enabled=false",
    ]
    if cfg.smoke:
        words += ["dataset=synthetic", f"synthetic_samples={SMOKE_SAMPLES}"]
    words += list(cfg.train)
    return words + [f"allreduce={allreduce}"]


def _batches(trainer: Any) -> Iterator[tuple[Any, int]]:
    """This rank's batches from the trainer's loader and their global batch length, epoch after epoch."""
    epoch = 0
    while True:
        trainer.loader.set_epoch(epoch)
        for batch in trainer.loader:
            yield batch, trainer.loader.last_global_batch_length
        epoch += 1


def _inputs(batch: Any) -> tuple[Any, Any]:
    from ddpkit.train.task import split_batch  # (imported late: the bench's CLI does not need torch)

    return split_batch(batch)


def _mean_loss(trainer: Any, output: Any, x: Any, y: Any) -> Any:
    return trainer.task.loss_sum(output, x, y) / len(x)


def _time_allreduce(fn: Any, sizes: Sequence[int], iterations: int, repeats: int) -> list[float]:
    """Median seconds per all_reduce call at each size on this rank: batches of back-to-back calls
    after a barrier, as ``ddpkit bench comm`` times them (for reference beside the in-step probes)."""
    import torch
    import torch.distributed as dist

    times = []
    for num_bytes in sizes:
        tensor = torch.zeros(max(1, num_bytes // 4))
        for _ in range(2):
            fn(tensor)
        samples = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(iterations):
                fn(tensor)
            samples.append((time.perf_counter() - start) / iterations)
        times.append(statistics.median(samples))
    return times


def batch_ladder(batch: int) -> list[int]:
    """Per-worker batches whose compute the 1-worker run times for the projection: batch, batch/2, ..., 1."""
    sizes = []
    while batch >= 1:
        sizes.append(batch)
        batch //= 2
    return sizes


def fit_sizes(gradient_bytes: int) -> list[int]:
    """all_reduce sizes for the fit: 4 KiB, a quarter, half and all of the gradients (float32 multiples).

    None above the gradients: an algorithm may switch there (shm does at 256 KiB), and a line
    fitted across the switch would bend the prediction at the one size that matters.
    """
    sizes = {min(4096, gradient_bytes), gradient_bytes // 4, gradient_bytes // 2, gradient_bytes}
    return sorted({max(4, s - s % 4) for s in sizes})


def _step_timers(trainer: Any, train_cfg: Any, world_size: int, allreduce: Any, sizes: Sequence[int]) -> list[Any]:
    """The timed passes, each a function of (batch, global_count) returning its times.

    - compute: an unwrapped copy of the model with its own optimizer (data, forward, backward, optimizer);
    - real: ``Trainer.train_step`` (the run's gradient sync and all_reduce algorithm);
    and with several workers:
    - sync_noop: another copy synchronised the same way with no bytes moved (the synchronisation's own cost);
    - probe: a compute step, then one timed ``allreduce`` call, sizes taken in turn (key ``comm_<i>``).
    """
    import itertools

    import torch

    from ddpkit.train.loop import build_optimizer

    module = copy.deepcopy(trainer.module)
    optimizer = build_optimizer(train_cfg, module.parameters(), world_size)
    clock = time.perf_counter

    def compute_only(batch: Any, global_count: int) -> dict[str, float]:
        t0 = clock()
        x, y = _inputs(batch)
        t1 = clock()
        loss = _mean_loss(trainer, module(x), x, y)
        t2 = clock()
        loss.backward()
        t3 = clock()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        t4 = clock()
        return {"data": t1 - t0, "forward": t2 - t1, "backward": t3 - t2, "optimizer": t4 - t3, "compute": t4 - t0}

    def real(batch: Any, global_count: int) -> dict[str, float]:
        t0 = clock()
        trainer.train_step(batch)
        return {"step": clock() - t0}

    if world_size == 1:
        # The compute of a smaller share, for the projection: the batch halved down to 1 sample.
        ladder = itertools.cycle(batch_ladder(int(trainer.loader.global_batch_size)))

        def share(batch: Any, global_count: int) -> dict[str, float]:
            b = next(ladder)
            return {f"compute_b{b}": compute_only([part[:b] for part in batch], global_count)["compute"]}

        return [compute_only, real, share]

    sync_noop = _sync_without_communication(trainer, train_cfg, world_size)

    tensors = [torch.zeros(max(1, n // 4)) for n in sizes]
    turn = itertools.cycle(range(len(sizes)))

    def probe(batch: Any, global_count: int) -> dict[str, float]:
        compute_only(batch, global_count)
        i = next(turn)
        t0 = clock()
        allreduce(tensors[i])
        return {f"comm_{i}": clock() - t0}

    return [compute_only, real, sync_noop, probe]


def _sync_without_communication(trainer: Any, train_cfg: Any, world_size: int) -> Any:
    """A timed pass over a copy of the model, its gradients synchronised the trainer's way with no bytes moved.

    The same ``GradientSync`` as the trainer's, given an all_reduce that does
    nothing (with DDP, as its communication hook). Minus the compute-only
    pass, this is the synchronisation's own cost (DDP's autograd hooks and
    bucket copies; the flat buffer's hooks, copies and division).
    """
    from ddpkit.comm.grad_sync import GradientSync
    from ddpkit.train.loop import build_optimizer

    plain = copy.deepcopy(trainer.module)
    sync = GradientSync(plain, trainer.ctx, trainer.allreduce, trainer.grad_sync, all_reduce_fn=_no_all_reduce)
    model = sync.model
    optimizer = build_optimizer(train_cfg, model.parameters(), world_size)
    clock = time.perf_counter

    def sync_noop(batch: Any, global_count: int) -> dict[str, float]:
        t0 = clock()
        optimizer.zero_grad()  # as the trainer does
        x, y = _inputs(batch)
        _mean_loss(trainer, model(x), x, y).backward()  # synchronised at its end
        optimizer.step()
        return {"sync_noop": clock() - t0}

    return sync_noop


def _no_all_reduce(tensor: Any, op: Any = None, group: Any = None) -> None:
    """An all_reduce that moves nothing (the tensor keeps this rank's values)."""


def _measure_steps(trainer: Any, cfg: ScalingBenchConfig, timers: Sequence[Any]) -> dict[str, float]:
    """Medians over the measured steps of every key the timers return, on this rank.

    The passes alternate block by block, so that a burst of load from
    elsewhere hits them alike; every block starts after a barrier.
    """
    import torch.distributed as dist

    batches = _batches(trainer)
    for timer in timers:
        for _ in range(cfg.warmup):
            timer(*next(batches))
    samples: dict[str, list[float]] = {}
    done = 0
    while done < cfg.steps:
        block = min(cfg.block_steps, cfg.steps - done)
        for timer in timers:
            dist.barrier()
            for _ in range(block):
                for key, value in timer(*next(batches)).items():
                    samples.setdefault(key, []).append(value)
        done += block
    result = {key: statistics.median(values) for key, values in samples.items()}
    result["step_min"], result["step_max"] = min(samples["step"]), max(samples["step"])
    return result


def run_configuration(job: dict[str, Any]) -> dict[str, Any] | None:
    """Measure one configuration as one worker of its job; rank 0 writes and returns the result.

    Args:
        job: ``{"bench": asdict(ScalingBenchConfig), "allreduce", "scratch_dir", "result_path"}``.

    Returns:
        The configuration's measurements on rank 0, None elsewhere.
    """
    from ddpkit import distributed
    from ddpkit.env.detect import detect_environment

    cfg = ScalingBenchConfig(**job["bench"])
    world_size = detect_environment(os.environ).world_size
    threads = cfg.threads or max(1, len(os.sched_getaffinity(0)) // world_size)
    ctx = distributed.init("gloo", "cpu", cfg.timeout, threads)
    try:
        return _measure_configuration(cfg, job, ctx, threads)
    finally:
        distributed.shutdown()


def _measure_configuration(
    cfg: ScalingBenchConfig, job: dict[str, Any], ctx: Context, threads: int
) -> dict[str, Any] | None:
    """:func:`run_configuration`'s measurements, in the joined group.

    The trainer lives in this frame only, so that it (and a DDP model's reducer) is freed before the
    group is destroyed: ``ddpkit train``'s ``_train`` says why a reducer freed after it can hang.
    """
    import torch
    import torch.distributed as dist

    from ddpkit.comm import flat_grads
    from ddpkit.comm.registry import resolve_allreduce
    from ddpkit.data.datasets import load_datasets
    from ddpkit.models.registry import get_model_spec
    from ddpkit.train.config import TrainConfig
    from ddpkit.train.run import build_trainer, data_options

    world_size = ctx.world_size
    spec = get_model_spec(cfg.model)
    words = _train_words(cfg, job["allreduce"] if world_size > 1 else "builtin", job["scratch_dir"], threads)
    train_cfg = parse(TrainConfig, words, presets=dict(spec.recipe))
    train_set, test_set = load_datasets(train_cfg.dataset, data_options(train_cfg))
    trainer = build_trainer(train_cfg, ctx, spec, train_set, test_set)
    gradient_bytes = flat_grads.gradient_bytes(trainer.module)
    sizes, comm_isolated = fit_sizes(gradient_bytes), []
    fn = None
    if world_size > 1:
        fn = dist.all_reduce if trainer.allreduce == "builtin" else resolve_allreduce(trainer.allreduce)
        comm_isolated = _time_allreduce(fn, sizes, cfg.comm_iterations, cfg.comm_repeats)
    steps = _measure_steps(trainer, cfg, _step_timers(trainer, train_cfg, world_size, fn, sizes))
    per_rank: list[Any] = [None] * world_size
    dist.all_gather_object(per_rank, {"steps": steps, "comm_isolated": comm_isolated})
    if ctx.rank != 0:
        return None
    slowest = {key: max(r["steps"][key] for r in per_rank) for key in steps}
    comm_slowest = [slowest[f"comm_{i}"] for i in range(len(sizes))] if world_size > 1 else []
    isolated_slowest = [max(r["comm_isolated"][i] for r in per_rank) for i in range(len(comm_isolated))]
    result = {
        "world_size": world_size,
        "num_nodes": ctx.env.num_nodes,
        "threads": threads,
        "allreduce": trainer.allreduce if world_size > 1 else "none",
        "grad_sync": trainer.grad_sync,
        "batch_per_worker": len(next(_batches(trainer))[0][0]),
        "global_batch": trainer.loader.global_batch_size,
        "gradient_bytes": gradient_bytes,
        "slowest_rank": slowest,
        "comm_sizes": sizes if comm_slowest else [],
        "comm_s": comm_slowest,
        "comm_isolated_s": isolated_slowest,
        "torch_threads": torch.get_num_threads(),
    }
    Path(job["result_path"]).write_text(json.dumps(result))
    return result


# --- starting the workers ----------------------------------------------------------------------


def _worker_environment() -> dict[str, str]:
    # No interface or launcher variable may leak in: ddpkit picks gloo's interface itself.
    drop = ("GLOO_SOCKET_IFNAME", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    launchers = ("SLURM_", "OMPI_", "TORCHELASTIC_", "PMI_")
    return {k: v for k, v in os.environ.items() if k not in drop and not k.startswith(launchers)}


def _run_on_two_hosts(job: dict[str, Any], workers: int, timeout: float) -> None:
    from ddpkit.bench import netns
    from ddpkit.env.ports import free_port

    reason = netns.unavailable_reason()
    if reason:
        raise UserError(f"nodes=2 emulates two hosts with network namespaces, but {reason}; run with nodes=[1]")
    job_path = Path(job["scratch_dir"]) / "job.json"
    job_path.write_text(json.dumps(job))
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    # Any port is free in namespaces just created; the static rendezvous: node rank 0 hosts the store.
    port = free_port()
    with netns.two_hosts() as (a, b):
        procs = []
        for node_rank, host in enumerate((a, b)):
            argv = host.command(
                [
                    torchrun,
                    "--nnodes",
                    "2",
                    "--nproc-per-node",
                    str(workers // 2),
                    "--node-rank",
                    str(node_rank),
                    "--master-addr",
                    a.address,
                    "--master-port",
                    str(port),
                    "-m",
                    "ddpkit.bench.scaling",
                    "worker",
                    str(job_path),
                ]
            )
            procs.append(
                subprocess.Popen(
                    argv,
                    env=_worker_environment(),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    start_new_session=True,
                )
            )
        outputs = []
        try:
            for proc in procs:
                outputs.append(proc.communicate(timeout=timeout))
        finally:
            for proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.communicate()
        for proc, (_, stderr) in zip(procs, outputs):
            if proc.returncode != 0:
                raise RuntimeError(f"a torchrun on an emulated host failed (exit {proc.returncode}):\n{stderr[-3000:]}")


def measure(cfg: ScalingBenchConfig, run: RunSpec) -> dict[str, Any]:
    """Start fresh workers for ``run``, measure, and return rank 0's result.

    Raises:
        ValueError: nodes=2 where namespaces cannot be created.
        RuntimeError, ddpkit.launchers.failure.LaunchError: a worker failed.
    """
    from ddpkit.launchers.local import LaunchSpec, launch_local

    with tempfile.TemporaryDirectory(prefix="ddpkit-scaling-") as scratch:
        result_path = Path(scratch) / "result.json"
        job = {
            "bench": dataclasses.asdict(cfg),
            "allreduce": run.allreduce,
            "scratch_dir": scratch,
            "result_path": str(result_path),
        }
        if run.nodes == 1:
            launch_local(LaunchSpec(run.workers), run_configuration, job)
        else:
            _run_on_two_hosts(job, run.workers, cfg.timeout)
        result: dict[str, Any] = json.loads(result_path.read_text())
        return result


# --- the analysis ------------------------------------------------------------------------------


def sync_overhead(measured: dict[str, Any]) -> float:
    """The gradient synchronisation's own cost per step: its no-communication pass minus the compute-only pass."""
    s = measured["slowest_rank"]
    return max(0.0, s["sync_noop"] - s["compute"]) if "sync_noop" in s else 0.0


def predict_step(measured: dict[str, Any]) -> float:
    """The model's step time from one configuration's measurements.

    Compute-only step + synchronisation overhead + ``t(gradient bytes)``, with
    ``t(n) = alpha + beta n`` fitted to the in-step all_reduce probes; no
    credit for overlap with backward.
    """
    comm = 0.0
    if measured["comm_s"]:
        comm = perfmodel.fit_line(measured["comm_sizes"], measured["comm_s"])(measured["gradient_bytes"])
    compute: float = measured["slowest_rank"]["compute"]
    return compute + sync_overhead(measured) + comm


def merge_rounds(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One configuration's rounds as one result: the median of every time over rounds.

    ``step_min`` and ``step_max`` are the extremes over all rounds; ``step_by_round`` keeps each round's median
    and ``predicted_by_round`` each round's prediction from its own measurements.
    """
    merged = dict(results[0])
    keys = results[0]["slowest_rank"]
    slowest = {key: statistics.median(r["slowest_rank"][key] for r in results) for key in keys}
    slowest["step_min"] = min(r["slowest_rank"]["step_min"] for r in results)
    slowest["step_max"] = max(r["slowest_rank"]["step_max"] for r in results)
    merged["slowest_rank"] = slowest
    for key in ("comm_s", "comm_isolated_s"):
        merged[key] = [statistics.median(values) for values in zip(*(r[key] for r in results))]
    merged["step_by_round"] = [r["slowest_rank"]["step"] for r in results]
    merged["predicted_by_round"] = [predict_step(r) for r in results]
    return merged


def analyse_row(run: RunSpec, measured: dict[str, Any], baseline_rate: float | None, cores: int) -> dict[str, Any]:
    """The report row of one configuration: breakdown, rate, speedup, fit, prediction and bottleneck.

    Args:
        run: the configuration.
        measured: :func:`run_configuration`'s result.
        baseline_rate: samples/s of the 1-worker row (None when it was not run).
        cores: this machine's cores (to say when workers are time-shared).
    """
    s = measured["slowest_rank"]
    step = s["step"]
    compute = s["compute"]
    breakdown = {part: s[part] for part in PARTS[:-1]}
    breakdown["exposed_comm"] = max(0.0, step - compute)
    rate = measured["global_batch"] / step
    row: dict[str, Any] = {
        "name": run.name,
        "workers": run.workers,
        "nodes": run.nodes,
        "allreduce": measured["allreduce"],
        "grad_sync": measured.get("grad_sync", "ddp"),
        "threads_per_worker": measured["threads"],
        "batch_per_worker": measured["batch_per_worker"],
        "global_batch": measured["global_batch"],
        "gradient_bytes": measured["gradient_bytes"],
        "step_s": {
            "median": step,
            "min": s["step_min"],
            "max": s["step_max"],
            "by_round": measured.get("step_by_round", [step]),
        },
        "compute_s": compute,
        "breakdown_s": breakdown,
        "samples_per_s": rate,
        "speedup": rate / baseline_rate if baseline_rate else None,
    }
    row["efficiency"] = row["speedup"] / run.workers if row["speedup"] is not None else None
    ladder = {int(k[len("compute_b") :]): v for k, v in s.items() if k.startswith("compute_b")}
    if ladder:
        row["compute_by_batch_s"] = {b: ladder[b] for b in sorted(ladder)}
    comm_pred = 0.0
    if measured["comm_s"]:
        fit = perfmodel.fit_line(measured["comm_sizes"], measured["comm_s"])
        comm_pred = fit(measured["gradient_bytes"])
        isolated = perfmodel.fit_line(measured["comm_sizes"], measured["comm_isolated_s"])
        row["comm_fit"] = {
            "sizes": measured["comm_sizes"],
            "seconds": measured["comm_s"],
            "alpha_s": fit.intercept,
            "beta_s_per_byte": fit.slope,
            "allreduce_gradient_s": comm_pred,
            "isolated": {
                "seconds": measured["comm_isolated_s"],
                "alpha_s": isolated.intercept,
                "beta_s_per_byte": isolated.slope,
                "allreduce_gradient_s": isolated(measured["gradient_bytes"]),
            },
        }
    row["sync_overhead_s"] = sync_overhead(measured)
    # Each round's prediction from that round's own measurements (same load on the machine), then
    # the median over rounds, as for the measured step.
    by_round = measured.get("predicted_by_round") or [predict_step(measured)]
    row["predicted_by_round_s"] = by_round
    row["predicted_step_s"] = statistics.median(by_round)
    row["prediction_error"] = row["predicted_step_s"] / step - 1
    row["bottleneck"] = bottleneck(row, cores)
    return row


def bottleneck(row: dict[str, Any], cores: int) -> str:
    """One plain sentence naming what limits a configuration's step."""
    parts = row["breakdown_s"]
    step = row["step_s"]["median"]
    share = {part: value / step for part, value in parts.items()}
    largest = max(parts, key=parts.get)
    notes = []
    if row["workers"] > cores:
        notes.append(f"{row['workers']} workers share {cores} cores, so compute is time-shared")
    if largest == "exposed_comm" or share["exposed_comm"] >= 0.4:
        fit = row.get("comm_fit")
        kind = ""
        if fit:
            latency_share = fit["alpha_s"] / max(fit["allreduce_gradient_s"], 1e-12)
            kind = (
                f"; the all_reduce of {format_bytes(row['gradient_bytes'])} is latency-bound "
                f"(alpha {fit['alpha_s'] * 1e6:.0f} us is {100 * latency_share:.0f}% of it)"
                if latency_share >= 0.5
                else f"; the all_reduce of {format_bytes(row['gradient_bytes'])} is bandwidth-bound "
                f"({1 / max(fit['beta_s_per_byte'], 1e-15) / 1e9:.2f} GB/s)"
            )
        if row["allreduce"] == "shm":
            where = (
                "through shared memory (the emulated hosts share this machine's memory)"
                if row["nodes"] > 1
                else "through shared memory"
            )
        else:
            where = "between emulated hosts (veth, TCP)" if row["nodes"] > 1 else "over TCP loopback"
        text = (
            f"communication: {100 * share['exposed_comm']:.0f}% of the step is all_reduce ({row['allreduce']}) "
            f"{where} not hidden by backward{kind}"
        )
    else:
        compute_share = sum(share[p] for p in PARTS[:-1])
        text = f"compute: {100 * compute_share:.0f}% of the step, most of it {largest} ({100 * share[largest]:.0f}%)"
        if row["workers"] > 1:
            text += f"; communication adds {100 * share['exposed_comm']:.0f}%"
    return text + ("; " + "; ".join(notes) if notes else "")


def projection(rows: Sequence[dict[str, Any]], per_worker: bool, batch_size: int, max_nodes: int) -> dict[str, Any]:
    """Projected speedup and efficiency on the default networks, one worker per node, up to ``max_nodes``.

    Compute per step is fitted linearly against the per-worker batch: on the 1-worker row's batch ladder
    (one process, the batch halved down to 1 sample), else over the measured rows.
    """
    ladder = next((r["compute_by_batch_s"] for r in rows if r.get("compute_by_batch_s")), None)
    if ladder:
        fit = perfmodel.fit_line([float(b) for b in ladder], list(ladder.values()))
    else:
        fit = perfmodel.fit_line([r["batch_per_worker"] for r in rows], [r["compute_s"] for r in rows])
    workload = perfmodel.Workload(batch_size, per_worker, rows[0]["gradient_bytes"], fit)
    sizes = perfmodel.projection_world_sizes(max_nodes)
    networks = []
    for network in perfmodel.NETWORKS:
        points = perfmodel.project(workload, network, sizes)
        limit = perfmodel.scaling_limit(points)
        networks.append(
            {
                **dataclasses.asdict(network),
                "points": [dataclasses.asdict(p) for p in points],
                "limit": dataclasses.asdict(limit),
            }
        )
    return {
        "compute_fit": {"c0_s": fit.intercept, "c1_s_per_sample": fit.slope},
        "batch_size": batch_size,
        "per_worker": per_worker,
        "gradient_bytes": workload.gradient_bytes,
        "max_world_size": min(max_nodes, workload.max_workers()),
        "networks": networks,
    }


def run_scaling_benchmark(cfg: ScalingBenchConfig, words: Sequence[str] = ()) -> dict[str, Any]:
    """Measure every configuration in turn and build the report."""
    from ddpkit.launchers.server import worker_server
    from ddpkit.models.registry import get_model_spec
    from ddpkit.train.config import TrainConfig

    cores = len(os.sched_getaffinity(0))
    runs = configurations(cfg)
    start = time.perf_counter()
    load_before = os.getloadavg()
    rounds: list[list[dict[str, Any]]] = [[] for _ in runs]
    # One warm worker server for every local configuration: each still gets freshly forked workers.
    with worker_server():
        for round_index in range(cfg.repeats):
            for run, results in zip(runs, rounds):
                t0 = time.perf_counter()
                results.append(measure(cfg, run))
                step = results[-1]["slowest_rank"]["step"]
                print(
                    f"round {round_index + 1}: {run.name:<32} step {step * 1e3:8.3f} ms  "
                    f"({time.perf_counter() - t0:.0f}s)",
                    file=sys.stderr,
                )
    measured = [merge_rounds(results) for results in rounds]
    baseline = next((m for r, m in zip(runs, measured) if r.workers == 1), None)
    baseline_rate = baseline["global_batch"] / baseline["slowest_rank"]["step"] if baseline else None
    rows = [analyse_row(r, m, baseline_rate, cores) for r, m in zip(runs, measured)]
    spec = get_model_spec(cfg.model)
    train_cfg = parse(TrainConfig, [f"model={cfg.model}", *cfg.train], presets=dict(spec.recipe))
    return {
        "benchmark": "scaling",
        "machine": machine_info(),
        "config": dataclasses.asdict(cfg),
        "command_words": list(words),
        "workload": {
            "id": cfg.workload,
            "model": cfg.model,
            "dataset": "synthetic" if cfg.smoke else cfg.dataset,
            "batch_size": train_cfg.batch_size,
            "batch_scope": train_cfg.batch_scope,
            "optimizer": train_cfg.optimizer,
        },
        "method": {
            "breakdown": "compute-only pass (unwrapped copy of the model) for data/forward/backward/optimizer; "
            "exposed_comm = real step - compute-only step; median over steps, max over ranks",
            "comm_fit": "one all_reduce call with the run's algorithm after each compute-only step, sizes in turn, "
            "interleaved with the other passes; t(n) = alpha + beta n by least squares; slowest rank "
            "(isolated: back-to-back calls after a barrier, before training, for reference)",
            "prediction": "compute-only step + sync overhead (the run's gradient sync with a no-op all_reduce - compute-only) "
            "+ t(gradient bytes), no overlap credit; made for each round from its own measurements, "
            "median over rounds (as the measured step)",
            "projection": "compute fitted against per-worker batch; ring all_reduce 2(p-1) alpha + 2(p-1)/p n / bw; "
            "one worker per node",
        },
        "rows": rows,
        "projection": projection(rows, train_cfg.batch_scope == "per_worker", train_cfg.batch_size, cfg.max_nodes),
        "runtime_s": time.perf_counter() - start,
        # The machine may be shared: 1-minute load averages before and after the run.
        "load_average": {"before": load_before[0], "after": os.getloadavg()[0]},
    }


def result_stem(report: dict[str, Any]) -> str:
    """``scaling-<model>-<machine>-<date>[-smoke][-<tag>]``."""
    cfg = report["config"]
    name = f"scaling-{report['workload']['model']}-{machine_tag()}-{report['machine']['date'][:10]}"
    return file_stem(name, cfg["smoke"], cfg["tag"])


def main(words: list[str]) -> int:
    """``ddpkit bench scaling [key=value ...]``.

    Returns:
        The exit status, 0.

    Raises:
        ValueError: bad options, or nodes=2 where namespaces cannot be created.
        RuntimeError, ddpkit.launchers.failure.LaunchError: a worker failed.
    """
    cfg = parse_config(words)
    report = run_scaling_benchmark(cfg, words)
    paths = write_report(report, cfg.output_dir, result_stem(report), render_markdown, plot_report)
    print(render_table(report))
    print(render_projection_sentence(report))
    print(f"wrote {', '.join(str(p) for p in paths)} in {report['runtime_s']:.0f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    # torchrun -m ddpkit.bench.scaling worker JOB.json: one worker on an emulated host.
    if len(sys.argv) != 3 or sys.argv[1] != "worker":
        sys.exit("usage: python -m ddpkit.bench.scaling worker JOB.json (run `ddpkit bench scaling` instead)")
    run_configuration(json.loads(Path(sys.argv[2]).read_text()))
    from ddpkit.distributed import exit_process

    exit_process(0)
