"""Calibration's per-trial law table: the kernels compute dense output and counts [B, T, 2] for every trial.

Two kinds of trials (plugins/vllm/context.py):

- scale factors sf_t: λ_t = sf_t / n, i.e. a table of ln sf_t for both phases and γ = 1 (fixed per engine);
- served laws (one `Law` per trial): ln λ_t = c_t − γ_t·ln n folded per sequence every step from its law length,
  with γ = 0 in the kernels' length exponents.
"""

from __future__ import annotations

import torch


class CalibrationTrials:
    """The trial table of one planner, rebuilt when the engine's trials change."""

    def __init__(self, capacity: int, device: torch.device) -> None:
        self.capacity, self.device = capacity, device
        self.table: torch.Tensor | None = None  # [capacity, T, 2] float32
        self._laws: tuple[torch.Tensor, torch.Tensor] | None = None  # (c [T, 2], γ [T, 2]) of law trials
        self._key = None

    def refresh(self, context, law_rows) -> None:
        """Rebuild the table for the context's trials, if they changed since the last step."""
        key = (id(context), context.version)
        if key == self._key:
            return
        if context.trial_laws:
            c = torch.tensor([law.c for law in context.trial_laws], dtype=torch.float32, device=self.device)
            gamma = torch.tensor([law.gamma for law in context.trial_laws], dtype=torch.float32, device=self.device)
            self._laws = (c, gamma)
            self.table = torch.zeros(self.capacity, len(context.trial_laws), 2, device=self.device)
            law_rows.for_trials(0.0)
        else:
            log_sf = torch.tensor(context.trial_log_scale_factors(), dtype=torch.float32)
            self.table = log_sf[None, :, None].expand(self.capacity, -1, 2).contiguous().to(self.device)
            self._laws = None
            law_rows.for_trials(1.0)
        self._key = key

    def forget(self) -> None:
        """Serving took over the buffers: the next calibration step rebuilds."""
        self._key = None

    def fill(self, law_lens: torch.Tensor, b: int) -> torch.Tensor:
        """The step's table [B, T, 2]; law trials folded with each sequence's law length.

        Every row of a sequence in this step has the sequence's law length, except in a chunk that recomputes a
        preempted request's prompt and generated tokens (its generated rows then get the prompt's length): exact
        for fidelity measurements, which never preempt.
        """
        table = self.table[:b]
        if self._laws is not None:
            c, gamma = self._laws
            log_n = law_lens[:b].clamp(min=1).to(torch.float32).log()
            torch.sub(c[None], gamma[None] * log_n[:, None, None], out=table)
        return table
