"""Every collective of ddpkit.comm against torch.distributed's built-in and a single-process reference.

Each world size is one job whose workers loop over all cases (algorithms x
sizes x dtypes x ops) and return the failures they found, so one job reports
every broken case; the jobs of every world size run side by side, forked from
one warm worker server (the module's fixture), so the suite stays fast on 2
cores.
"""

from __future__ import annotations

import functools
import hashlib
import os
import time

import pytest
import torch
import torch.distributed as dist

from ddpkit.comm import (
    all_gather,
    all_gather_into_tensor,
    all_to_all,
    all_to_all_single,
    barrier,
    broadcast,
    chunks,
    gather,
    reduce,
    reduce_scatter,
    reduce_scatter_tensor,
    scatter,
)
from ddpkit.comm.registry import ALLREDUCE_ALGORITHMS
from tests.helpers.module_runs import run_side_by_side, selected_params

R = dist.ReduceOp
SIZES = [0, 1, 5, 1023]
DTYPES = [torch.float32, torch.float64, torch.int32, torch.int64]
FLOAT_OPS = [R.SUM, R.PRODUCT, R.MIN, R.MAX, R.AVG]
INT_OPS = FLOAT_OPS + [R.BAND, R.BOR, R.BXOR]
ALGORITHMS = ["naive", "ring", "butterfly", "tree"]


def make_input(rank: int, shape: tuple[int, ...], dtype: torch.dtype, op, seed: int) -> torch.Tensor:
    """The tensor rank ``rank`` contributes to case ``seed``; any rank can recompute any other's."""
    g = torch.Generator().manual_seed(seed * 101 + rank)
    if op in (R.BAND, R.BOR, R.BXOR):
        return torch.randint(0, 256, shape, generator=g, dtype=dtype)
    if op == R.PRODUCT:  # small values: products of 4 ranks stay exact and in range
        if dtype.is_floating_point:
            return (torch.rand(shape, generator=g, dtype=torch.float64) + 0.5).to(dtype)
        return torch.randint(-2, 3, shape, generator=g, dtype=dtype)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    return torch.randint(-100, 101, shape, generator=g, dtype=dtype)


def reference(op, inputs: list[torch.Tensor]) -> torch.Tensor:
    """The reduction computed in one process, with ddpkit's operator rules."""
    dtype, n = inputs[0].dtype, len(inputs)
    if op in (R.SUM, R.AVG):
        total = torch.stack(inputs).sum(0).to(dtype)
        if op == R.SUM:
            return total
        return total / n if dtype.is_floating_point else torch.div(total, n, rounding_mode="trunc")
    if op == R.PRODUCT:
        return torch.stack(inputs).prod(0).to(dtype)
    if op == R.MIN:
        return torch.stack(inputs).amin(0)
    if op == R.MAX:
        return torch.stack(inputs).amax(0)
    fn = {R.BAND: torch.bitwise_and, R.BOR: torch.bitwise_or, R.BXOR: torch.bitwise_xor}[op]
    return functools.reduce(fn, inputs)


def mismatch(got: torch.Tensor, want: torch.Tensor) -> str | None:
    """None if equal (exactly for integers, to rounding for floats), else a description."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"shape/dtype {tuple(got.shape)} {got.dtype} != {tuple(want.shape)} {want.dtype}"
    if got.dtype.is_floating_point:
        tol = 1e-5 if got.dtype == torch.float32 else 1e-12
        ok = torch.allclose(got, want, rtol=tol, atol=tol)
    else:
        ok = torch.equal(got, want)
    if ok:
        return None
    diff = (got.double() - want.double()).abs()
    return f"max abs diff {diff.max().item():.3g} at {int(diff.argmax())}"


def shapes() -> list[tuple[tuple[int, ...], bool]]:
    """(shape, contiguous) cases: the flat sizes, a 2-D tensor and a strided view."""
    return [((n,), True) for n in SIZES] + [((3, 5), True), ((7, 3), False)]


def shapes_for(op) -> list[tuple[tuple[int, ...], bool]]:
    """Every shape for SUM and AVG; an uneven size and a tiny one for the other ops."""
    return shapes() if op in (R.SUM, R.AVG) else [((1023,), True), ((5,), True)]


def as_case_tensor(t: torch.Tensor, contiguous: bool) -> torch.Tensor:
    if contiguous:
        return t.clone()
    # A non-contiguous view with t's values: every other column of a wider tensor.
    wide = torch.zeros(t.shape[0], 2 * t.shape[1], dtype=t.dtype)
    wide[:, ::2] = t
    view = wide[:, ::2]
    assert not view.is_contiguous()
    return view


def ops_for(dtype: torch.dtype) -> list:
    return FLOAT_OPS if dtype.is_floating_point else INT_OPS


def _all_reduce_worker(rank: int, world_size: int) -> list[str]:
    failures: list[str] = []
    digests: list[str] = []
    default_segment = chunks.SEGMENT_BYTES
    seed = 0
    # Each case's inputs, reference and dist.all_reduce once, against every algorithm.
    for dtype in DTYPES:
        for op in ops_for(dtype):
            for shape, contiguous in shapes_for(op):
                seed += 1
                inputs = [make_input(r, shape, dtype, op, seed) for r in range(world_size)]
                want = reference(op, inputs)
                builtin = None
                if op != R.AVG or dtype.is_floating_point:  # gloo has no integer AVG
                    builtin = inputs[rank].clone()
                    dist.all_reduce(builtin, op=op)
                for algorithm in ALGORITHMS:
                    tensor = as_case_tensor(inputs[rank], contiguous)
                    ALLREDUCE_ALGORITHMS[algorithm](tensor, op=op)
                    case = f"all_reduce[{algorithm}] n={world_size} {dtype} {op.name} shape={shape}"
                    if not contiguous:
                        case += " non-contiguous"
                    if (problem := mismatch(tensor, want)) is not None:
                        failures.append(f"{case} vs reference: {problem}")
                    if builtin is not None and (problem := mismatch(tensor, builtin)) is not None:
                        failures.append(f"{case} vs dist.all_reduce: {problem}")
                    digests.append(hashlib.sha1(tensor.contiguous().numpy().tobytes()).hexdigest())
    for algorithm in ALGORITHMS:
        fn = ALLREDUCE_ALGORITHMS[algorithm]
        if algorithm in ("ring", "tree"):  # the pipelined ones: several uneven segments per chunk
            try:
                for dtype in DTYPES:
                    for op in (R.SUM, R.MAX):
                        for numel in SIZES:
                            seed += 1
                            segment_numel = max(1, numel // world_size // 3)
                            chunks.SEGMENT_BYTES = segment_numel * dtype.itemsize
                            inputs = [make_input(r, (numel,), dtype, op, seed) for r in range(world_size)]
                            tensor = inputs[rank].clone()
                            fn(tensor, op=op)
                            if (problem := mismatch(tensor, reference(op, inputs))) is not None:
                                failures.append(
                                    f"all_reduce[{algorithm}] with {segment_numel}-element segments "
                                    f"n={world_size} {dtype} {op.name} numel={numel}: {problem}"
                                )
                            digests.append(hashlib.sha1(tensor.numpy().tobytes()).hexdigest())
            finally:
                chunks.SEGMENT_BYTES = default_segment
    # Every rank must end with the very same bits, not just values close to the reference.
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, digests)
    for r, theirs in enumerate(everyone):
        if theirs != digests:
            failures.append(f"rank {r} and rank {rank} hold different bits after all_reduce")
            break
    return failures


def _rooted_worker(rank: int, world_size: int) -> list[str]:
    """reduce, broadcast, gather, scatter for every root."""
    failures: list[str] = []
    seed = 10_000
    for root in range(world_size):
        for dtype in DTYPES:
            for shape, contiguous in shapes():
                seed += 1
                # reduce: every op, against the reference and dist.reduce
                for op in ops_for(dtype):
                    if (shape, contiguous) not in shapes_for(op):
                        continue
                    inputs = [make_input(r, shape, dtype, op, seed) for r in range(world_size)]
                    tensor = as_case_tensor(inputs[rank], contiguous)
                    reduce(tensor, root, op=op)
                    if rank == root:
                        case = f"reduce n={world_size} dst={root} {dtype} {op.name} shape={shape}"
                        if (problem := mismatch(tensor, reference(op, inputs))) is not None:
                            failures.append(f"{case}: {problem}")
                    if op != R.AVG:
                        builtin = inputs[rank].clone()
                        dist.reduce(builtin, root, op=op)
                        if rank == root and (problem := mismatch(tensor, builtin)) is not None:
                            failures.append(
                                f"reduce vs dist.reduce n={world_size} dst={root} {dtype} {op.name}: {problem}"
                            )
                inputs = [make_input(r, shape, dtype, R.SUM, seed) for r in range(world_size)]
                # broadcast
                tensor = as_case_tensor(inputs[rank], contiguous)
                broadcast(tensor, root)
                if (problem := mismatch(tensor, inputs[root])) is not None:
                    failures.append(f"broadcast n={world_size} src={root} {dtype} shape={shape}: {problem}")
                # gather
                outputs = [as_case_tensor(torch.zeros(shape, dtype=dtype), contiguous) for _ in range(world_size)]
                gather(inputs[rank], outputs if rank == root else None, dst=root)
                if rank == root:
                    for r in range(world_size):
                        if (problem := mismatch(outputs[r], inputs[r])) is not None:
                            failures.append(
                                f"gather n={world_size} dst={root} {dtype} shape={shape} piece {r}: {problem}"
                            )
                # scatter: rank i receives the root's i-th piece
                pieces = [make_input(root, shape, dtype, R.SUM, seed * 7 + i) for i in range(world_size)]
                tensor = as_case_tensor(torch.zeros(shape, dtype=dtype), contiguous)
                scatter(tensor, pieces if rank == root else None, src=root)
                if (problem := mismatch(tensor, pieces[rank])) is not None:
                    failures.append(f"scatter n={world_size} src={root} {dtype} shape={shape}: {problem}")
    return failures


def _everyone_worker(rank: int, world_size: int) -> list[str]:
    """all_gather, reduce_scatter and all_to_all, with their tensor forms."""
    failures: list[str] = []
    seed = 20_000
    for dtype in DTYPES:
        for shape, contiguous in shapes():
            seed += 1
            inputs = [make_input(r, shape, dtype, R.SUM, seed) for r in range(world_size)]
            case = f"n={world_size} {dtype} shape={shape}"
            # all_gather, into strided outputs when not contiguous
            outputs = [as_case_tensor(torch.zeros(shape, dtype=dtype), contiguous) for _ in range(world_size)]
            all_gather(outputs, inputs[rank])
            for r in range(world_size):
                if (problem := mismatch(outputs[r], inputs[r])) is not None:
                    failures.append(f"all_gather {case} piece {r}: {problem}")
            flat = torch.zeros(world_size * inputs[0].numel(), dtype=dtype)
            all_gather_into_tensor(flat, inputs[rank])
            if (problem := mismatch(flat, torch.cat([t.reshape(-1) for t in inputs]))) is not None:
                failures.append(f"all_gather_into_tensor {case}: {problem}")
            # reduce_scatter: every op, against the reference and the built-in
            for op in ops_for(dtype):
                if (shape, contiguous) not in shapes_for(op):
                    continue
                lists = [
                    [make_input(r, shape, dtype, op, seed * 13 + i) for i in range(world_size)]
                    for r in range(world_size)
                ]
                mine = [as_case_tensor(t, contiguous) for t in lists[rank]]
                before = [t.clone() for t in mine]
                output = as_case_tensor(torch.zeros(shape, dtype=dtype), contiguous)
                reduce_scatter(output, mine, op=op)
                want = reference(op, [lists[r][rank] for r in range(world_size)])
                if (problem := mismatch(output, want)) is not None:
                    failures.append(f"reduce_scatter {case} {op.name}: {problem}")
                if any(not torch.equal(a, b) for a, b in zip(mine, before)):
                    failures.append(f"reduce_scatter {case} {op.name} modified its input_list")
                if op != R.AVG:
                    builtin = torch.zeros(shape, dtype=dtype)
                    dist.reduce_scatter(builtin, [t.clone() for t in lists[rank]], op=op)
                    if (problem := mismatch(output, builtin)) is not None:
                        failures.append(f"reduce_scatter vs dist.reduce_scatter {case} {op.name}: {problem}")
                flat_out = torch.zeros(shape, dtype=dtype)
                reduce_scatter_tensor(flat_out, torch.cat([t.reshape(-1) for t in lists[rank]]), op=op)
                if (problem := mismatch(flat_out, want)) is not None:
                    failures.append(f"reduce_scatter_tensor {case} {op.name}: {problem}")

        # all_to_all with uneven pieces: rank i sends (i + 2 j) % 4 elements to rank j
        def piece(src: int, dst: int) -> torch.Tensor:
            return make_input(src, ((src + 2 * dst) % 4,), dtype, R.SUM, seed * 17 + dst)  # noqa: B023 (called in this iteration)

        outputs = [torch.full(((src + 2 * rank) % 4,), -1, dtype=dtype) for src in range(world_size)]
        all_to_all(outputs, [piece(rank, dst) for dst in range(world_size)])
        for src in range(world_size):
            if (problem := mismatch(outputs[src], piece(src, rank))) is not None:
                failures.append(f"all_to_all n={world_size} {dtype} from {src}: {problem}")
        # all_to_all_single, equal split and explicit split sizes, rows of 3 columns
        sizes_to = [(rank + dst) % 3 for dst in range(world_size)]
        sizes_from = [(src + rank) % 3 for src in range(world_size)]
        rows = [make_input(rank, (sizes_to[d], 3), dtype, R.SUM, seed * 19 + d) for d in range(world_size)]
        out = torch.zeros(sum(sizes_from), 3, dtype=dtype)
        all_to_all_single(out, torch.cat(rows), sizes_from, sizes_to)
        want = torch.cat([make_input(s, (sizes_from[s], 3), dtype, R.SUM, seed * 19 + rank) for s in range(world_size)])
        if (problem := mismatch(out, want)) is not None:
            failures.append(f"all_to_all_single with split sizes n={world_size} {dtype}: {problem}")
        equal_in = make_input(rank, (2 * world_size, 3), dtype, R.SUM, seed * 23)
        equal_out = torch.zeros(2 * world_size, 3, dtype=dtype)
        all_to_all_single(equal_out, equal_in)
        builtin = torch.zeros_like(equal_out)
        dist.all_to_all_single(builtin, equal_in.clone())
        if (problem := mismatch(equal_out, builtin)) is not None:
            failures.append(f"all_to_all_single vs dist.all_to_all_single n={world_size} {dtype}: {problem}")
    return failures


def _barrier_worker(rank: int, world_size: int, folder: str) -> list[str]:
    failures = []
    for round_ in range(world_size):
        if rank == round_:  # this round's latecomer: the others must wait for it
            time.sleep(0.1)
        open(os.path.join(folder, f"{round_}-{rank}"), "w").close()
        barrier()
        missing = [r for r in range(world_size) if not os.path.exists(os.path.join(folder, f"{round_}-{r}"))]
        if missing:
            failures.append(f"barrier round {round_}: rank {rank} left before ranks {missing} arrived")
    return failures


def _subgroup_worker(rank: int, world_size: int) -> list[str]:
    """Collectives on a group whose ranks are not the global ranks; rank 0 is outside it."""
    members = list(range(1, world_size))
    group = dist.new_group(members)
    failures: list[str] = []
    if rank not in members:  # non-members return at once, as with torch.distributed
        t = torch.ones(3)
        for algorithm in ALGORITHMS:  # the send/recv algorithms; shm and hierarchical have tests of their own
            ALLREDUCE_ALGORITHMS[algorithm](t, group=group)
        broadcast(t, 0, group=group)
        return [] if torch.equal(t, torch.ones(3)) else ["a non-member's tensor changed"]
    n = len(members)
    group_rank = dist.get_rank(group)
    for algorithm in ALGORITHMS:
        inputs = [make_input(members[r], (11,), torch.float64, R.SUM, 30_000) for r in range(n)]
        t = inputs[group_rank].clone()
        ALLREDUCE_ALGORITHMS[algorithm](t, op=R.SUM, group=group)
        if (problem := mismatch(t, reference(R.SUM, inputs))) is not None:
            failures.append(f"all_reduce[{algorithm}] on subgroup {members}: {problem}")
    for root in range(n):  # group ranks, not global ranks
        t = torch.full((4,), float(group_rank))
        broadcast(t, root, group=group)
        if not torch.equal(t, torch.full((4,), float(root))):
            failures.append(f"broadcast from group rank {root} on subgroup {members}: got {t.tolist()}")
        t = torch.full((4,), float(group_rank + 1))
        reduce(t, root, op=R.SUM, group=group)
        if group_rank == root and not torch.equal(t, torch.full((4,), float(n * (n + 1) // 2))):
            failures.append(f"reduce to group rank {root} on subgroup {members}: got {t.tolist()}")
    outputs = [torch.zeros(2) for _ in range(n)]
    all_gather(outputs, torch.full((2,), float(rank)), group=group)
    if [o[0].item() for o in outputs] != [float(m) for m in members]:
        failures.append(f"all_gather on subgroup {members}: got {[o.tolist() for o in outputs]}")
    barrier(group=group)
    return failures


def _every_collective(rank: int, world_size: int, folder: str) -> list[str]:
    failures = _all_reduce_worker(rank, world_size)
    failures += _rooted_worker(rank, world_size)
    failures += _everyone_worker(rank, world_size)
    failures += _barrier_worker(rank, world_size, folder)
    if world_size >= 3:
        failures += _subgroup_worker(rank, world_size)
    return failures


@pytest.fixture(scope="module")
def every_world_size(request, tmp_path_factory):
    """Each selected world size's failures by rank, the world sizes side by side."""
    return run_side_by_side(
        {
            n: (_every_collective, n, (str(tmp_path_factory.mktemp(f"barrier-{n}")),), {})
            for n in selected_params(request, "world_size")
        }
    )


@pytest.mark.parametrize(
    "world_size",
    # 3 and 4 ranks oversubscribe 2 cores: the longest runs.
    [1, 2, pytest.param(3, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow)],
)
def test_every_collective_matches_builtin_and_reference(every_world_size, world_size):
    results = every_world_size[world_size].get()
    failures = [f"rank {r}: {f}" for r, fs in enumerate(results) for f in fs]
    assert not failures, f"{len(failures)} failing cases:\n" + "\n".join(failures[:40])
