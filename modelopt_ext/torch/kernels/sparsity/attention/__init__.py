"""Paged skip-softmax attention kernels: one semantics (docs/skip_softmax.md), a PyTorch reference and Triton."""

from .api import paged_skip_softmax_attention, triton_available
from .semantics import DECODE_SPLIT_TOKENS, SPLIT_TOKENS, TILE_K, TILE_Q

__all__ = [
    "DECODE_SPLIT_TOKENS",
    "SPLIT_TOKENS",
    "TILE_K",
    "TILE_Q",
    "paged_skip_softmax_attention",
    "triton_available",
]
