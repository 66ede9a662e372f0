"""Pinned host memory for the planner's staging buffers (host values copied to the device without blocking)."""

from __future__ import annotations

import torch


def pinned(t: torch.Tensor) -> torch.Tensor:
    """`t` in pinned host memory where CUDA can pin it (non-blocking host-to-device copies), else `t`."""
    try:
        return t.pin_memory() if torch.cuda.is_available() else t
    except RuntimeError:  # pragma: no cover - no pinnable memory
        return t
