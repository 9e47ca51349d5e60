"""ddpkit.prepare_model: stock DDP's weights in every mode, with the loop left as plain torch.

The jobs of 2, 3 and 1 ranks run side by side in one fixture, forked from one
warm worker server; each test checks its job.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import weakref
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.helpers.module_runs import run_side_by_side, selected_tests
from tests.helpers.workers import DYNAMO

NUM_STEPS = 3
VARIANTS = ("set_to_none", "zero", "accumulate", "frozen", "amp", "unused")
"""How each training differs: zero_grad(set_to_none=True) (torch's default) or False; two micro-batches,
the first in no_sync; a frozen parameter; autocast and GradScaler; a parameter some ranks skip in a step."""


class Net(nn.Module):
    """An MLP, and a layer that ``forward(x, use_extra=False)`` leaves out."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
        self.extra = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, use_extra: bool = True) -> torch.Tensor:
        y = self.body(x)
        return y + self.extra(x) if use_extra else y


def _net(rank: int, variant: str) -> Net:
    torch.manual_seed(rank)  # different weights on every rank: rank 0's must win
    net = Net()
    if variant == "frozen":
        net.body[0].bias.requires_grad_(False)
    return net


def _train(
    model: nn.Module,
    no_sync: Callable[[], contextlib.AbstractContextManager],
    variant: str,
    optimizer_name: str,
    rank: int,
) -> list[torch.Tensor]:
    """The parameters after NUM_STEPS steps of a plain torch loop on this rank's batches."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    if optimizer_name == "sgd":
        optimizer = torch.optim.SGD(trainable, lr=0.1, momentum=0.9)
    else:
        optimizer = torch.optim.Adam(trainable, lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, enabled=variant == "amp")
    num_micro = 2 if variant == "accumulate" else 1
    for step in range(NUM_STEPS):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
        # Every step some rank uses the extra layer, and some rank does not (2 ranks: exactly one).
        use_extra = variant != "unused" or (step + rank) % 2 == 0
        for i, (xs, ys) in enumerate(zip(x.chunk(num_micro), y.chunk(num_micro))):
            with no_sync() if i < num_micro - 1 else contextlib.nullcontext():
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=variant == "amp"):
                    out = model(xs, use_extra)
                scaler.scale(F.mse_loss(out.float(), ys) / num_micro).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=variant != "zero")
    return [p.detach().clone() for p in model.parameters()]


def _matches_stock_ddp(
    rank: int, world_size: int, modes: list[str], allreduces: list[str], variants: list[str], optimizers: list[str]
) -> dict:
    """Train each combination through prepare_model and stock DDP on the same batches; report what differs."""
    import ddpkit.distributed
    from ddpkit.prepare import gradient_sync, no_sync, prepare_model, unwrap_model

    ctx = ddpkit.distributed.init()  # adopts the group the helper formed
    failures: list[str] = []
    starts: dict[str, torch.Tensor] = {"rank 0 before": _flat_parameters(_net(0, "set_to_none"))}
    prepared: list[weakref.ref] = []
    try:
        for variant in variants:
            for optimizer_name in optimizers:
                # Stock DDP with torch's all_reduce (and with unused parameters, the option DDP needs).
                reference = DDP(_net(rank, variant), find_unused_parameters=variant == "unused")
                expected = _train(reference, reference.no_sync, variant, optimizer_name, rank)
                for mode in modes:
                    if variant == "unused" and mode == "ddp":
                        continue  # DDP's defaults raise on unused parameters; stock DDP needs an option
                    for algorithm in allreduces:
                        label = f"{mode}/{algorithm}/{variant}/{optimizer_name}"
                        net = _net(rank, variant)
                        model = prepare_model(net, allreduce=algorithm, grad_sync=mode)
                        sync = gradient_sync(model)
                        assert (sync.mode, sync.allreduce) == (mode, algorithm), (label, sync.describe())
                        assert isinstance(model, DDP) if mode == "ddp" else model is net, label
                        assert unwrap_model(model) is net, label
                        starts.setdefault(mode, _flat_parameters(net))
                        prepared.append(weakref.ref(model))
                        got = _train(model, lambda m=model: no_sync(m), variant, optimizer_name, rank)
                        for i, (g, e) in enumerate(zip(got, expected)):
                            if not torch.allclose(g, e, rtol=1e-5, atol=1e-7):
                                failures.append(f"{label}: parameter {i} differs by {(g - e).abs().max():.3g}")
        describe = gradient_sync(model).describe()
    finally:
        ddpkit.distributed.shutdown()
    assert ctx.world_size == world_size
    del model, net, sync
    gc.collect()
    alive = sum(ref() is not None for ref in prepared)  # prepare_model keeps no module alive
    return {"failures": failures, "starts": starts, "describe": describe, "alive": alive}


def _flat_parameters(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _check(results: list[dict], modes: list[str]) -> None:
    for rank, result in enumerate(results):
        assert result["failures"] == [], f"rank {rank}: " + "\n".join(result["failures"])
        assert result["alive"] == 0, f"rank {rank}: {result['alive']} prepared modules outlived their last use"
        for mode in modes:
            assert torch.equal(result["starts"][mode], results[0]["starts"]["rank 0 before"]), (rank, mode)


def _single_worker(rank: int, world_size: int) -> dict:
    import ddpkit.distributed
    from ddpkit.prepare import gradient_sync, no_sync, prepare_model, unwrap_model

    ddpkit.distributed.init()
    try:
        with pytest.raises(
            ValueError, match="allreduce='bogus' is not an all_reduce algorithm; choose one of: builtin, naive"
        ):
            prepare_model(Net(), allreduce="bogus")
        with pytest.raises(ValueError, match="grad_sync='bogus' is not valid; choose one of: auto, ddp, flat, manual"):
            prepare_model(Net(), grad_sync="bogus")
        with torch.device("meta"):
            on_meta = Net()
        with pytest.raises(ValueError, match=r"model's .* is on the meta device .*build it on the CPU, or shard it"):
            prepare_model(on_meta)
        results = {}
        for variant in ("set_to_none", "accumulate"):
            net = _net(0, variant)
            plain = copy.deepcopy(net)
            model = prepare_model(net)
            assert model is net and unwrap_model(model) is net
            assert gradient_sync(model).describe() == "single worker: no gradient synchronisation"
            with pytest.raises(ValueError, match="already prepared"):
                prepare_model(model)
            got = _train(model, lambda m=model: no_sync(m), variant, "adam", rank)
            expected = _train(plain, contextlib.nullcontext, variant, "adam", rank)
            results[variant] = all(torch.equal(g, e) for g, e in zip(got, expected))
        return results
    finally:
        ddpkit.distributed.shutdown()


ACCUMULATION_STYLES = ("require_backward_grad_sync", "model.no_sync", "ddpkit.no_sync")
"""How a loop keeps the first micro-batches' gradients local: nanoGPT's attribute, DDP's method, ddpkit's."""


def _accumulate(model: nn.Module, style: str, rank: int, num_micro: int = 3) -> list[torch.Tensor]:
    """Two SGD steps of ``num_micro`` micro-batches each, accumulation said in ``style``.

    Returns the gradients after every backward (local ones in the accumulating backwards: averaging them
    too would only cost messages and rounding, since the mean is linear), then the parameters after."""
    seen: list[torch.Tensor] = []
    from ddpkit.prepare import no_sync

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(4 * num_micro, 6, generator=g), torch.randn(4 * num_micro, 3, generator=g)
        for i, (xs, ys) in enumerate(zip(x.chunk(num_micro), y.chunk(num_micro))):
            last = i == num_micro - 1
            if style == "require_backward_grad_sync":  # nanoGPT's train.py, as written for DDP
                model.require_backward_grad_sync = last
                block = contextlib.nullcontext()
            elif last or style == "none":
                block = contextlib.nullcontext()
            else:
                block = model.no_sync() if style == "model.no_sync" else no_sync(model)
            with block:
                (F.mse_loss(model(xs), ys) / num_micro).backward()
            seen += [p.grad.clone() for p in model.parameters()]
        optimizer.step()
        optimizer.zero_grad()
    return seen + [p.detach().clone() for p in model.parameters()]


def _ddp_switches_match_stock_ddp(rank: int, world_size: int) -> dict:
    """Each mode trained with DDP's switches (attribute, method, .module) against stock DDP; what differs."""
    import ddpkit.distributed
    from ddpkit.prepare import gradient_sync, prepare_model

    ddpkit.distributed.init()
    failures: list[str] = []
    try:
        for style in ACCUMULATION_STYLES:
            reference = DDP(_net(rank, "set_to_none"))  # ddpkit.no_sync takes prepared modules only
            expected = _accumulate(reference, "model.no_sync" if style == "ddpkit.no_sync" else style, rank)
            for mode in MODES:
                net = _net(rank, "set_to_none")
                model = prepare_model(net, grad_sync=mode)
                assert gradient_sync(model).mode == mode
                if model.module is not net:
                    failures.append(f"{mode}: model.module is {type(model.module).__name__}, not the plain module")
                got = _accumulate(model, style, rank)
                if model.require_backward_grad_sync is not True:
                    failures.append(
                        f"{mode}/{style}: require_backward_grad_sync left {model.require_backward_grad_sync}"
                    )
                for i, (a, e) in enumerate(zip(got, expected)):
                    if not torch.allclose(a, e, rtol=1e-5, atol=1e-7):
                        failures.append(f"{mode}/{style}: tensor {i} differs by {(a - e).abs().max():.3g}")
        # Without the switch, the same loop averages every micro-batch: its gradients must differ from the above.
        model = prepare_model(_net(rank, "set_to_none"), grad_sync="flat")
        if all(torch.allclose(a, e, rtol=1e-5, atol=1e-7) for a, e in zip(_accumulate(model, "none", rank), expected)):
            failures.append("flat: the loop without the switch gave the switch's gradients; the test cannot tell")
    finally:
        ddpkit.distributed.shutdown()
    return {"failures": failures}


class OwnsModule(nn.Module):
    """A model with a child named ``module``, as wrappers have."""

    def __init__(self) -> None:
        super().__init__()
        self.module = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


def _ddp_switches_with_one_worker(rank: int, world_size: int) -> dict:
    """One worker: the switches exist and change nothing; the module still copies, pickles and saves as before."""
    import io

    import ddpkit.distributed
    from ddpkit.prepare import prepare_model

    ddpkit.distributed.init()
    try:
        results = {}
        for style in ACCUMULATION_STYLES:
            net = _net(0, "set_to_none")
            plain = copy.deepcopy(net)
            model = prepare_model(net)
            assert model.module is model and model.require_backward_grad_sync is True
            got = _accumulate(model, style, rank)
            results[style] = all(torch.equal(g, e) for g, e in zip(got, _accumulate(plain, "none", rank)))
        twin = copy.deepcopy(model)  # an EMA copy: its own switch, its own module
        assert twin.module is twin and twin is not model
        with twin.no_sync():
            assert twin.require_backward_grad_sync is False and model.require_backward_grad_sync is True
        assert list(model.state_dict()) == list(plain.state_dict())
        assert len(list(model.modules())) == len(list(plain.modules()))
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        assert loaded.module is loaded
        owner = prepare_model(OwnsModule())  # keeps its own child, with a warning
        results["own module kept"] = isinstance(owner.module, nn.Linear)
        return results
    finally:
        ddpkit.distributed.shutdown()


class Twice(nn.Module):
    """One layer applied twice in one forward (its weights used twice)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(torch.relu(self.layer(x))))


def _loss_of(case: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """How ``case``'s loop makes its loss from ``model`` (the prepared module, or torch.compile's of it)."""
    if case == "submodule_directly":  # the root's forward is never called
        return F.mse_loss(model.head(model.layer(x)), y)
    if case == "two_forwards":
        half = len(x) // 2
        return F.mse_loss(model(x[:half]), y[:half]) + F.mse_loss(model(x[half:]), y[half:])
    return F.mse_loss(model(x), y)


FLAT_CASES = (
    "plain",
    "two_forwards",
    "submodule_directly",
    "zero_grad_between_forward_and_backward",
    "set_to_none_false",
    "part_of_the_model_zeroed",
    "clipped",
    "compiled",
)
"""Loops over grad_sync=flat: each step's gradients must be the mean of plain torch's on every rank."""


def _flat_gradients_are_averaged(rank: int, world_size: int) -> dict:
    """Run each case of FLAT_CASES for 3 steps; report what differs from the mean of plain torch's gradients."""
    import torch.distributed as dist

    import ddpkit.distributed
    from ddpkit.prepare import gradient_sync, prepare_model

    ddpkit.distributed.init()
    failures: list[str] = []
    try:
        for case in FLAT_CASES:
            torch.manual_seed(0)
            plain = Twice()
            model = prepare_model(copy.deepcopy(plain), allreduce="shm", grad_sync="flat")
            flat = gradient_sync(model).flat
            called = torch.compile(model, backend="eager") if case == "compiled" else model
            head_so_far: list[torch.Tensor] = []
            for step in range(3):
                g = torch.Generator().manual_seed(100 * step + rank)
                x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
                plain.zero_grad()
                _loss_of(case, plain, x, y).backward()
                expected = [p.grad.clone() for p in plain.parameters()]
                for e in expected:
                    dist.all_reduce(e)
                    e /= world_size
                # zero_grad first, as many loops do; part_of_the_model_zeroed keeps the head's gradients.
                params = list(model.layer.parameters()) if case == "part_of_the_model_zeroed" else model.parameters()
                if case != "zero_grad_between_forward_and_backward":
                    for p in params:
                        p.grad = None if case != "set_to_none_false" else p.grad.zero_()
                loss = _loss_of(case, called, x, y)
                if case == "zero_grad_between_forward_and_backward":
                    model.zero_grad()
                loss.backward()
                got = [p.grad for p in model.parameters()]
                if case == "part_of_the_model_zeroed":  # the head's gradients accumulate over the steps
                    expected[2:] = [e + h for e, h in zip(expected[2:], head_so_far)] if head_so_far else expected[2:]
                    head_so_far = expected[2:]
                if case == "clipped":
                    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
                    want = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(e) for e in expected]))
                    if not torch.allclose(norm, want, rtol=1e-5):
                        failures.append(f"{case} step {step}: clip_grad_norm_ saw {norm:.6g}, not {want:.6g}")
                for i, (a, e) in enumerate(zip(got, expected)):
                    if not torch.allclose(a, e, rtol=1e-5, atol=1e-6):
                        failures.append(f"{case} step {step}: parameter {i} differs by {(a - e).abs().max():.3g}")
                if not all(p.grad is v for p, v in zip(model.parameters(), flat.views)):
                    failures.append(f"{case} step {step}: a .grad is not its view of the buffer after backward")
    finally:
        ddpkit.distributed.shutdown()
    return {"failures": failures}


MODES = ["ddp", "flat", "manual"]
JOBS = {
    "test_every_mode_and_allreduce_trains_like_stock_ddp_on_2_ranks": (
        _matches_stock_ddp,
        2,
        (MODES, ["builtin", "ring", "shm"], list(VARIANTS), ["sgd", "adam"]),
        {},
    ),
    "test_every_mode_trains_like_stock_ddp_on_3_ranks": (
        _matches_stock_ddp,
        3,
        (MODES, ["ring", "shm"], ["set_to_none", "accumulate", "unused"], ["adam"]),
        {},
    ),
    "test_flat_gradients_are_averaged_whatever_the_loop_calls": (_flat_gradients_are_averaged, 2, (), {}),
    "test_ddps_switches_have_ddps_effect_in_every_mode": (_ddp_switches_match_stock_ddp, 2, (), {}),
    "test_ddps_switches_with_one_worker": (_ddp_switches_with_one_worker, 1, (), {"init_process_group": False}),
    "test_one_worker_returns_the_model_itself_and_trains_as_plain_torch": (
        _single_worker,
        1,
        (),
        {"init_process_group": False},
    ),
}
"""The job each multi-process test checks: function, ranks, arguments, options."""


@pytest.fixture(scope="module")
def jobs(request) -> dict:
    """The outcome of each selected test's job, run side by side (every rank builds optimizers and DDP models)."""
    selected = selected_tests(request)
    return run_side_by_side({name: job for name, job in JOBS.items() if name in selected}, DYNAMO, timeout=240)


def test_every_mode_and_allreduce_trains_like_stock_ddp_on_2_ranks(jobs):
    results = jobs["test_every_mode_and_allreduce_trains_like_stock_ddp_on_2_ranks"].get()
    _check(results, MODES)
    assert results[0]["describe"].startswith("gradients: manual of ")


def test_every_mode_trains_like_stock_ddp_on_3_ranks(jobs):
    _check(jobs["test_every_mode_trains_like_stock_ddp_on_3_ranks"].get(), MODES)


def test_flat_gradients_are_averaged_whatever_the_loop_calls(jobs):
    """Two forwards into one loss, a loss from a submodule called directly (no root forward), zero_grad
    between forward and backward, a zero_grad of part of the model, clipping, torch.compile: averaged."""
    for rank, result in enumerate(jobs["test_flat_gradients_are_averaged_whatever_the_loop_calls"].get()):
        assert result["failures"] == [], f"rank {rank}: " + "\n".join(result["failures"])


def test_one_worker_returns_the_model_itself_and_trains_as_plain_torch(jobs):
    results = jobs["test_one_worker_returns_the_model_itself_and_trains_as_plain_torch"].get()
    assert results == [{"set_to_none": True, "accumulate": True}]


def test_ddps_switches_have_ddps_effect_in_every_mode(jobs):
    """nanoGPT's ``model.require_backward_grad_sync = last``, ``with model.no_sync():`` and ``model.module``:
    the gradients after every backward and the weights of stock DDP (to float rounding) in ddp, flat and manual."""
    for rank, result in enumerate(jobs["test_ddps_switches_have_ddps_effect_in_every_mode"].get()):
        assert result["failures"] == [], f"rank {rank}: " + "\n".join(result["failures"])


def test_ddps_switches_with_one_worker(jobs):
    results = jobs["test_ddps_switches_with_one_worker"].get()
    assert results == [{**dict.fromkeys(ACCUMULATION_STYLES, True), "own module kept": True}]


def test_prepare_model_before_init_says_to_call_init():
    from ddpkit.prepare import prepare_model

    with pytest.raises(RuntimeError, match=r"call ddpkit.init\(\) first"):
        prepare_model(Net())


def test_no_sync_needs_a_prepared_model():
    from ddpkit.prepare import gradient_sync, no_sync

    assert gradient_sync(Net()) is None
    with pytest.raises(ValueError, match="the module that ddpkit.prepare_model returned"):
        no_sync(Net())
