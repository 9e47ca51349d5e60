"""The shared-memory all_reduce against torch.distributed's gloo all_reduce and exact references.

Process starts are costly on 2 cores, so each world size is spawned once and
loops over its cases inside the workers; failure scenarios share one spawn
by using fresh subgroups (a failed communicator stays failed).
"""

from __future__ import annotations

import copy
import hashlib
import multiprocessing as mp
import os
import queue
import signal
import threading
import time
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from ddpkit.comm import shm
from ddpkit.comm.shm import communicator
from tests.helpers.workers import run_on_ranks

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


def _inputs(case: int, world_size: int, numel: int, dtype: torch.dtype, op: ReduceOp) -> list[torch.Tensor]:
    """Every rank's input of one case, the same on every rank (seeded by the case)."""
    g = torch.Generator().manual_seed(1000 + case)
    if dtype is torch.bool:
        return [torch.rand(numel, generator=g) < 0.5 for _ in range(world_size)]
    if dtype.is_floating_point:
        scale = 1.0 if op is ReduceOp.PRODUCT else 50.0
        return [(torch.randn(numel, generator=g, dtype=torch.float64) * scale).to(dtype) for _ in range(world_size)]
    info = torch.iinfo(dtype)
    if info.bits == 8:
        low, high = info.min, info.max + 1  # the full range: SUM and PRODUCT wrap around
    else:
        low, high = (-30, 31) if op is ReduceOp.PRODUCT else (-1000, 1001)
    return [torch.randint(low, high, (numel,), generator=g, dtype=torch.int64).to(dtype) for _ in range(world_size)]


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


def _check_against_gloo(t: torch.Tensor, inputs: list[torch.Tensor], rank: int, op: ReduceOp, label: str) -> None:
    if t.dtype in _GLOO_UNSUPPORTED_DTYPES or (op is ReduceOp.AVG and not t.dtype.is_floating_point):
        return
    expected = inputs[rank].clone()
    dist.all_reduce(expected, op)
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


def _correctness_worker(rank: int, world_size: int) -> list[str]:
    """Every case on every rank; returns the digest of each result (must match across ranks)."""
    _check_rejections(world_size)
    comm = shm.get_communicator()
    assert shm.get_communicator() is comm, "one communicator per group"
    digests = []
    cases = [(numel, dtype, op) for numel in SIZES for dtype in DTYPES for op in OPS]
    cases += [(MULTI_CHUNK, dtype, op) for dtype, op in MULTI_CHUNK_CASES]
    for case, (numel, dtype, op) in enumerate(cases):
        label = f"case {case}: numel={numel} {dtype} {op} world_size={world_size}"
        if dtype is torch.bool and op is ReduceOp.AVG:
            with pytest.raises(ValueError, match="AVG is not defined on bool"):
                shm.all_reduce(torch.zeros(numel, dtype=torch.bool), op)
            continue
        inputs = _inputs(case, world_size, numel, dtype, op)
        t = inputs[rank].clone()
        shm.all_reduce(t, op)
        expected = _reference(inputs, op)
        assert torch.equal(t, expected), f"{label}: differs from the rank-order reference"
        if world_size <= 2 or dtype in (torch.float32, torch.int64):  # gloo is slow on 3+ ranks on 2 cores
            _check_against_gloo(t, inputs, rank, op, label)
        digests.append(_digest(t))

    # Non-contiguous inputs go through a copy, and only the view changes.
    base = torch.arange(2 * 3000, dtype=torch.float32).reshape(3000, 2) * (rank + 1)
    untouched = base[:, 1].clone()
    view = base[:, 0]
    shm.all_reduce(view, ReduceOp.SUM)
    assert torch.equal(view, torch.arange(0, 6000, 2, dtype=torch.float32) * sum(range(1, world_size + 1)))
    assert torch.equal(base[:, 1], untouched)
    transposed = torch.full((40, 70), float(rank), dtype=torch.bfloat16).t()
    shm.all_reduce(transposed, ReduceOp.MAX)
    assert torch.equal(transposed, torch.full((70, 40), float(world_size - 1), dtype=torch.bfloat16))

    # Special values: NaN propagates through MIN/MAX; float16 subnormals,
    # infinities and overflow round exactly as in float32 then float16.
    specials = torch.tensor([6e-8, -6e-8, 1e-5, 65504.0, -65504.0, float("inf"), 0.5, -0.0], dtype=torch.float16)
    inputs = [specials * (1 + r) for r in range(world_size)]
    t = inputs[rank].clone()
    shm.all_reduce(t, ReduceOp.SUM)
    assert torch.equal(t, _reference(inputs, ReduceOp.SUM))
    nan_at = torch.zeros(5)
    nan_at[rank % 5] = float("nan")
    shm.all_reduce(nan_at, ReduceOp.MAX)
    assert nan_at[: min(world_size, 5)].isnan().all() and not nan_at[world_size:].isnan().any()

    # Called from another thread (DDP runs communication hooks on the autograd thread).
    result: list[torch.Tensor] = []
    worker = threading.Thread(target=lambda: result.append(_threaded_sum(rank)))
    worker.start()
    worker.join()
    assert torch.equal(result[0], torch.full((100,), float(sum(range(world_size)))))

    # A large message, 64 MiB of float32 and 5 more elements (a last chunk
    # some ranks have no part of); 16 MiB on 3 ranks to keep the suite short.
    numel = (LARGE_BYTES if world_size != 3 else LARGE_BYTES // 4) // 4 + 5
    t = (torch.arange(numel, dtype=torch.int32) % 1024).float() + rank
    gloo = t.clone()
    shm.all_reduce(t)
    dist.all_reduce(gloo)
    assert torch.equal(t, gloo)
    assert torch.equal(t[:2048], (torch.arange(2048) % 1024).float() * world_size + sum(range(world_size)))
    digests.append(_digest(t))

    # Inside DDP: a communication hook, run where DDP runs it.
    digests += _train_with_ddp_hook(rank)
    return digests


def _threaded_sum(rank: int) -> torch.Tensor:
    t = torch.full((100,), float(rank))
    shm.all_reduce(t)
    return t


# No annotations: DDP checks them, and this module's are strings.
def _average_gradients_hook(state, bucket):
    gradients = bucket.buffer()
    shm.all_reduce(gradients, ReduceOp.AVG)
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(gradients)
    return future


def _train_with_ddp_hook(rank: int) -> list[str]:
    """Trains one model with the hook, one with DDP's own gloo all_reduce: they must agree."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(784, 50), torch.nn.ReLU(), torch.nn.Linear(50, 10))
    with_gloo = DistributedDataParallel(copy.deepcopy(model))
    with_hook = DistributedDataParallel(model)
    with_hook.register_comm_hook(None, _average_gradients_hook)
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


def _check_rejections(world_size: int) -> None:
    for bad, match in [
        (torch.zeros(4, dtype=torch.complex64), "does not handle dtype"),
        (torch.zeros(4).to_sparse(), "dense tensors"),
    ]:
        with pytest.raises(ValueError, match=match):
            shm.all_reduce(bad)
    with pytest.raises(ValueError, match="does not handle op"):
        shm.all_reduce(torch.zeros(4, dtype=torch.int32), ReduceOp.BAND)
    with pytest.raises(ValueError, match="must be a positive"):
        shm.ShmCommunicator(timeout=0)
    if world_size == 1:
        # Nothing to exchange: every op leaves the tensor as it is.
        t = torch.arange(5, dtype=torch.float16)
        for op in OPS:
            shm.all_reduce(t, op)
        assert torch.equal(t, torch.arange(5, dtype=torch.float16))


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_all_reduce_matches_references_gloo_and_ddp(world_size):
    """All dtypes, ops and sizes; rejections; threads; a DDP hook; 64 MiB."""
    assert shm.is_available(), shm.unavailable_reason()
    digests = run_on_ranks(_correctness_worker, world_size, timeout=600)
    for rank in range(1, world_size):
        assert digests[rank] == digests[0], f"rank {rank} ended with different bits than rank 0"


def test_warns_once_when_unavailable(monkeypatch):
    monkeypatch.setattr(shm, "_warned", False)
    with pytest.warns(RuntimeWarning, match="falling back to gloo") as record:
        shm.warn_unavailable_once()
        shm.warn_unavailable_once()
    assert len(record) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        shm.warn_unavailable_once()


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


@pytest.mark.slow
def test_failures_are_clear_errors_not_hangs():
    seen = run_on_ranks(_failures_worker, 2, timeout=300)
    assert "rank 1 reduces 11 torch.float32 elements with SUM" in seen[0]["mismatch"]
    assert "rank 0 reduces 10" in seen[1]["mismatch"]


def _dying_worker(rank: int, world_size: int, store_path: str, victim: int, results: mp.Queue) -> None:
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
        results.put((rank, str(e), time.monotonic() - last_ok, os.path.exists(_segment_path(comm))))
    results.close()
    results.join_thread()
    os._exit(0)  # skip tearing down a process group whose peer is dead


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_rank_dying_mid_collective_fails_the_others_fast(world_size, tmp_path):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    victim = world_size - 1
    procs = [
        ctx.Process(target=_dying_worker, args=(r, world_size, str(tmp_path / "store"), victim, results))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    try:
        seen = {}
        deadline = time.monotonic() + 120
        while len(seen) < world_size - 1 and time.monotonic() < deadline:
            try:
                rank, message, waited, segment_left = results.get(timeout=1)
            except queue.Empty:
                continue
            seen[rank] = (message, waited, segment_left)
        assert len(seen) == world_size - 1, f"survivors did not all report: {seen}"
        for rank, (message, waited, segment_left) in seen.items():
            # The victim's own error, or (with 3 ranks) a survivor that gave up first.
            assert f"rank {victim} exited during the collective" in message or "gave up" in message, message
            assert waited < 5.0, f"rank {rank} took {waited:.1f} s to notice (timeout was 30 s)"
            assert not segment_left
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join()
    assert procs[victim].exitcode == 17


def _job_worker(rank: int, world_size: int, job: int) -> None:
    for step in range(50):
        t = torch.full((1000 + 37 * step,), float(job * 100 + rank + step))
        shm.all_reduce(t)
        expected = world_size * (job * 100 + step) + sum(range(world_size))
        assert torch.equal(t, torch.full_like(t, float(expected))), f"job {job} step {step}: got {t[0]}"
    big = torch.full((400_000,), float(job + rank))
    shm.all_reduce(big)
    assert torch.equal(big, torch.full_like(big, float(world_size * job + sum(range(world_size)))))


@pytest.mark.slow
def test_two_concurrent_jobs_do_not_interfere():
    errors: list[BaseException] = []

    def job(index: int) -> None:
        try:
            run_on_ranks(_job_worker, 2, index, timeout=300)
        except BaseException as e:  # surfaced below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=job, args=(i,)) for i in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


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
def test_builds_from_source_when_no_installed_copy_fits(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    fingerprint = shm.build_config.source_hash(shm._lib._SOURCE)
    path, problem = shm._lib._build_cached(fingerprint)
    assert path is not None, problem
    assert path.parent == tmp_path / "ddpkit" / "shm"
    lib, problem = shm._lib._open(path)
    assert lib is not None, problem
    assert lib.ddpkit_shm_source_hash().decode() == fingerprint
