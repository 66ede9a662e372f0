"""Each row's served law on the device: the buffers the kernels read, filled from `Law` values by field name.

The kernels read per sequence `log_scale_factors` [B, 2] (c per phase) and `length_exponents` [B, 2] (γ per phase),
phase index 0 prefill, 1 decode (docs/skip_softmax.md). Every row holds the checkpoint's law, except in a step
with requests that set their own targets (plugins/vllm/request_targets.py): then every row's `RequestLaw` is written
from the host, through pinned staging and one non-blocking copy per field. A request with decode feedback
(plugins/vllm/feedback.py) has its decode c moved on the device each step from its base by its request's δ.

The buffers are persistent (sized by the planner's capacity) so a captured CUDA graph replays with the next
step's values; the checkpoint's law is rewritten only when the engine's settings change.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ...checkpoint.law import Law
from .feedback import DecodeFeedback
from .host_staging import pinned

DECODE = 1  # the decode column of the per-phase buffers (0: prefill)


@dataclass(frozen=True)
class RequestLaw:
    """What one request's rows are served with: its law and, when on, its decode feedback."""

    law: Law
    feedback: DecodeFeedback | None = None

    def lowest_law(self) -> Law:
        """The law at its lowest decode c that feedback may reach (the host's dense decision)."""
        return self.law if self.feedback is None else self.feedback.lowest_law(self.law)


class _Staging:
    """One pinned host copy of every field a step writes, by name ([capacity, 2] each)."""

    def __init__(self, capacity: int) -> None:
        block = pinned(torch.zeros(3, capacity, 2, dtype=torch.float32))
        self.c, self.gamma, self.feedback = block.unbind(0)  # feedback: (target, gain) per row


class LawRows:
    """The per-row law buffers of one planner and the host's view of the laws they hold."""

    def __init__(self, capacity: int, device: torch.device) -> None:
        dev = self.device = device
        self.c = torch.full((capacity, 2), -math.inf, dtype=torch.float32, device=dev)  # log_scale_factors
        self.gamma = torch.ones(capacity, 2, dtype=torch.float32, device=dev)  # length_exponents
        self._base_c = torch.zeros(capacity, dtype=torch.float32, device=dev)  # decode c before feedback
        self._feedback = torch.zeros(capacity, 2, dtype=torch.float32, device=dev)  # (target, gain) per row
        # Two staging copies used in turn: with vLLM's async scheduling the host builds step t+1 while the device
        # may still have step t's non-blocking copy pending, which must not see its source overwritten.
        self._staging = [_Staging(capacity) for _ in range(2)]
        self._turn = 0
        self.written: object | None = None  # the per-request rows the buffers hold (None: one law for all)
        self._one_law: Law | None = None
        self.host_laws: tuple[Law, ...] = ()  # the distinct lowest laws of the rows (the host's dense decision)
        self.feedback_on = False

    def fill(self, law: Law) -> None:
        """Every row serves `law` (no-op when it already does)."""
        if self.written is None and law == self._one_law:
            return
        for column, phase in enumerate((law.prefill, law.decode)):
            self.c[:, column] = phase.c
            self.gamma[:, column] = phase.gamma
        self.written, self._one_law, self.feedback_on = None, law, False
        self.host_laws = (law,)

    def for_trials(self, gamma: float) -> None:
        """Calibration: every row's γ is `gamma` (the trial table carries the rest); the next `fill` rewrites all."""
        self.gamma.fill_(gamma)
        self.written, self._one_law, self.feedback_on, self.host_laws = None, None, False, ()

    def write(self, rows: Sequence[RequestLaw], b: int) -> None:
        """Rows 0..b-1 serve `rows` (one per row; the same sequence object again is a no-op)."""
        if rows is self.written:
            return
        staging = self._staging[self._turn]
        self._turn ^= 1
        laws = [row.law for row in rows[:b]]
        staging.c[:b] = torch.tensor([law.c for law in laws], dtype=torch.float32).view(b, 2)
        staging.gamma[:b] = torch.tensor([law.gamma for law in laws], dtype=torch.float32).view(b, 2)
        self.c[:b].copy_(staging.c[:b], non_blocking=True)
        self.gamma[:b].copy_(staging.gamma[:b], non_blocking=True)
        feedback = [(f.target, f.gain) if (f := row.feedback) is not None else (0.0, 0.0) for row in rows[:b]]
        self.feedback_on = any(gain for _, gain in feedback)
        if self.feedback_on:
            staging.feedback[:b] = torch.tensor(feedback, dtype=torch.float32).view(b, 2)
            self._feedback[:b].copy_(staging.feedback[:b], non_blocking=True)
            self._base_c[:b].copy_(self.c[:b, DECODE])
        self.written, self._one_law = rows, None
        self.host_laws = tuple({row.lowest_law() for row in rows[:b]})

    def apply_feedback(self, counters, b: int) -> None:
        """Decode c of every row = its base + its request's δ (device ops; rows without feedback have gain 0)."""
        target, gain = self._feedback[:b, 0], self._feedback[:b, 1]
        offsets = counters.decode_offsets(b, gain, target)
        torch.add(self._base_c[:b], offsets, out=self.c[:b, DECODE])

    def can_drop(self, longest: int) -> bool:
        """Whether any row of a step whose sequences are at most `longest` long may drop a tile (host values)."""
        return any(law.can_drop(longest) for law in self.host_laws)
