"""``ddpkit bench comm``: every collective and algorithm over a size sweep, and ping-pong.

In the style of nccl-tests and the OSU micro-benchmarks. For each op, each of
its algorithms (the built-in ``torch.distributed`` one included, as the
baseline) and each message size from ``min_bytes`` to ``max_bytes`` (4 B to
64 MiB, x2 steps by default), it reports the slowest rank's time (median, min,
max), the algorithm and bus bandwidths, and the time relative to the built-in
measured in the same run. ``pingpong`` measures point-to-point latency and
bandwidth between rank 0 and every other rank, so a job across nodes shows
same-node and other-node peers side by side::

    ddpkit bench comm                                   # 2 local workers, everything
    ddpkit bench comm nproc=4 ops=[all_reduce] algorithms=[builtin,ring,shm]
    ddpkit bench comm smoke=true output_dir=/tmp/out    # seconds: a check that it works
    ddpkit bench comm device=cuda nproc=2               # CUDA tensors over nccl, one GPU per worker
    torchrun --nproc-per-node 2 -m ddpkit bench comm    # one worker of a launched job
    srun -N2 -n4 python -m ddpkit bench comm            # same for srun / mpirun, across nodes

Started by torchrun, srun or mpirun, each process is one worker of that job;
otherwise ``nproc`` local workers are started (torch's elastic agent). Rank 0
prints the table as it goes and writes ``<output_dir>/comm-<machine>-<N>r-<date>``
``.json``, ``.md`` and ``.png`` (rendered by :mod:`ddpkit.bench.comm_report`).

Sizes (as in nccl-tests)
    A size is the bytes of the whole buffer: the tensor of all_reduce, reduce
    and broadcast; the gathered output of all_gather and gather; the input of
    reduce_scatter and scatter; one rank's send buffer of all_to_all. Ops
    that split their buffer into ``world_size`` pieces round the element count
    down to a multiple of ``world_size`` (at least one element per rank), and
    the report gives the bytes actually moved.

Bandwidths (nccl-tests' formulas, GB = 1e9 bytes)
    ``algbw = bytes / time``; ``busbw = algbw * factor`` with factor
    ``2(n-1)/n`` for all_reduce, ``(n-1)/n`` for all_gather, reduce_scatter,
    all_to_all, gather and scatter, and 1 for broadcast and reduce. busbw is
    comparable across ops and world sizes: it is the rate at which the
    busiest link moves bytes, to compare with the hardware's peak.

How time is measured
    Warm up (``warmup`` calls, timed to estimate one call), agree on a batch
    size (``iterations`` calls, or enough for ``target_seconds`` over all
    batches), then ``repeats`` timed batches. Each batch starts after a
    barrier and times ``iterations`` back-to-back calls on every rank; a
    sample is the batch time / ``iterations``. Batches rather than one call
    between barriers: a barrier over TCP releases the ranks up to one
    message latency apart (tens of microseconds), a skew that would be
    counted in every call and is larger than a shared-memory all_reduce
    takes; over a batch it is spread thin, as in nccl-tests and OSU. Nothing but the measured op runs inside the timed
    region: after the batches, the ranks exchange their samples (one
    all_gather) and each sample's slowest rank is kept; median, min and max
    are taken over those. The batches of a size's algorithms are interleaved
    (batch 1 of each algorithm, then batch 2, ...), so that a burst of load
    from elsewhere on a shared machine hits every algorithm alike and the
    ratios hold.

Ping-pong (OSU's osu_latency)
    Rank 0 sends a message to the peer and waits for it to come back, in
    batches of ``iterations`` round trips; latency is half the round trip,
    bandwidth is bytes / latency. Peers take turns; the other ranks wait at a
    barrier. ``dist.send``/``dist.recv`` over the process group (gloo).

Devices
    ``device=cpu`` (the default) measures CPU tensors over gloo;
    ``device=cuda`` measures tensors on each worker's GPU over nccl (one GPU
    per worker), waiting for the GPU before every clock reading. The
    shared-memory algorithms (shm, hierarchical) take CPU tensors only and
    are left out there. The benchmark's own bookkeeping (agreeing on batch
    sizes, gathering the samples) uses the device the group takes
    (:func:`ddpkit.distributed.control_device`).

Targets (from the same run, as ratios of medians): T3, shm all_reduce at
least 5x faster than the built-in at every size 4 B..32 MiB (2 ranks,
float32); T4, ring all_reduce at most 1.5x the built-in's time from 1 MiB.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from ddpkit.bench.comm_report import TerminalTable, plot_report, render_markdown, render_targets
from ddpkit.bench.comm_spec import (
    BENCHMARKED_COLLECTIVES,
    BUILTIN,
    PINGPONG,
    TARGET_T3,
    TARGET_T4,
    CommBenchConfig,
    median_times,
)
from ddpkit.bench.report import file_stem, write_report
from ddpkit.bench.system import machine_info, machine_tag, summarize
from ddpkit.errors import UserError
from ddpkit.keyvalue import parse

_SPLIT_OPS = frozenset(BENCHMARKED_COLLECTIVES) - {"all_reduce", "reduce", "broadcast"}
"""Ops whose buffer is cut into ``world_size`` equal pieces."""

SMOKE_PRESETS = {"max_bytes": 64 << 10, "step_factor": 4, "warmup": 1, "iterations": 2, "repeats": 2}
"""What ``smoke=true`` changes; words on the command line still win."""

MAX_ITERATIONS = 100_000
"""Upper bound on calls per batch, however fast a call is."""

CPU_ONLY_ALGORITHMS = ("shm", "hierarchical")
"""Algorithms that take CPU tensors only (shared memory)."""


def parse_config(words: Sequence[str]) -> CommBenchConfig:
    """The configuration from ``key=value`` words, with the smoke presets under ``smoke=true``.

    Raises:
        ConfigError: unknown key or invalid value.
    """
    smoke = parse(CommBenchConfig, words).smoke
    return parse(CommBenchConfig, words, presets=SMOKE_PRESETS if smoke else None)


# --- formulas -------------------------------------------------------------------------------


def bus_factor(op: str, world_size: int) -> float:
    """nccl-tests' factor from algorithm to bus bandwidth for ``op`` on ``world_size`` ranks.

    Args:
        op: a collective name (``all_reduce``, ``all_gather_into_tensor``, ...).
        world_size: number of ranks.

    Returns:
        ``2(n-1)/n`` for all_reduce, 1 for broadcast and reduce, ``(n-1)/n`` otherwise.
    """
    n = world_size
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("broadcast", "reduce"):
        return 1.0
    return (n - 1) / n


def algbw(num_bytes: int, seconds: float) -> float:
    """Algorithm bandwidth in GB/s (1e9 bytes per second): ``bytes / time``."""
    return num_bytes / seconds / 1e9


def busbw(op: str, num_bytes: int, seconds: float, world_size: int) -> float:
    """Bus bandwidth in GB/s: :func:`algbw` times :func:`bus_factor`."""
    return algbw(num_bytes, seconds) * bus_factor(op, world_size)


def sweep_sizes(min_bytes: int, max_bytes: int, step_factor: int) -> list[int]:
    """Message sizes ``min_bytes * step_factor**k`` up to ``max_bytes``.

    Returns:
        The sizes in bytes, ascending.
    """
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= step_factor
    return sizes


def message_count(op: str, num_bytes: int, world_size: int, element_size: int) -> int:
    """Elements in the buffer of ``op`` for a message of about ``num_bytes`` (see "Sizes" above).

    Returns:
        ``num_bytes // element_size``, at least 1; for ops that split the
        buffer among ranks, rounded down to a multiple of ``world_size``, at
        least ``world_size``.
    """
    count = max(1, num_bytes // element_size)
    if op in _SPLIT_OPS:
        count = max(world_size, count // world_size * world_size)
    return count


def iterations_for(seconds_per_call: float, target_seconds: float, repeats: int) -> int:
    """Calls per batch so that ``repeats`` batches take about ``target_seconds`` (1 to :data:`MAX_ITERATIONS`)."""
    if seconds_per_call <= 0:
        return MAX_ITERATIONS
    return int(min(MAX_ITERATIONS, max(1, round(target_seconds / (repeats * seconds_per_call)))))


# --- running in the workers -----------------------------------------------------------------


def _make_call(
    op: str, fn: Callable[..., object], count: int, rank: int, world_size: int, dtype: Any, device: Any = "cpu"
) -> Callable[[], object]:
    """Allocate ``op``'s buffers once (on ``device``) and return a call of ``fn`` on them."""
    import torch

    def zeros(numel: int) -> torch.Tensor:
        # Zeros stay zeros under repeated SUM: no overflow to inf, no denormals.
        return torch.zeros(numel, dtype=dtype, device=device)

    piece = count // world_size
    if op == "all_reduce":
        tensor = zeros(count)
        return lambda: fn(tensor)
    if op in ("reduce", "broadcast"):
        tensor = zeros(count)
        return lambda: fn(tensor, 0)
    if op == "all_gather":
        mine, outputs = zeros(piece), [zeros(piece) for _ in range(world_size)]
        return lambda: fn(outputs, mine)
    if op == "all_gather_into_tensor":
        mine, output = zeros(piece), zeros(count)
        return lambda: fn(output, mine)
    if op == "reduce_scatter":
        inputs, output = [zeros(piece) for _ in range(world_size)], zeros(piece)
        return lambda: fn(output, inputs)
    if op == "reduce_scatter_tensor":
        source, output = zeros(count), zeros(piece)
        return lambda: fn(output, source)
    if op == "all_to_all":
        inputs, outputs = [zeros(piece) for _ in range(world_size)], [zeros(piece) for _ in range(world_size)]
        return lambda: fn(outputs, inputs)
    if op == "all_to_all_single":
        source, output = zeros(count), zeros(count)
        return lambda: fn(output, source)
    if op in ("gather", "scatter"):
        mine = zeros(piece)
        pieces = [zeros(piece) for _ in range(world_size)] if rank == 0 else None
        return lambda: fn(mine, pieces, 0)
    raise AssertionError(f"no buffers for op {op!r}")


def _max_over_ranks(value: float) -> float:
    import torch
    import torch.distributed as dist

    from ddpkit.distributed import control_device

    tensor = torch.tensor([value], dtype=torch.float64, device=control_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())


def _synchronize(cfg: CommBenchConfig) -> None:
    """Wait for the work queued on this worker's GPU (CUDA collectives return before they finish)."""
    if cfg.device == "cuda":
        import torch

        torch.cuda.synchronize()


def _warm_up(call: Callable[[], object], cfg: CommBenchConfig) -> int:
    """Run the warm-up calls; return the calls per batch, the same on every rank."""
    times = []
    for _ in range(cfg.warmup):
        start = time.perf_counter()
        call()
        _synchronize(cfg)
        times.append(time.perf_counter() - start)
    # The median skips a first call that set something up (the shm segment, a connection).
    estimate = _max_over_ranks(statistics.median(times))
    return cfg.iterations or iterations_for(estimate, cfg.target_seconds, cfg.repeats)


def _time_batch(call: Callable[[], object], iterations: int, cfg: CommBenchConfig) -> float:
    import torch.distributed as dist

    dist.barrier()
    _synchronize(cfg)
    start = time.perf_counter()
    for _ in range(iterations):
        call()
    _synchronize(cfg)
    return (time.perf_counter() - start) / iterations


def _slowest_rank(samples: list[float]) -> tuple[list[float], list[float]]:
    """Per sample, the slowest rank's time; and each rank's median. A collective: every rank calls it."""
    import torch
    import torch.distributed as dist

    from ddpkit.distributed import control_device

    mine = torch.tensor(samples, dtype=torch.float64, device=control_device())
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    slowest = torch.stack(every).max(dim=0).values.tolist()
    return slowest, [statistics.median(t.tolist()) for t in every]


def _collective_row(
    op: str,
    algorithm: str,
    count: int,
    element_size: int,
    world_size: int,
    iterations: int,
    slowest: list[float],
    rank_medians: list[float],
) -> dict[str, Any]:
    num_bytes = count * element_size
    time_us = summarize([s * 1e6 for s in slowest])
    seconds = time_us["median"] / 1e6
    return {
        "op": op,
        "algorithm": algorithm,
        "bytes": num_bytes,
        "count": count,
        "iterations": iterations,
        "repeats": len(slowest),
        "time_us": time_us,
        "rank_median_us": [t * 1e6 for t in rank_medians],
        "algbw_gbps": algbw(num_bytes, seconds),
        "busbw_gbps": busbw(op, num_bytes, seconds, world_size),
        "bus_factor": bus_factor(op, world_size),
    }


def _sweep_collective(
    op: str, algorithms: list[str], cfg: CommBenchConfig, rank: int, world_size: int, table: TerminalTable
) -> list[dict[str, Any]]:
    """Measure ``op`` with each algorithm at each size; every rank calls this in the same order."""
    import torch

    from ddpkit.comm import resolve

    dtype = getattr(torch, cfg.dtype)
    element_size = torch.empty((), dtype=dtype).element_size()
    device = _message_device(cfg)
    functions = {name: resolve(op, name) for name in algorithms}
    rows, seen = [], set()
    table.header(op, world_size)
    for size in sweep_sizes(cfg.min_bytes, cfg.max_bytes, cfg.step_factor):
        count = message_count(op, size, world_size, element_size)
        if count in seen:  # small sizes of split ops round up to the same buffer
            continue
        seen.add(count)
        calls = {name: _make_call(op, fn, count, rank, world_size, dtype, device) for name, fn in functions.items()}
        iterations = {name: _warm_up(call, cfg) for name, call in calls.items()}
        samples: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(cfg.repeats):
            for name, call in calls.items():
                samples[name].append(_time_batch(call, iterations[name], cfg))
        size_rows = []
        for name in calls:
            slowest, rank_medians = _slowest_rank(samples[name])
            size_rows.append(
                _collective_row(op, name, count, element_size, world_size, iterations[name], slowest, rank_medians)
            )
        _add_ratios(size_rows)
        for row in size_rows:
            table.collective_row(row)
        rows += size_rows
        del calls  # free this size's buffers before the next, larger one
    return rows


def _add_ratios(size_rows: list[dict[str, Any]]) -> None:
    builtin = next((r for r in size_rows if r["algorithm"] == BUILTIN), None)
    for row in size_rows:
        row["vs_builtin"] = row["time_us"]["median"] / builtin["time_us"]["median"] if builtin else None


def _pingpong_point(peer: int, rank: int, count: int, dtype: Any, cfg: CommBenchConfig) -> tuple[list[float], int]:
    """Half round trips between rank 0 and ``peer`` (samples in seconds, on rank 0) and the batch size."""
    import torch
    import torch.distributed as dist

    from ddpkit.distributed import control_device

    message = torch.zeros(count, dtype=dtype, device=_message_device(cfg))
    other = peer if rank == 0 else 0

    def round_trip() -> None:
        if rank == 0:
            dist.send(message, other)
            dist.recv(message, other)
        else:
            dist.recv(message, other)
            dist.send(message, other)

    times = []
    for _ in range(cfg.warmup):
        start = time.perf_counter()
        round_trip()
        _synchronize(cfg)
        times.append(time.perf_counter() - start)
    # Rank 0 times the round trips, so it chooses the batch size and tells the peer.
    agreed = torch.tensor(
        [cfg.iterations or iterations_for(statistics.median(times), cfg.target_seconds, cfg.repeats)],
        dtype=torch.int64,
        device=control_device(),
    )
    if rank == 0:
        dist.send(agreed, other)
    else:
        dist.recv(agreed, other)
    iterations = int(agreed.item())
    samples = []
    for _ in range(cfg.repeats):
        start = time.perf_counter()
        for _ in range(iterations):
            round_trip()
        _synchronize(cfg)
        samples.append((time.perf_counter() - start) / (2 * iterations))
    return samples, iterations


def _message_device(cfg: CommBenchConfig) -> Any:
    """The device of the measured messages: the CPU, or this worker's GPU (bound by ``ddpkit.init``)."""
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if cfg.device == "cuda" else torch.device("cpu")


def _sweep_pingpong(
    cfg: CommBenchConfig, rank: int, world_size: int, nodes: list[dict[str, Any]], table: TerminalTable
) -> list[dict[str, Any]]:
    """Ping-pong between rank 0 and each other rank in turn; every rank calls this."""
    import torch
    import torch.distributed as dist

    dtype = getattr(torch, cfg.dtype)
    element_size = torch.empty((), dtype=dtype).element_size()
    rows = []
    if world_size > 1:
        table.pingpong_header()
    for peer in range(1, world_size):
        seen = set()
        for size in sweep_sizes(cfg.min_bytes, cfg.max_bytes, cfg.step_factor):
            count = max(1, size // element_size)
            if count in seen:
                continue
            seen.add(count)
            if rank not in (0, peer):
                continue
            samples, iterations = _pingpong_point(peer, rank, count, dtype, cfg)
            if rank == 0:
                latency = summarize([s * 1e6 for s in samples])
                row = {
                    "peer": peer,
                    "peer_host": nodes[peer]["host"],
                    "peer_node_rank": nodes[peer]["node_rank"],
                    "same_node": nodes[peer]["node_rank"] == nodes[0]["node_rank"],
                    "bytes": count * element_size,
                    "count": count,
                    "iterations": iterations,
                    "repeats": len(samples),
                    "latency_us": latency,
                    "bandwidth_gbps": count * element_size / (latency["median"] / 1e6) / 1e9,
                }
                table.pingpong_row(row)
                rows.append(row)
        dist.barrier()  # the other ranks wait here while this peer's sweep runs
    return rows


def plan_algorithms(cfg: CommBenchConfig, num_nodes: int) -> tuple[dict[str, list[str]], dict[str, str]]:
    """Which algorithms to run for each collective in ``cfg.ops``, and those skipped with the reason.

    The built-in runs first: the other algorithms' ratios are relative to it.

    Args:
        cfg: the benchmark's options.
        num_nodes: nodes the job spans (``shm`` needs one).

    Returns:
        ``({op: [algorithm, ...]}, {"op/algorithm": reason})``.

    Raises:
        ValueError: an algorithm named in ``cfg.algorithms`` exists for none of
            the ops, an op has none of them, or ``shm`` was named where it cannot
            run (across nodes, or with ``device=cuda``).
    """
    from ddpkit.comm import COLLECTIVES, available_allreduce_algorithms, resolve

    collectives = [op for op in cfg.ops if op != PINGPONG]
    known = {name for op in collectives for name in COLLECTIVES[op]}
    for name in cfg.algorithms:
        if name not in known:
            raise UserError(
                f"algorithms: {name!r} is not an algorithm of {', '.join(collectives) or 'any op'}; "
                f"choose among: {', '.join(sorted(known))}"
            )
    plan, skipped = {}, {}
    for op in collectives:
        names = [n for n in COLLECTIVES[op] if not cfg.algorithms or n in cfg.algorithms]
        if cfg.device != "cpu":
            for name in [n for n in names if n in CPU_ONLY_ALGORITHMS]:
                if cfg.algorithms:
                    raise UserError(
                        f"algorithms: {name} takes CPU tensors but device={cfg.device}; leave {name} out "
                        "or use device=cpu"
                    )
                names.remove(name)
                skipped[f"{op}/{name}"] = f"takes CPU tensors (device={cfg.device})"
        if "shm" in names:
            if num_nodes > 1:
                if cfg.algorithms:
                    raise UserError(
                        f"algorithms: shm needs every rank on one node, but this job spans {num_nodes}; leave shm out"
                    )
                names.remove("shm")
                skipped[f"{op}/shm"] = f"the job spans {num_nodes} nodes"
            elif "shm" not in available_allreduce_algorithms():
                if cfg.algorithms:
                    resolve(op, "shm")  # raises with the reason and the alternatives
                names.remove("shm")
                skipped[f"{op}/shm"] = _shm_reason()
        if not names:
            raise UserError(
                f"algorithms={cfg.algorithms} names none of {op}'s algorithms "
                f"({', '.join(COLLECTIVES[op])}); add one or drop {op} from ops"
            )
        plan[op] = sorted(names, key=lambda n: n != BUILTIN)
    return plan, skipped


def _shm_reason() -> str:
    try:
        from ddpkit.comm import shm
    except ImportError as e:
        return f"ddpkit.comm.shm cannot be imported ({e})"
    return shm.unavailable_reason() or "unavailable"


def run_worker(cfg: CommBenchConfig, words: Sequence[str] = (), launcher: str = "") -> dict[str, Any] | None:
    """Run the benchmark as one worker of the job this process belongs to.

    Every rank measures; rank 0 prints the table and writes the results.

    Args:
        cfg: the benchmark's options.
        words: the command's words, stored in the report.
        launcher: what started the workers, for the report; empty: the
            detected environment's source (torchrun, slurm, openmpi, ...).

    Returns:
        The report on rank 0, None on the other ranks.

    Raises:
        ValueError: the algorithms asked for cannot run in this job.
    """
    import torch.distributed as dist

    from ddpkit import distributed
    from ddpkit.log import setup_logging

    # CPU tensors over gloo; CUDA tensors over nccl (backend auto on a CUDA device).
    ctx = distributed.init(backend="gloo" if cfg.device == "cpu" else "auto", device=cfg.device, timeout=cfg.timeout)
    try:
        log = setup_logging(ctx.rank, ctx.world_size)
        nodes: list[Any] = [None] * ctx.world_size
        dist.all_gather_object(nodes, {"host": socket.gethostname(), "node_rank": ctx.node_rank})
        num_nodes = len({node["node_rank"] for node in nodes})
        plan, skipped = plan_algorithms(cfg, num_nodes)
        log.info(
            f"{ctx.env.source}: world_size {ctx.world_size} on {num_nodes} node(s); "
            + "; ".join(f"{op}: {', '.join(names)}" for op, names in plan.items())
            + "".join(f"; skipped {key} ({reason})" for key, reason in skipped.items())
        )
        log.info("config: " + " ".join(f"{k}={v}" for k, v in dataclasses.asdict(cfg).items()))
        table = TerminalTable(cfg, enabled=ctx.rank == 0)
        start = time.perf_counter()
        collectives, pingpong = [], []
        for op in cfg.ops:
            if op == PINGPONG:
                pingpong += _sweep_pingpong(cfg, ctx.rank, ctx.world_size, nodes, table)
            else:
                collectives += _sweep_collective(op, plan[op], cfg, ctx.rank, ctx.world_size, table)
        runtime = time.perf_counter() - start
        if ctx.rank != 0:
            return None
        report = {
            "benchmark": "comm",
            "machine": machine_info(),
            "config": dataclasses.asdict(cfg),
            "command_words": list(words),
            "launcher": launcher or ctx.env.source,
            "world_size": ctx.world_size,
            "num_nodes": num_nodes,
            "nodes": nodes,
            "dtype": cfg.dtype,
            "timing": (
                "slowest rank per batch of back-to-back calls (a barrier before each batch), "
                "per call; median/min/max over the batches"
            ),
            "algorithms": plan,
            "skipped": skipped,
            "collectives": collectives,
            "pingpong": pingpong,
            "targets": target_ratios(collectives, ctx.world_size, cfg.dtype),
            "runtime_s": runtime,
        }
        paths = write_report(report, cfg.output_dir, result_stem(report), render_markdown, plot_report)
        if report["targets"]:
            print(render_targets(report), flush=True)
        print(f"wrote {', '.join(str(p) for p in paths)} in {runtime:.0f}s", file=sys.stderr)
        return report
    finally:
        distributed.shutdown()


# --- the targets -----------------------------------------------------------------------------


def target_ratios(collectives: list[dict[str, Any]], world_size: int, dtype: str) -> dict[str, Any]:
    """T3 and T4 from the all_reduce rows of one run, as ratios of median times.

    Args:
        collectives: the report's collective rows.
        world_size: ranks in the run.
        dtype: element type of the run.

    Returns:
        ``{"T3": {...}, "T4": {...}}``, each with the per-size ratios, the
        worst one, the sizes covered and whether the target is met; or a
        ``"not_applicable"`` reason. Empty when the built-in all_reduce was
        not measured.
    """
    builtin = median_times(collectives, "all_reduce", BUILTIN)
    targets: dict[str, Any] = {}
    if not builtin:
        return targets  # both targets compare all_reduce algorithms with the built-in
    shm = median_times(collectives, "all_reduce", TARGET_T3["algorithm"])
    if world_size != TARGET_T3["world_size"] or dtype != "float32":
        targets["T3"] = {"not_applicable": f"T3 is stated for 2 ranks and float32 (this run: {world_size}, {dtype})"}
    elif not shm:
        targets["T3"] = {"not_applicable": "needs all_reduce with both builtin and shm"}
    else:
        sizes = [s for s in sorted(shm) if s in builtin and TARGET_T3["min_bytes"] <= s <= TARGET_T3["max_bytes"]]
        speedups = {s: builtin[s] / shm[s] for s in sizes}
        worst = min(speedups, key=lambda s: speedups[s]) if speedups else None
        targets["T3"] = {
            "what": "builtin time / shm time, all_reduce, every size 4 B..32 MiB",
            "target": f">= {TARGET_T3['min_speedup']}",
            "per_size": {str(s): v for s, v in speedups.items()},
            "worst": speedups[worst] if worst is not None else None,
            "worst_bytes": worst,
            "sizes": [min(sizes), max(sizes)] if sizes else [],
            "covers_range": bool(sizes) and min(sizes) <= 4 and max(sizes) >= TARGET_T3["max_bytes"],
            "met": bool(speedups) and min(speedups.values()) >= TARGET_T3["min_speedup"],
        }
    ring = median_times(collectives, "all_reduce", TARGET_T4["algorithm"])
    if not ring:
        targets["T4"] = {"not_applicable": "needs all_reduce with both builtin and ring"}
    else:
        sizes = [s for s in sorted(ring) if s in builtin and s >= TARGET_T4["min_bytes"]]
        ratios = {s: ring[s] / builtin[s] for s in sizes}
        worst = max(ratios, key=lambda s: ratios[s]) if ratios else None
        targets["T4"] = {
            "what": "ring time / builtin time, all_reduce, sizes >= 1 MiB",
            "target": f"<= {TARGET_T4['max_ratio']}",
            "per_size": {str(s): v for s, v in ratios.items()},
            "worst": ratios[worst] if worst is not None else None,
            "worst_bytes": worst,
            "sizes": [min(sizes), max(sizes)] if sizes else [],
            "met": bool(ratios) and max(ratios.values()) <= TARGET_T4["max_ratio"],
        }
    return targets


def result_stem(report: dict[str, Any]) -> str:
    """``comm-<machine>-<N>r-<date>[-smoke][-<tag>]``: the result files' name without extension."""
    cfg = report["config"]
    name = f"comm-{machine_tag()}-{report['world_size']}r-{report['machine']['date'][:10]}"
    return file_stem(name, cfg["smoke"], cfg["tag"])


def main(words: list[str]) -> int:
    """``ddpkit bench comm [key=value ...]``: run here as one worker of a launched job, or start ``nproc`` workers.

    Args:
        words: ``key=value`` words and YAML files (see :class:`CommBenchConfig`).

    Returns:
        The exit status, 0.

    Raises:
        ValueError: bad options (unknown key or value, an algorithm that cannot run here).
        ddpkit.launchers.failure.LaunchError: a local worker failed.
    """
    from ddpkit.env.detect import detect_environment
    from ddpkit.launchers.local import LaunchSpec, launch_local

    cfg = parse_config(words)
    if detect_environment(os.environ).source != "local":
        run_worker(cfg, words)  # started by torchrun, srun or mpirun: this process is one worker
    elif cfg.nproc == 1:
        run_worker(cfg, words, launcher="ddpkit (nproc=1, in this process)")
    else:
        plan_algorithms(cfg, num_nodes=1)  # a bad name fails here, before any worker starts
        launch_local(LaunchSpec(cfg.nproc), run_worker, cfg, list(words), f"ddpkit (nproc={cfg.nproc})")
    return 0
