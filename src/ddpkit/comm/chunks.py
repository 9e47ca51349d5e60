"""How collectives cut a tensor: a flat contiguous view, split with ``torch.tensor_split``.

``torch.tensor_split(flat, n)`` gives ``n`` contiguous chunks whose sizes differ
by at most one element (the first ``numel % n`` chunks are one larger), so any
tensor size works with any world size, including sizes smaller than ``n``
(trailing chunks are empty) and empty tensors::

    numel = 10, n = 4:   [0 1 2][3 4 5][6 7][8 9]
    numel = 2,  n = 4:   [0][1][][]
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

SEGMENT_BYTES = 1 << 20
"""Target size of one message in pipelined collectives (ring, tree).

A message costs about 150 us of latency through gloo on one host, so
segments must be large enough to amortize it, and small enough that a
tensor of a few MiB still splits into several segments that overlap.
"""

_local = threading.local()


@contextmanager
def flat_view(tensor: torch.Tensor) -> Iterator[torch.Tensor]:
    """Yield a 1-D contiguous tensor aliasing ``tensor``'s elements; write back on exit if it had to copy.

    A contiguous tensor is viewed without a copy. A non-contiguous one is copied
    into a contiguous buffer, and the buffer is copied back when the block ends,
    so in-place collectives work on any strided tensor.

    Args:
        tensor: the tensor a collective updates in place.

    Yields:
        The flat view (or the flat copy).
    """
    if tensor.is_contiguous():
        yield tensor.view(-1)
        return
    flat = tensor.reshape(-1).clone()
    yield flat
    tensor.copy_(flat.view(tensor.shape))


def split(flat: torch.Tensor, num_chunks: int) -> tuple[torch.Tensor, ...]:
    """Split a 1-D tensor into ``num_chunks`` contiguous views whose sizes differ by at most one."""
    return torch.tensor_split(flat, num_chunks)


def offsets(numel: int, num_chunks: int) -> list[int]:
    """Start offsets of the chunks :func:`split` makes, plus ``numel`` at the end (length ``num_chunks + 1``)."""
    base, extra = divmod(numel, num_chunks)
    bounds = [0]
    for i in range(num_chunks):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return bounds


def segments(chunk: torch.Tensor, segment_bytes: int | None = None) -> tuple[torch.Tensor, ...]:
    """Cut a 1-D chunk into pipelining segments of about ``segment_bytes`` (default :data:`SEGMENT_BYTES`).

    Sender and receiver of a chunk call this with the same chunk size and
    dtype, so they agree on every segment without talking.
    """
    segment_numel = max(1, (segment_bytes or SEGMENT_BYTES) // chunk.element_size())
    if chunk.numel() <= segment_numel:
        return (chunk,)  # the common small case, without tensor_split's cost
    return torch.tensor_split(chunk, -(-chunk.numel() // segment_numel))


def workspace(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A scratch tensor of ``numel`` elements, reused across calls in this thread.

    Receive buffers are the only memory the collectives need. Allocating them
    on every call costs page faults on large tensors (the allocator returns
    big blocks to the OS), so each thread keeps its largest buffer per dtype
    and device. One collective call uses at most one workspace at a time.

    Args:
        numel: number of elements needed.
        dtype: element type.
        device: device of the tensor being reduced.

    Returns:
        A 1-D tensor of exactly ``numel`` elements with undefined contents.
    """
    buffers = getattr(_local, "buffers", None)
    if buffers is None:
        buffers = _local.buffers = {}
    buffer = buffers.get((dtype, device))
    if buffer is None or buffer.numel() < numel:
        buffer = buffers[(dtype, device)] = torch.empty(numel, dtype=dtype, device=device)
    return buffer[:numel]
