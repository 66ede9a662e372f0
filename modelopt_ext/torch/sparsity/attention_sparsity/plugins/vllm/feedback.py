"""Decode feedback, in one place: what a request asks for, what it may move, and the device update that moves it.

A request with `sparse_attn_decode_feedback` on (docs/serving.md) gets an offset δ on its decode c
(ln λ = c + δ − γ·ln n), updated on the device once per step from the request's own decode counts of the previous
step (plugins/vllm/request_stats.py keeps them): δ += η·b·(target − realized), bounded by |δ| ≤ 0.3·b, where b is the
decode law's slope (∂c/∂target, so b·error is the correction the law itself predicts) and η = 0.3 smooths
token-to-token noise. It depends only on the request's own history, so a request's tokens still do not depend on
the batch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ...checkpoint.law import Law
from ...request_keys import FEEDBACK_KEY, RequestTargetError

FEEDBACK_RATE = 0.3  # η: the share of the law's predicted correction applied per step
FEEDBACK_BOUND = 0.3  # |δ| <= FEEDBACK_BOUND·b: at most this much sparsity-equivalent shift of the law
_TRUE, _FALSE = ("1", "true", "on", "yes"), ("0", "false", "off", "no")


@dataclass(frozen=True)
class DecodeFeedback:
    """A request's decode feedback: the decode target it holds and the law's slope b (its gain)."""

    target: float
    gain: float

    @property
    def bound(self) -> float:
        """The most δ may move c, either way."""
        return FEEDBACK_BOUND * abs(self.gain)

    def lowest_law(self, law: Law) -> Law:
        """The law with decode c at its lowest reachable value (c − bound): what the host's dense decision must
        assume, since δ moves on the device."""
        return Law(law.prefill, law.decode.shifted(-self.bound))


def feedback_requested(extra_args: Mapping[str, Any] | None) -> bool:
    """Whether a request turns decode feedback on (`sparse_attn_decode_feedback`: a bool, 0/1 or a string)."""
    raw = (extra_args or {}).get(FEEDBACK_KEY, False)
    text = str(raw).strip().lower() if isinstance(raw, (str, bool, int)) and not isinstance(raw, float) else None
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise RequestTargetError(f"{FEEDBACK_KEY}={raw!r}: expected true or false")


def decode_feedback(extra_args, decode_target: float | None, law: Law, settings) -> DecodeFeedback | None:
    """The request's feedback (None when off). `decode_target`: the request's own decode target, else None for the
    checkpoint's. RequestTargetError when feedback has no calibrated, non-dense decode target to hold."""
    if not feedback_requested(extra_args):
        return None
    calib = settings.decode if settings is not None else None
    target = decode_target if decode_target is not None else (calib.target_sparsity if calib is not None else None)
    if calib is None or calib.a == 0.0 or calib.is_static or target is None or not math.isfinite(law.decode.c):
        raise RequestTargetError(f"{FEEDBACK_KEY}: feedback holds a decode target, and this request's decode is "
                                 "served dense or the checkpoint calibrates no decode law; drop the key or set "
                                 "sparse_attn_decode_target")
    return DecodeFeedback(float(target), float(calib.b))


class FeedbackState:
    """Each request slot's δ on the device, and the decode counts it last saw (fixed addresses: graph-safe)."""

    def __init__(self, slots: int, device: torch.device) -> None:
        self.offset = torch.zeros(slots, dtype=torch.float32, device=device)
        self._prev_decode = torch.zeros(slots, 2, dtype=torch.int64, device=device)
        self._step_decode = torch.zeros(slots, 2, dtype=torch.int64, device=device)

    def forget(self, slot: int) -> None:
        """A request left: its slot starts from δ = 0 for the next one."""
        self._prev_decode[slot].zero_()
        self.offset[slot].zero_()

    def resume(self, slot: int, decode_counts: torch.Tensor) -> None:
        """A request returns with counts kept elsewhere: no spurious step from them."""
        self._prev_decode[slot].copy_(decode_counts, non_blocking=True)

    def offsets(self, decode_table: torch.Tensor, slots: torch.Tensor, gain: torch.Tensor,
                target: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """Update the δ of each row's request from its decode counts of the previous step (`decode_table`:
        [slots, (visited, skipped)]) and return the rows' δ [B]. Device ops only. Called by every planner of a step:
        the first call takes the step's counts, later ones see none and change nothing."""
        torch.sub(decode_table, self._prev_decode, out=self._step_decode)
        self._prev_decode.copy_(decode_table)
        step = self._step_decode.index_select(0, slots).to(torch.float32)  # [B, (visited, skipped)]
        visited = step[:, 0]
        realized = step[:, 1] / visited.clamp(min=1.0)
        change = gain * FEEDBACK_RATE * (target - realized) * (visited > 0)
        bound = gain * FEEDBACK_BOUND
        rows = torch.minimum(torch.maximum(self.offset.index_select(0, slots) + change, -bound), bound)
        self.offset.index_copy_(0, slots, rows)  # one row per request; padding rows (gain 0) write 0 to overflow
        return rows
