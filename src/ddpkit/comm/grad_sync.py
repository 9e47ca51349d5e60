"""How gradients are synchronised: which all_reduce, and DDP, one flat all_reduce or the manual loop.

``allreduce=auto`` on the CPU takes the shared-memory all_reduce when every
worker is on one node (gloo would move the bytes over TCP loopback), the
hierarchical one (shared memory inside each node, gloo between nodes) when
the job spans nodes with several workers on some, and the backend's built-in
otherwise (one worker per node, or CUDA). Any other name selects an
algorithm of ``ddpkit.comm``.

``grad_sync=auto`` takes ``flat`` (``ddpkit.comm.flat_grads``: gradients as
views of one buffer, one all_reduce after backward) when the gradients fit in
DDP's first bucket, where DDP has a single bucket and so no overlap with
backward to offer, only its per-parameter hooks and copies, and whatever the
size with the shared-memory all_reduce: that one is CPU work on the cores
that the workers' threads already fill (ddpkit gives each worker cores /
workers threads), so DDP's buckets overlap backward with nothing and cost
their copies and hand-offs (on the 2-core VM, 2 workers: W2, 2.4 MB of
gradients, a step 7.75 ms flat against 8.45 ms DDP; MLPs of 12 MB and 40 MB,
10.1 ms against 11.6 ms and 35.9 ms against 40.7-41.3 ms). Otherwise
``ddp`` (the chosen all_reduce as DDP's communication hook, buckets
overlapping backward: nccl on a GPU, gloo between nodes, where the wait is on
the network or the GPU, not on the cores) for larger models, and with
SyncBatchNorm. ``manual`` is the textbook per-parameter loop, kept as a
baseline.

In every mode the gradients are averaged by the time ``backward()`` returns,
so that the training loop stays ``loss.backward(); optimizer.step();
optimizer.zero_grad()`` (``ddpkit.prepare_model`` is the public entry).
DDP does it with its reducer. ``flat`` and ``manual`` register a
post-accumulate-grad hook on every trainable parameter (one bound method for
all of them, which only compares the backward's id); the first to fire in a
backward queues a callback for the end of that backward, as DDP's reducer
does. The callback all-reduces each gradient (manual), or (flat) first
copies into its view every gradient that autograd handed out fresh, points
``.grad`` back at the view, and all-reduces the buffer once::

    backward:  grad of w3 | hook w3        | grad of w2 | hook w2 | ... | end of backward: callback
                            queue callback                                  views <- fresh grads (one copy each)
                                                                            all_reduce(buffer), averaged

After ``optimizer.zero_grad()`` (``set_to_none=True``, torch's default)
every ``.grad`` is None, autograd hands over the gradient it computed (no
allocation of its own), and the callback copies it into the view: one pass
over the gradient bytes. After ``zero_grad(set_to_none=False)`` the views
stay and autograd adds into them in place. Making the views land the
gradients in place after ``set_to_none=True`` too (a forward pre-hook giving
them back, zeroed) was measured slower, not faster: a zeroing pass plus an
in-place add (two reads, one write) costs more than one copy
(``benchmarks/flat-grads-2core-epyc-2026-11-25.md``). Arming the callback
from the hooks rather than from the forward also means that whatever
produced the loss (a submodule called directly, two forwards), every
backward that reaches the parameters ends averaged.

Buffers (BatchNorm's running statistics): with ``flat`` and ``manual``, as
with DDP's default ``broadcast_buffers=True``, rank 0's buffers are copied to
every rank before each forward run with gradients enabled and outside
``no_sync()`` (one broadcast, :mod:`ddpkit.comm.buffers`); a model without
buffers has no such step. Forwards under ``torch.no_grad()`` (evaluation)
use each rank's own, as with DDP.

A parameter that got no gradient since the last ``zero_grad`` counts as zero
on that rank, and after the callback every rank holds the same averaged
gradient for it (zero where no rank used it), so the ranks step alike. (DDP
with its defaults raises on such a parameter instead.)

Gradient accumulation: backwards run inside ``no_sync()`` only accumulate;
the first backward outside it averages everything accumulated. As with DDP,
the switch is the module's ``require_backward_grad_sync`` (:data:`SYNC_FLAG`,
DDP's own attribute, which its ``no_sync()`` turns off for the block and
nanoGPT sets per micro-batch): ``flat`` and ``manual`` keep it on the module
they synchronise and read it once per backward, when its first gradient
arrives (DDP reads it in the forward; a loop that sets it between a forward
and its backward is the only one that tells the two apart). Limits, as
with DDP: every rank runs the same number of backwards; parameters frozen
(``requires_grad=False``) before construction are left out for good; double
backward (``create_graph=True``) and reentrant activation checkpointing
(``use_reentrant=True``, which runs nested backwards) are not supported.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpkit.comm.buffers import broadcast_buffers, has_buffers
from ddpkit.comm.flat_grads import DDP_FIRST_BUCKET_BYTES, FlatGradients, gradient_bytes
from ddpkit.comm.hooks import finish_hook_collectives
from ddpkit.comm.ops import ReduceOp, divide
from ddpkit.distributed import Context, control_device
from ddpkit.env import shared_memory
from ddpkit.log import get_logger

SYNC_FLAG = "require_backward_grad_sync"
"""DDP's attribute that turns the synchronisation of the next backward off (False) and on (True); honoured in
every mode: on the DDP module for ddp, on the module itself for flat, manual and a single worker."""

AllReduce = Callable[..., None]
"""``fn(tensor, op=ReduceOp.SUM, group=None)``, reducing ``tensor`` in place."""

# torch numbers every backward (register_multi_grad_hook keys its state by this id; -1 outside
# backward). A hook that sees a new id is the first of a new backward, also after a backward that
# failed before its end and so never ran its callback. Bound once: the hooks run on every step.
_graph_task_id = torch._C._current_graph_task_id
_queue_callback = torch.autograd.Variable._execution_engine.queue_callback


def choose_allreduce(requested: str, ctx: Context) -> str:
    """The all_reduce algorithm name to use for ``requested``, resolving auto (collective: every rank calls it).

    auto takes shared memory only where its library loads and /dev/shm holds its segment on every rank; else
    gloo's all_reduce (builtin), with one warning per node saying why and the fix.
    """
    if requested != "auto":
        return requested
    if ctx.device.type != "cpu" or ctx.world_size == 1:
        return "builtin"
    if ctx.env.is_single_node:
        candidate = "shm"
    elif ctx.world_size > ctx.env.num_nodes:  # some node holds several ranks: share memory there
        candidate = "hierarchical"
    else:  # one rank per node: nothing to share memory with
        return "builtin"
    from ddpkit.comm import shm

    available = shm.is_available()
    too_small = _shm_too_small(ctx.env.local_world_size) if available else ""
    if _on_every_rank(available and not too_small):
        return candidate
    if not available:
        shm.warn_unavailable_once()
    elif ctx.env.local_rank == 0:  # one line per node: its ranks share one /dev/shm
        why = too_small or "another rank cannot use shared memory (see its warning)"
        get_logger().warning(f"allreduce=auto: using gloo's all_reduce (builtin), not {candidate}: {why}")
    return "builtin"


def _shm_too_small(local_world_size: int) -> str:
    """Why /dev/shm cannot hold the segment of this node's ranks, or "" when it can."""
    from ddpkit.comm.shm import segment_bytes

    space = shared_memory.measure()
    need = segment_bytes(local_world_size)
    if space is None or space.fits(need):
        return ""
    return shared_memory.too_small(f"the shared-memory all_reduce of {local_world_size} workers", need, space)


def _on_every_rank(flag: bool) -> bool:
    """Whether ``flag`` holds on every rank (all ranks must pick the same algorithm, or they wait on each other)."""
    agreed = torch.tensor([int(flag)], dtype=torch.int32, device=control_device())
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    return bool(agreed.item())


def choose_grad_sync(requested: str, model: nn.Module, sync_batchnorm: bool, allreduce: str = "builtin") -> str:
    """The gradient synchronisation mode for ``requested`` (resolving auto for ``model`` and ``allreduce``).

    Args:
        requested: auto, ddp, flat or manual.
        model: the model whose gradients are synchronised.
        sync_batchnorm: SyncBatchNorm layers (DDP only).
        allreduce: the algorithm chosen (:func:`choose_allreduce`).
    """
    if requested != "auto":
        return requested
    if sync_batchnorm:  # torch supports SyncBatchNorm inside DDP only
        return "ddp"
    if allreduce == "shm":
        # The shared-memory all_reduce is CPU work on the cores that the workers' threads already fill
        # (threads = cores / workers): DDP's overlap has no core to run on, and its copies cost more than it hides.
        return "flat"
    return "flat" if gradient_bytes(model) <= DDP_FIRST_BUCKET_BYTES else "ddp"


def wrap_ddp(model: nn.Module, ctx: Context, allreduce: str, all_reduce_fn: AllReduce | None = None) -> DDP:
    """``model`` in torch's DDP, averaging with ``all_reduce_fn`` (default: the algorithm ``allreduce``).

    The backend's built-in all_reduce stays DDP's own; any other goes through a
    communication hook (``ddpkit.comm.hooks``).
    """
    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    ddp = DDP(model, device_ids=device_ids)
    if all_reduce_fn is not None or allreduce != "builtin":
        from ddpkit.comm.hooks import register_allreduce_hook

        register_allreduce_hook(ddp, all_reduce_fn or _resolve(allreduce))
    return ddp


class GradientSync:
    """This worker's part in making every gradient the mean over the workers, by the end of each backward.

    Args:
        model: the model on ``ctx.device`` (with its own weights on every rank: rank 0's are
            broadcast). For mode ddp, the plain model (wrapped here) or a DDP from ``wrap_ddp``.
        ctx: the worker's context.
        allreduce: algorithm name (resolved by choose_allreduce).
        mode: ddp, flat or manual (resolved by choose_grad_sync); ignored for one worker.
        all_reduce_fn: the all_reduce to use instead of the algorithm ``allreduce`` names
            (a benchmark injects one that moves nothing); with ddp it becomes DDP's communication hook.
    """

    def __init__(
        self, model: nn.Module, ctx: Context, allreduce: str, mode: str, *, all_reduce_fn: AllReduce | None = None
    ) -> None:
        self.ctx = ctx
        self.allreduce = allreduce
        self.mode = mode if ctx.world_size > 1 else "none"
        self.nbytes = gradient_bytes(model)  # of the gradients averaged per step
        self.flat: FlatGradients | None = None
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._graph_task = -1  # the backward whose end is already taken care of
        # The module to train, held weakly: prepare_model's registry is keyed by it. What
        # this object wraps itself it also holds (for callers that take it from `.model`).
        self._wrapper: nn.Module | None = None
        if self.mode == "ddp" and not isinstance(model, DDP):
            model = self._wrapper = wrap_ddp(model, ctx, allreduce, all_reduce_fn)
        self._model = weakref.ref(model)
        if not isinstance(model, DDP) and not hasattr(model, SYNC_FLAG):
            setattr(model, SYNC_FLAG, True)  # DDP's attribute and default, read by _on_gradient
        if self.mode not in ("flat", "manual"):
            return
        from ddpkit.comm.hooks import broadcast_parameters

        broadcast_parameters(model)  # start from rank 0's weights, as DDP does
        if has_buffers(model):  # BatchNorm's statistics: rank 0's before each forward, as DDP's broadcast_buffers
            model.register_forward_pre_hook(self._before_forward)
        self._all_reduce = all_reduce_fn or _resolve(allreduce)
        if self.mode == "flat":
            # ddpkit's algorithms average in the reduction (AVG); gloo's built-in and an injected function may not.
            averaging = all_reduce_fn is None and allreduce != "builtin"
            self.flat = FlatGradients(model, self._all_reduce, averaging=averaging)
            self.nbytes = self.flat.nbytes
        for param in self._params:
            param.register_post_accumulate_grad_hook(self._on_gradient)

    @property
    def model(self) -> nn.Module:
        """The module to train: DDP's wrapper for mode ddp, else the model itself."""
        model = self._model()
        assert model is not None, "the module this GradientSync synchronises no longer exists"
        return model

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Backwards inside only accumulate gradients; the next backward outside averages them."""
        model = self.model
        return model.no_sync() if isinstance(model, DDP) else no_sync_of(model)

    def describe(self) -> str:
        """One line for the start-up log."""
        if self.mode == "none":
            return "single worker: no gradient synchronisation"
        return (
            f"gradients: {self.mode} of {self.nbytes / 1024:.0f} KiB with all_reduce={self.allreduce} "
            f"over {self.ctx.backend}"
        )

    # -- flat and manual: hooks and the end-of-backward callback --------------------

    def _on_gradient(self, param: torch.Tensor) -> None:
        """After a gradient is accumulated: in the first of a backward, have its end synchronise (unless accumulating)."""
        if _graph_task_id() != self._graph_task:
            self._graph_task = _graph_task_id()
            if getattr(self._model(), SYNC_FLAG, True):  # DDP's switch (no_sync() sets it False)
                _queue_callback(self._average_flat if self.flat is not None else self._average_each)

    def _before_forward(self, module: nn.Module, args: object) -> None:
        """Give every rank rank 0's buffers before a forward that will synchronise, when DDP would."""
        if torch.is_grad_enabled() and getattr(module, SYNC_FLAG, True):
            broadcast_buffers(module)

    def _average_flat(self) -> None:
        assert self.flat is not None
        finish_hook_collectives()  # a DDP model's buckets of this backward first, on every rank
        self.flat.take_back_views()  # autograd's fresh gradients (after zero_grad's set_to_none) copied in
        self.flat.reduce_buffers()

    def _average_each(self) -> None:
        finish_hook_collectives()  # a DDP model's buckets of this backward first, on every rank
        world_size = self.ctx.world_size
        for param in self._params:
            if param.grad is None:  # unused here; maybe used on another rank, which waits for this one
                param.grad = torch.zeros_like(param)
            self._all_reduce(param.grad, op=ReduceOp.SUM)
            divide(param.grad, world_size)


@contextlib.contextmanager
def no_sync_of(model: nn.Module) -> Iterator[None]:
    """DDP's ``no_sync()`` for a module that is not DDP: :data:`SYNC_FLAG` off for the block, then as it was."""
    previous = getattr(model, SYNC_FLAG, True)
    setattr(model, SYNC_FLAG, False)
    try:
        yield
    finally:
        setattr(model, SYNC_FLAG, previous)


def _resolve(name: str) -> AllReduce:
    if name == "builtin":
        return dist.all_reduce
    from ddpkit.comm.registry import resolve_allreduce

    return resolve_allreduce(name)
