"""The shared-memory all_reduce against torch.distributed's gloo all_reduce and exact references.

Starting processes costs more than the cases on 2 cores, so the module's
multi-process jobs run side by side in one fixture (``jobs``), forked from
one warm worker server: the correctness cases on 1, 2, 3 and 4 ranks (each
world size one job whose workers loop over every case), the failure
scenarios (on fresh groups of one 2-rank job, since a failed communicator
stays failed), two 2-rank jobs at once, and a build of the library from
source. Each test asserts its part. The jobs in which a rank dies
mid-collective run apart from those (``dying_jobs``), side by side too.
"""

from __future__ import annotations

import copy
import hashlib
import os
import queue
import signal
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from ddpkit.comm import shm
from ddpkit.comm.shm import communicator
from tests.helpers.module_runs import attempt, run_side_by_side, selected_params, selected_tests
from tests.helpers.workers import DYNAMO, warm_workers

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
]
OPS = [ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.AVG]
# Elements: empty, tiny, and either side of the one-shot limit (256 KiB) for
# 1-, 2-, 4- and 8-byte dtypes (40000: chunked for 8 bytes; 131073: chunked
# for 2 bytes and more).
SIZES = [0, 1, 3, 16, 1000, 40000, 131073]
# Several chunks with a short last one, for a few (dtype, op).
MULTI_CHUNK = 600_001
MULTI_CHUNK_CASES = [
    (torch.float32, ReduceOp.SUM),
    (torch.float32, ReduceOp.AVG),
    (torch.float32, ReduceOp.MAX),
    (torch.float16, ReduceOp.SUM),
    (torch.bfloat16, ReduceOp.AVG),
    (torch.int64, ReduceOp.SUM),
    (torch.uint8, ReduceOp.MAX),
]
LARGE_BYTES = 64 << 20

# gloo's all_reduce has no int16 and no integer AVG; where it has the op, it
# must agree with ours (exactly for integers and bool, closely for floats,
# whose summation order may differ beyond 2 ranks).
_GLOO_UNSUPPORTED_DTYPES = {torch.int16}


def _input(case: int, rank: int, numel: int, dtype: torch.dtype, op: ReduceOp) -> torch.Tensor:
    """Rank ``rank``'s input of one case, seeded by the case and the rank: any rank can recompute any other's."""
    g = torch.Generator().manual_seed(1000 + 64 * case + rank)
    if dtype is torch.bool:
        return torch.rand(numel, generator=g) < 0.5
    if dtype.is_floating_point:
        scale = 1.0 if op is ReduceOp.PRODUCT else 50.0
        return (torch.randn(numel, generator=g, dtype=torch.float64) * scale).to(dtype)
    info = torch.iinfo(dtype)
    if info.bits == 8:
        low, high = info.min, info.max + 1  # the full range: SUM and PRODUCT wrap around
    else:
        low, high = (-30, 31) if op is ReduceOp.PRODUCT else (-1000, 1001)
    return torch.randint(low, high, (numel,), generator=g, dtype=torch.int64).to(dtype)


def _reference(inputs: list[torch.Tensor], op: ReduceOp) -> torch.Tensor:
    """Combine in rank order, float16/bfloat16 in float32, integer AVG in int64 then truncated."""
    dtype, n = inputs[0].dtype, len(inputs)
    if dtype is torch.bool:
        stacked = torch.stack(inputs)
        return stacked.any(0) if op in (ReduceOp.SUM, ReduceOp.MAX) else stacked.all(0)
    if dtype in (torch.float16, torch.bfloat16):
        acc_dtype = torch.float32
    elif op is ReduceOp.AVG and not dtype.is_floating_point:
        acc_dtype = torch.int64
    else:
        acc_dtype = dtype
    combine = {
        ReduceOp.SUM: torch.add,
        ReduceOp.AVG: torch.add,
        ReduceOp.PRODUCT: torch.mul,
        ReduceOp.MIN: torch.minimum,
        ReduceOp.MAX: torch.maximum,
    }[op]
    acc = inputs[0].to(acc_dtype)
    for x in inputs[1:]:
        acc = combine(acc, x.to(acc_dtype))
    if op is ReduceOp.AVG:
        acc = acc / n if acc_dtype.is_floating_point else torch.div(acc, n, rounding_mode="trunc")
    return acc.to(dtype)


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _gloo_has(dtype: torch.dtype, op: ReduceOp) -> bool:
    return dtype not in _GLOO_UNSUPPORTED_DTYPES and (op is not ReduceOp.AVG or dtype.is_floating_point)


def _check_against_gloo(
    t: torch.Tensor, expected: torch.Tensor, inputs: list[torch.Tensor], op: ReduceOp, label: str
) -> None:
    """``t`` (ours) against ``expected`` (gloo's all_reduce of the same inputs)."""
    if not t.dtype.is_floating_point:
        assert torch.equal(t, expected), f"{label}: differs from gloo's all_reduce"
        return
    # gloo may combine in another order, and round float16/bfloat16 after
    # every step: allow a few roundings per rank of the largest partial result.
    magnitudes = torch.stack([x.double().abs() for x in inputs])
    largest = magnitudes.prod(0) if op is ReduceOp.PRODUCT else magnitudes.sum(0)
    if op in (ReduceOp.MIN, ReduceOp.MAX):
        largest = torch.zeros_like(largest)
    tolerance = 4 * len(inputs) * torch.finfo(t.dtype).eps * largest + torch.finfo(t.dtype).tiny
    error = (t.double() - expected.double()).abs()
    assert (error <= tolerance).all(), f"{label}: differs from gloo's all_reduce by {error.max()}"


def _correctness(group: dist.ProcessGroup | None) -> list[str]:
    """Every case on every rank of ``group`` (None: the world); returns the digest of each result.

    Rank 0 checks each result against the rank-order reference and gloo's
    all_reduce; every rank returns the digests of its results, which the test
    compares with rank 0's bit for bit.
    """
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    _check_rejections(group, world_size)
    comm = shm.get_communicator(group)
    assert shm.get_communicator(group) is comm, "one communicator per group"
    digests = []
    cases = [(numel, dtype, op) for numel in SIZES for dtype in DTYPES for op in OPS]
    cases += [(MULTI_CHUNK, dtype, op) for dtype, op in MULTI_CHUNK_CASES]
    for case, (numel, dtype, op) in enumerate(cases):
        label = f"case {case}: numel={numel} {dtype} {op} world_size={world_size}"
        if dtype is torch.bool and op is ReduceOp.AVG:
            with pytest.raises(ValueError, match="AVG is not defined on bool"):
                shm.all_reduce(torch.zeros(numel, dtype=torch.bool), op, group=group)
            continue
        mine = _input(case, rank, numel, dtype, op)
        t = mine.clone()
        shm.all_reduce(t, op, group=group)
        gloo = None
        # gloo is slow on 3+ ranks on 2 cores: there it checks float32 and int64.
        if _gloo_has(dtype, op) and (world_size <= 2 or dtype in (torch.float32, torch.int64)):
            gloo = mine.clone()
            dist.all_reduce(gloo, op, group=group)
        if rank == 0:
            inputs = [mine if r == 0 else _input(case, r, numel, dtype, op) for r in range(world_size)]
            assert torch.equal(t, _reference(inputs, op)), f"{label}: differs from the rank-order reference"
            if gloo is not None:
                _check_against_gloo(t, gloo, inputs, op, label)
        digests.append(_digest(t))

    # Non-contiguous inputs go through a copy, and only the view changes.
    base = torch.arange(2 * 3000, dtype=torch.float32).reshape(3000, 2) * (rank + 1)
    untouched = base[:, 1].clone()
    view = base[:, 0]
    shm.all_reduce(view, ReduceOp.SUM, group=group)
    assert torch.equal(view, torch.arange(0, 6000, 2, dtype=torch.float32) * sum(range(1, world_size + 1)))
    assert torch.equal(base[:, 1], untouched)
    transposed = torch.full((40, 70), float(rank), dtype=torch.bfloat16).t()
    shm.all_reduce(transposed, ReduceOp.MAX, group=group)
    assert torch.equal(transposed, torch.full((70, 40), float(world_size - 1), dtype=torch.bfloat16))

    # Special values: NaN propagates through MIN/MAX; float16 subnormals,
    # infinities and overflow round exactly as in float32 then float16.
    specials = torch.tensor([6e-8, -6e-8, 1e-5, 65504.0, -65504.0, float("inf"), 0.5, -0.0], dtype=torch.float16)
    inputs = [specials * (1 + r) for r in range(world_size)]
    t = inputs[rank].clone()
    shm.all_reduce(t, ReduceOp.SUM, group=group)
    assert torch.equal(t, _reference(inputs, ReduceOp.SUM))
    nan_at = torch.zeros(5)
    nan_at[rank % 5] = float("nan")
    shm.all_reduce(nan_at, ReduceOp.MAX, group=group)
    assert nan_at[: min(world_size, 5)].isnan().all() and not nan_at[world_size:].isnan().any()

    # Called from another thread (DDP runs communication hooks on the autograd thread).
    result: list[torch.Tensor] = []
    worker = threading.Thread(target=lambda: result.append(_threaded_sum(rank, group)))
    worker.start()
    worker.join()
    assert torch.equal(result[0], torch.full((100,), float(sum(range(world_size)))))

    # A large message, 64 MiB of float32 and 5 more elements (a last chunk
    # some ranks have no part of); 16 MiB on 3 ranks to keep the suite short.
    numel = (LARGE_BYTES if world_size != 3 else LARGE_BYTES // 4) // 4 + 5
    t = (torch.arange(numel, dtype=torch.int32) % 1024).float() + rank
    gloo = t.clone()
    shm.all_reduce(t, group=group)
    dist.all_reduce(gloo, group=group)
    assert torch.equal(t, gloo)
    assert torch.equal(t[:2048], (torch.arange(2048) % 1024).float() * world_size + sum(range(world_size)))
    digests.append(_digest(t))

    # Inside DDP: a communication hook, run where DDP runs it.
    digests += _train_with_ddp_hook(rank, group)
    return digests


def _threaded_sum(rank: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    t = torch.full((100,), float(rank))
    shm.all_reduce(t, group=group)
    return t


# No annotations: DDP checks them, and this module's are strings.
def _average_gradients_hook(group, bucket):
    gradients = bucket.buffer()
    shm.all_reduce(gradients, ReduceOp.AVG, group=group)
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(gradients)
    return future


def _train_with_ddp_hook(rank: int, group: dist.ProcessGroup | None) -> list[str]:
    """Trains one model with the hook, one with DDP's own gloo all_reduce: they must agree."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(784, 50), torch.nn.ReLU(), torch.nn.Linear(50, 10))
    with_gloo = DistributedDataParallel(copy.deepcopy(model), process_group=group)
    with_hook = DistributedDataParallel(model, process_group=group)
    with_hook.register_comm_hook(group, _average_gradients_hook)
    optimizers = [torch.optim.Adam(m.parameters(), lr=1e-3) for m in (with_hook, with_gloo)]
    g = torch.Generator().manual_seed(rank)
    for _ in range(5):
        x, y = torch.rand(32, 784, generator=g), torch.randint(0, 10, (32,), generator=g)
        for ddp, optimizer in zip((with_hook, with_gloo), optimizers):
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
            optimizer.step()
    for a, b in zip(with_hook.parameters(), with_gloo.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    return [_digest(p.detach()) for p in with_hook.parameters()]


def _check_rejections(group: dist.ProcessGroup | None, world_size: int) -> None:
    for bad, match in [
        (torch.zeros(4, dtype=torch.complex64), "does not handle dtype"),
        (torch.zeros(4).to_sparse(), "dense tensors"),
    ]:
        with pytest.raises(ValueError, match=match):
            shm.all_reduce(bad, group=group)
    with pytest.raises(ValueError, match="does not handle op"):
        shm.all_reduce(torch.zeros(4, dtype=torch.int32), ReduceOp.BAND, group=group)
    with pytest.raises(ValueError, match="must be a positive"):
        shm.ShmCommunicator(group, timeout=0)
    if world_size == 1:
        # Nothing to exchange: every op leaves the tensor as it is.
        t = torch.arange(5, dtype=torch.float16)
        for op in OPS:
            shm.all_reduce(t, op, group=group)
        assert torch.equal(t, torch.arange(5, dtype=torch.float16))


def _correctness_worker(rank: int, world_size: int) -> list[str]:
    return _correctness(None)


def _job_worker(rank: int, world_size: int, job: int) -> None:
    for step in range(50):
        t = torch.full((1000 + 37 * step,), float(job * 100 + rank + step))
        shm.all_reduce(t)
        expected = world_size * (job * 100 + step) + sum(range(world_size))
        assert torch.equal(t, torch.full_like(t, float(expected))), f"job {job} step {step}: got {t[0]}"
    big = torch.full((400_000,), float(job + rank))
    shm.all_reduce(big)
    assert torch.equal(big, torch.full_like(big, float(world_size * job + sum(range(world_size)))))


def _segment_path(comm: shm.ShmCommunicator) -> str:
    return "/dev/shm" + comm._name


def _failures_worker(rank: int, world_size: int) -> dict[str, str]:
    """Each scenario on a fresh subgroup, since a failed communicator stays failed."""
    seen = {}

    # The segment's name is gone as soon as every rank has mapped it.
    comm = shm.get_communicator()
    assert not os.path.exists(_segment_path(comm))

    # Ranks disagreeing on the size: both fail, naming the difference.
    group = dist.new_group([0, 1])
    with pytest.raises(RuntimeError, match="reduces") as err:
        shm.all_reduce(torch.zeros(10 + rank), group=group)
    seen["mismatch"] = str(err.value)
    with pytest.raises(RuntimeError, match="failed earlier"):
        shm.all_reduce(torch.zeros(10), group=group)

    # A rank that is alive but never arrives: the other gives up after the
    # timeout, and the late one learns that at once.
    group = dist.new_group([0, 1])
    shm.get_communicator(group, timeout=1.0)
    if rank == 0:
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"rank 1 did not arrive within 1.0 s") as err:
            shm.all_reduce(torch.zeros(10), group=group)
        seen["timeout"] = str(err.value)
        assert 0.9 < time.monotonic() - start < 10
        dist.barrier()
    else:
        dist.barrier()
        with pytest.raises(RuntimeError, match="rank 0 gave up"):
            shm.all_reduce(torch.zeros(10), group=group)

    # Ctrl-C while waiting: KeyboardInterrupt within ~50 ms, the peer is told.
    group = dist.new_group([0, 1])
    shm.get_communicator(group)
    if rank == 0:
        timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
        timer.start()
        start = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            shm.all_reduce(torch.zeros(10), group=group)
        assert time.monotonic() - start < 5
        timer.join()
        dist.barrier()
    else:
        dist.barrier()
        with pytest.raises(RuntimeError, match="rank 0 gave up"):
            shm.all_reduce(torch.zeros(10), group=group)

    # Ranks on different nodes (one rank pretends): everyone refuses, nothing is left behind.
    if rank == 1:
        communicator._node_id = lambda: ("elsewhere", "another-boot")
    with pytest.raises(ValueError, match="on one node"):
        shm.get_communicator(dist.new_group([0, 1]))
    return seen


def _build_worker(rank: int, world_size: int) -> tuple:
    """Build the library from source into $XDG_CACHE_HOME (set by the caller), load it, and say from where."""
    fingerprint = shm.build_config.source_hash(shm._lib._SOURCE)
    path, problem = shm._lib._build_cached(fingerprint)
    if path is None:
        return None, problem, fingerprint, None
    lib, problem = shm._lib._open(path)
    return str(path), problem, fingerprint, lib.ddpkit_shm_source_hash().decode() if lib is not None else None


@pytest.fixture(scope="module")
def jobs(request, tmp_path_factory) -> dict:
    """The outcome of each multi-process job the selected tests need, run side by side.

    Keys: the correctness run's world size, "failures", "job 1", "job 2", "build" (and the build's cache folder).
    """
    assert shm.is_available(), shm.unavailable_reason()
    tests = selected_tests(request)
    runs = {
        n: (_correctness_worker, n, (), {})
        for n in selected_params(request, "world_size", "test_all_reduce_matches_references_gloo_and_ddp")
    }
    if "test_failures_are_clear_errors_not_hangs" in tests:
        runs["failures"] = (_failures_worker, 2, (), {})
    if "test_two_concurrent_jobs_do_not_interfere" in tests:
        runs.update({f"job {i}": (_job_worker, 2, (i,), {}) for i in (1, 2)})
    cache = tmp_path_factory.mktemp("xdg-cache")
    if "test_builds_from_source_when_no_installed_copy_fits" in tests:
        # A compiler run of its own, beside the others: it keeps one core busy while their ranks wait on each other.
        runs["build"] = (_build_worker, 1, (), {"init_process_group": False, "environ": {"XDG_CACHE_HOME": str(cache)}})
    outcomes = run_side_by_side(runs, DYNAMO)  # 10 ranks build DDP models and optimizers: torch._dynamo imported once
    outcomes["build cache"] = cache
    return outcomes


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_all_reduce_matches_references_gloo_and_ddp(jobs, world_size):
    """All dtypes, ops and sizes; rejections; threads; a DDP hook; 64 MiB."""
    digests = jobs[world_size].get()
    assert digests[0], "no case ran"
    for rank in range(1, world_size):
        assert digests[rank] == digests[0], f"rank {rank} ended with different bits than rank 0"


@pytest.mark.slow
def test_failures_are_clear_errors_not_hangs(jobs):
    seen = jobs["failures"].get()
    assert "rank 1 reduces 11 torch.float32 elements with SUM" in seen[0]["mismatch"]
    assert "rank 0 reduces 10" in seen[1]["mismatch"]


@pytest.mark.slow
def test_two_concurrent_jobs_do_not_interfere(jobs):
    # Each rank asserts its job's sums at every step: a crossed segment fails it there.
    assert jobs["job 1"].get() == jobs["job 2"].get() == [None, None]


def test_warns_once_when_unavailable(monkeypatch):
    monkeypatch.setattr(shm, "_warned", False)
    with pytest.warns(RuntimeWarning, match="falling back to gloo") as record:
        shm.warn_unavailable_once()
        shm.warn_unavailable_once()
    assert len(record) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        shm.warn_unavailable_once()


def _dying_worker(rank: int, world_size: int, store_path: str, victim: int, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank, world_size=world_size)
    comm = shm.get_communicator(timeout=30.0)
    t = torch.ones(2 << 20)  # 8 MiB: 8 chunks, so death lands mid-collective
    if rank == victim:
        # Die from another thread while the main thread is inside the C library.
        threading.Timer(0.5, os._exit, (17,)).start()
    last_ok = time.monotonic()
    try:
        while True:
            shm.all_reduce(t)
            last_ok = time.monotonic()
    except RuntimeError as e:
        results.put((world_size, rank, str(e), time.monotonic() - last_ok, os.path.exists(_segment_path(comm))))
    results.close()
    results.join_thread()
    os._exit(0)  # skip tearing down a process group whose peer is dead


def _run_dying_jobs(world_sizes: list[int], folder) -> dict[int, tuple[dict, int | None]]:
    """One job per world size, all at once, the last rank of each dying mid-collective.

    Returns:
        For each world size: what each survivor reported, and the victim's exit code.
    """
    with warm_workers() as ctx:
        results = ctx.Queue()
        procs = {
            n: [
                ctx.Process(target=_dying_worker, args=(r, n, str(folder / f"store-{n}"), n - 1, results))
                for r in range(n)
            ]
            for n in world_sizes
        }
        for job in procs.values():
            for p in job:
                p.start()
        try:
            seen: dict[int, dict] = {n: {} for n in world_sizes}
            deadline = time.monotonic() + 120
            while sum(map(len, seen.values())) < sum(n - 1 for n in world_sizes) and time.monotonic() < deadline:
                try:
                    n, rank, message, waited, segment_left = results.get(timeout=0.2)
                except queue.Empty:
                    continue
                seen[n][rank] = (message, waited, segment_left)
        finally:
            for job in procs.values():
                for p in job:
                    p.join(30)
                    if p.is_alive():
                        p.kill()
                        p.join()
        return {n: (seen[n], procs[n][n - 1].exitcode) for n in world_sizes}


@pytest.fixture(scope="module")
def dying_jobs(request, tmp_path_factory):
    """For each selected world size: what each survivor reported, and the victim's exit code."""
    sizes = selected_params(request, "world_size", "test_rank_dying_mid_collective_fails_the_others_fast")
    return attempt(_run_dying_jobs, sizes, tmp_path_factory.mktemp("dying"))


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_rank_dying_mid_collective_fails_the_others_fast(dying_jobs, world_size):
    seen, victim_exitcode = dying_jobs.get()[world_size]
    victim = world_size - 1
    assert len(seen) == world_size - 1, f"survivors did not all report: {seen}"
    for rank, (message, waited, segment_left) in seen.items():
        # The victim's own error, or (with 3 ranks) a survivor that gave up first.
        assert f"rank {victim} exited during the collective" in message or "gave up" in message, message
        assert waited < 5.0, f"rank {rank} took {waited:.1f} s to notice (timeout was 30 s)"
        assert not segment_left
    assert victim_exitcode == 17


def test_abandoned_segments_are_swept():
    lib = shm._lib.load().lib
    assert lib is not None, shm.unavailable_reason()
    prefix = f"/dev/shm/{communicator._SEGMENT_PREFIX}-{os.getuid()}-"
    old, young = prefix + "test-old-" + os.urandom(4).hex(), prefix + "test-young-" + os.urandom(4).hex()
    try:
        for path in (old, young):
            with open(path, "wb") as f:
                f.write(b"\0" * 4096)
        past = time.time() - 3600
        os.utime(old, (past, past))
        communicator._remove_abandoned_segments(lib)
        assert not os.path.exists(old), "an hour-old segment nobody holds should be removed"
        assert os.path.exists(young), "a segment that may be being set up must stay"
    finally:
        for path in (old, young):
            if os.path.exists(path):
                os.unlink(path)


@pytest.mark.slow
def test_builds_from_source_when_no_installed_copy_fits(jobs):
    [(path, problem, fingerprint, built_hash)] = jobs["build"].get()
    assert path is not None, problem
    assert Path(path).parent == jobs["build cache"] / "ddpkit" / "shm"
    assert built_hash is not None, problem
    assert built_hash == fingerprint
