"""Gradient compression for the all_reduce: ``Compression.none`` and ``Compression.fp16``, as in Horovod.

A compressor turns a tensor into the one that travels (``compress``) and
the result back into the original dtype (``decompress``). fp16 halves the
bytes moved for float32/float64 gradients, at float16's precision (about
three significant digits; values beyond 65504 overflow to inf).
"""

from __future__ import annotations

from typing import Any

import torch


class Compressor:
    """Interface: ``compress(tensor) -> (tensor, ctx)``, ``decompress(tensor, ctx) -> tensor``."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """The tensor to send, and what decompress needs."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """The received tensor in the original form."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Send the tensor as it is."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """``tensor`` itself."""
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """``tensor`` itself."""
        return tensor


class FP16Compressor(Compressor):
    """Send floating-point tensors as float16; others as they are."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """A float16 copy of a floating-point ``tensor``, and its dtype."""
        if tensor.dtype.is_floating_point:
            return tensor.to(torch.float16), tensor.dtype
        return tensor, tensor.dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """``tensor`` back in the dtype ``compress`` saw."""
        return tensor.to(ctx) if ctx.is_floating_point else tensor


class Compression:
    """The compressors by Horovod's names."""

    none = NoneCompressor
    """No compression."""
    fp16 = FP16Compressor
    """float16 on the wire for floating-point tensors."""
