"""``hvd.DistributedOptimizer``: the user's optimizer, each gradient all-reduced as backward produces it.

::

    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=hvd.Compression.fp16)
    loss.backward()        # each gradient, once accumulated, is queued for an asynchronous allreduce
    optimizer.step()       # waits for them all (synchronize), then the wrapped optimizer's step

As in Horovod, the returned object is an instance of a class made on the
fly as a subclass of the optimizer's own class, so ``isinstance(optimizer,
torch.optim.SGD)`` holds and ``state_dict``, ``param_groups`` and the
optimizer's state are the wrapped optimizer's (shared with it, not copied).

Per parameter, a post-accumulate-grad hook counts backward passes; on the
``backward_passes_per_step``-th it compresses ``.grad`` and queues an
in-place allreduce on the background thread (:mod:`ddpkit.horovod.engine`),
so communication overlaps the rest of backward::

    backward:  grad w3 -> hook: queue allreduce(w3) | grad w2 -> hook: queue allreduce(w2) | ...
    engine thread:            allreduce(w3) ---------------- allreduce(w2) --------- ...
    step():    synchronize: wait for every handle, decompress into .grad, then the optimizer's step

Earlier backward passes only accumulate locally (the loss is the user's to
scale). ``synchronize()`` also all-reduces the parameters whose gradient
did not arrive (zeros where ``.grad`` is None), so every rank steps alike.
With op=Average each gradient is multiplied by ``1 / gradient_predivide_factor``
before the sum and by ``gradient_predivide_factor / size()`` after it.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable, Iterator
from typing import Any, cast

import torch

from ddpkit.horovod.compression import Compression, Compressor
from ddpkit.horovod.ops import Adasum, Average, ReduceOp, allreduce_async_, grouped_allreduce_async_, synchronize
from ddpkit.horovod.process_sets import check as check_process_set, global_process_set
from ddpkit.horovod.ranks import size
from ddpkit.horovod.unsupported import ADASUM, HorovodUnsupportedError


def DistributedOptimizer(  # noqa: N802 (Horovod's name)
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
    compression: type[Compressor] = Compression.none,
    backward_passes_per_step: int = 1,
    op: ReduceOp = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: int | list[list[torch.Tensor]] | None = None,
    sparse_as_dense: bool = False,
    process_set: object = global_process_set,
) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` applies gradients reduced over every rank.

    Args:
        optimizer: the optimizer, built on the model's parameters.
        named_parameters: ``model.named_parameters()``: names the allreduces (checked across ranks).
        compression: ``Compression.none`` or ``Compression.fp16``.
        backward_passes_per_step: backward passes accumulated locally before the allreduce.
        op: Average (default) or Sum.
        gradient_predivide_factor: with Average, divide before the sum by this and after it
            by ``size() / factor``.
        num_groups: Horovod's older spelling of ``groups`` as a number.
        groups: a number of groups to split the parameters into, or lists of parameters;
            each group is reduced as one collective once all its gradients are ready.
        sparse_as_dense: accepted; sparse gradients are always reduced dense.
        process_set: the global process set only.

    Returns:
        An instance of a subclass of ``type(optimizer)``, sharing its state.

    Raises:
        HorovodUnsupportedError: op=Adasum, or another process set.
        ValueError: backward_passes_per_step < 1, a predivide factor with op other than
            Average, or named_parameters that do not name the optimizer's parameters.
    """
    check_process_set(process_set)
    if op == Adasum:
        raise HorovodUnsupportedError(ADASUM)
    if backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step={backward_passes_per_step} must be >= 1")
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor needs op=hvd.Average; drop the factor or use Average")
    # A subclass of both _DistributedOptimizer and the optimizer's own class, made at run time.
    cls: type[torch.optim.Optimizer] = type(type(optimizer).__name__, (_DistributedOptimizer, type(optimizer)), {})
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)  # the same param_groups, state and hooks, no re-initialisation
    cast(_DistributedOptimizer, wrapped)._setup(
        named_parameters,
        compression,
        backward_passes_per_step,
        ReduceOp(op),
        gradient_predivide_factor,
        groups if groups is not None else (num_groups or None),
    )
    return wrapped


class _DistributedOptimizer:
    """The methods DistributedOptimizer adds in front of the optimizer's class."""

    param_groups: list[dict[str, Any]]

    def _setup(
        self,
        named_parameters: Iterable[tuple[str, torch.Tensor]] | None,
        compression: type[Compressor],
        backward_passes_per_step: int,
        op: ReduceOp,
        predivide: float,
        groups: int | list[list[torch.Tensor]] | None,
    ) -> None:
        params = [p for group in self.param_groups for p in group["params"]]
        self._names = _parameter_names(params, named_parameters)
        self._compression = compression
        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        self._scale = (1.0 / predivide, predivide) if op == Average else (1.0, 1.0)
        self._delay = {p: backward_passes_per_step for p in params}
        self._handles: dict[Any, tuple[int, Any]] = {}  # a parameter, or ("group", i): (handle, compression ctx)
        self._pending = False  # a backward ran since the last synchronize
        self._synchronized = False
        self._should_synchronize = True
        self._requires_update = [p for p in params if p.requires_grad] if size() > 1 else []
        self._groups = _split_groups(self._requires_update, groups)
        self._group_of = {p: i for i, group in enumerate(self._groups) for p in group}
        self._ready: dict[int, set[torch.Tensor]] = {i: set() for i in range(len(self._groups))}
        for p in self._requires_update:
            p.register_post_accumulate_grad_hook(self._hook)

    # -- Horovod's public methods ---------------------------------------------------------

    def synchronize(self) -> None:
        """Wait until every gradient is reduced (queuing those not yet queued) and write them into ``.grad``."""
        for p in self._requires_update:
            if p not in self._group_of and p not in self._handles:
                self._handles[p] = self._allreduce_one(p)
        for i in range(len(self._groups)):
            if ("group", i) not in self._handles:
                self._handles[("group", i)] = self._allreduce_group(i)
        for key, (handle, ctx) in self._handles.items():
            outputs = synchronize(handle)
            members = self._groups[key[1]] if isinstance(key, tuple) else [key]
            contexts = ctx if isinstance(key, tuple) else [ctx]
            outputs = outputs if isinstance(key, tuple) else [outputs]
            for p, out, c in zip(members, outputs, contexts):
                self._delay[p] = self.backward_passes_per_step
                grad = self._compression.decompress(out, c)
                if grad is not p.grad:
                    assert p.grad is not None, "a reduced gradient belongs to a parameter that has one"
                    p.grad.copy_(grad)
        self._handles.clear()
        for ready in self._ready.values():
            ready.clear()
        self._pending = False
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Inside, ``step()`` does not synchronize: for calling ``synchronize()`` first (e.g. to clip gradients)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure: Any = None) -> Any:
        """Synchronize (unless inside ``skip_synchronize()``), then the wrapped optimizer's step."""
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn(
                    "optimizer.step() called without optimizer.skip_synchronize() after "
                    "optimizer.synchronize(); wrap step() in skip_synchronize() to avoid a second "
                    "synchronization",
                    stacklevel=2,
                )
            self.synchronize()
        self._synchronized = False
        return super().step(closure)  # type: ignore[misc]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped optimizer's zero_grad; refused between backward and step (reductions still write .grad)."""
        if self._pending:
            raise ValueError(
                "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() "
                "or optimizer.synchronize(); call it before backward or after step"
            )
        super().zero_grad(set_to_none)  # type: ignore[misc]

    # -- hooks and reductions ---------------------------------------------------------------

    def _hook(self, p: torch.Tensor) -> None:
        if self._delay[p] <= 0:
            raise ValueError(
                "gradients were computed more than backward_passes_per_step times before "
                "optimizer.step(); raise backward_passes_per_step to accumulate locally"
            )
        self._pending = True
        self._delay[p] -= 1
        if self._delay[p] > 0:
            return
        group = self._group_of.get(p)
        if group is None:
            self._handles[p] = self._allreduce_one(p)
            return
        self._ready[group].add(p)
        if len(self._ready[group]) == len(self._groups[group]):
            self._handles[("group", group)] = self._allreduce_group(group)

    def _allreduce_one(self, p: torch.Tensor) -> tuple[int, Any]:
        compressed, ctx = self._compression.compress(_dense_grad(p))
        prescale, postscale = self._scale
        handle = allreduce_async_(
            compressed, name=self._names[p], op=self.op, prescale_factor=prescale, postscale_factor=postscale
        )
        return handle, ctx

    def _allreduce_group(self, group: int) -> tuple[int, Any]:
        compressed = [self._compression.compress(_dense_grad(p)) for p in self._groups[group]]
        prescale, postscale = self._scale
        handle = grouped_allreduce_async_(
            [t for t, _ in compressed],
            name=f"group.{group}",
            op=self.op,
            prescale_factor=prescale,
            postscale_factor=postscale,
        )
        return handle, [ctx for _, ctx in compressed]


def _dense_grad(p: torch.Tensor) -> torch.Tensor:
    """``p.grad``, made dense, or zeros where no gradient arrived (the other ranks may have one)."""
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    elif p.grad.is_sparse:
        p.grad = p.grad.to_dense()
    return p.grad


def _parameter_names(
    params: list[torch.Tensor], named_parameters: Iterable[tuple[str, torch.Tensor]] | None
) -> dict[torch.Tensor, str]:
    if named_parameters is None:
        return {p: f"allreduce.noname.{i}" for i, p in enumerate(params)}
    named = list(named_parameters)
    if any(not isinstance(item, tuple) or len(item) != 2 for item in named):
        raise ValueError("named_parameters must be (name, parameter) pairs; pass model.named_parameters()")
    names = [name for name, _ in named]
    if len(set(names)) != len(names):
        raise ValueError("named_parameters holds a name twice; parameter names must be unique")
    by_param = {p: name for name, p in named}
    unnamed = sum(p not in by_param for p in params)
    if unnamed:
        raise ValueError(
            f"named_parameters does not name {unnamed} of the optimizer's parameters; pass "
            f"model.named_parameters() of the model whose parameters the optimizer holds"
        )
    return by_param


def _split_groups(
    params: list[torch.Tensor], groups: int | list[list[torch.Tensor]] | None
) -> list[list[torch.Tensor]]:
    """Horovod's ``groups``: a count splits the parameters into that many consecutive groups."""
    if groups is None:
        return []
    if isinstance(groups, int):
        if groups < 1:
            raise ValueError(f"groups={groups} must be a positive number or lists of parameters")
        count = min(groups, len(params))
        bounds = [round(i * len(params) / count) for i in range(count + 1)] if count else [0]
        return [params[a:b] for a, b in zip(bounds, bounds[1:])]
    wanted = set(params)
    return [[p for p in group if p in wanted] for group in groups if any(p in wanted for p in group)]
