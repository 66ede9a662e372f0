"""Each row's served law on the device: the buffers the kernels read, filled from `Law` values by field name.

One packed tensor [3, capacity, 2] holds every field by plane (`PLANES`): the kernels read its c plane as
`log_scale_factors` [B, 2] and its γ plane as `length_exponents` [B, 2] (phase index 0 prefill, 1 decode;
docs/skip_softmax.md), decode feedback its (target, gain) plane. Every row holds the checkpoint's law, except in a
step with requests that set their own targets (plugins/vllm/request_targets.py): then every row's `RequestLaw` is
staged by field name in pinned host memory and the packed tensor is written with one non-blocking copy. A request
with decode feedback (plugins/vllm/feedback.py) has its decode c moved on the device each step from its base by its
request's δ.

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


PLANES = ("c", "gamma", "feedback")
"""The fields of the packed law tensor [3, capacity, 2], by plane: c and γ per phase (what the kernels read as
`log_scale_factors` and `length_exponents`), and decode feedback's (target, gain) per row."""


def _planes(packed: torch.Tensor) -> dict[str, torch.Tensor]:
    return dict(zip(PLANES, packed.unbind(0), strict=True))


class LawRows:
    """The per-row law buffers of one planner and the host's view of the laws they hold."""

    def __init__(self, capacity: int, device: torch.device) -> None:
        self.packed = torch.zeros(len(PLANES), capacity, 2, dtype=torch.float32, device=device)
        planes = _planes(self.packed)
        self.c, self.gamma, self._feedback = planes["c"], planes["gamma"], planes["feedback"]
        self.c.fill_(-math.inf)
        self.gamma.fill_(1.0)
        self._base_c = torch.zeros(capacity, dtype=torch.float32, device=device)  # decode c before feedback
        # Two pinned host copies used in turn: with vLLM's async scheduling the host builds step t+1 while the
        # device may still have step t's non-blocking copy pending, which must not see its source overwritten.
        self._staging = [pinned(torch.zeros(len(PLANES), capacity, 2, dtype=torch.float32)) for _ in range(2)]
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
        """Rows 0..b-1 serve `rows` (one per row; the same sequence object again is a no-op): every field of every
        row staged by name, then one non-blocking copy of the packed tensor."""
        if rows is self.written:
            return
        staging = self._staging[self._turn]
        self._turn ^= 1
        host = _planes(staging)
        host["c"][:b] = torch.tensor([row.law.c for row in rows[:b]], dtype=torch.float32).view(b, 2)
        host["gamma"][:b] = torch.tensor([row.law.gamma for row in rows[:b]], dtype=torch.float32).view(b, 2)
        feedback = [(f.target, f.gain) if (f := row.feedback) is not None else (0.0, 0.0) for row in rows[:b]]
        host["feedback"][:b] = torch.tensor(feedback, dtype=torch.float32).view(b, 2)
        self.packed[:, :b].copy_(staging[:, :b], non_blocking=True)
        self.feedback_on = any(gain for _, gain in feedback)
        if self.feedback_on:
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
