"""A step's geometry per sequence: prompt length, phase and the law's length n, in persistent device buffers.

- `prompt_lens` [B] int32: the request's prompt length (plugins/vllm/prompt_lens.py says where it comes from; the
  kernel's default rule where vLLM does not expose it: q_len == 1 decodes, longer queries are all prompt). A row at
  `pos < prompt_len` is a prefill row.
- `is_decode` / `phase_index` [B]: decode iff the sequence's first new row is at or past its prompt length.
- `law_lens` [B] int64: n of the law, `prompt_len` for a prefill sequence and `kv_len` for a decode one.

Host prompt lengths go through one of two pinned staging buffers, used in turn (with vLLM's async scheduling the
host builds step t+1 while step t's non-blocking copy may still be pending), and one non-blocking copy; the rest is
device ops, so a captured CUDA graph replays with the next step's values.
"""

from __future__ import annotations

import numpy as np
import torch

from .host_staging import pinned


class StepGeometry:
    """The per-sequence geometry buffers of one planner (see the module docstring)."""

    def __init__(self, capacity: int, device: torch.device) -> None:
        dev = device
        self.prompt_lens = torch.zeros(capacity, dtype=torch.int32, device=dev)
        self.is_decode = torch.zeros(capacity, dtype=torch.bool, device=dev)
        self.phase_index = torch.zeros(capacity, dtype=torch.int64, device=dev)
        self.law_lens = torch.zeros(capacity, dtype=torch.int64, device=dev)
        self._staging = [pinned(torch.zeros(capacity, dtype=torch.int32)) for _ in range(2)]
        self._turn = 0

    def fill(self, context, cam, b: int) -> tuple[str, int]:
        """Fill rows 0..b-1 for this step; returns (where the prompt lengths came from, the longest prompt known on
        the host, 0 when none is)."""
        seq_lens = cam.seq_lens[:b]
        qsl = cam.query_start_loc[: b + 1]
        q_lens = qsl[1:] - qsl[:-1]
        host = context.prompt_lens(cam) if context.prompt_lens is not None else None
        prompt = self.prompt_lens[:b]
        if host is not None:
            staging = self._staging[self._turn][:b]
            self._turn ^= 1
            staging.copy_(torch.from_numpy(np.ascontiguousarray(host[:b], dtype=np.int32)))
            prompt.copy_(staging, non_blocking=True)
            source = getattr(context.prompt_lens, "name", "runner")
            longest_prompt = int(host[:b].max()) if b else 0
        else:  # the kernel's default (docs/skip_softmax.md)
            prompt.copy_(torch.where(q_lens == 1, seq_lens - 1, seq_lens))
            source, longest_prompt = "kernel default", 0
        decode = self.is_decode[:b]
        torch.ge(seq_lens - q_lens, prompt, out=decode)
        self.phase_index[:b].copy_(decode)
        self.law_lens[:b].copy_(torch.where(decode, seq_lens, prompt))
        return source, longest_prompt
