"""Where a vLLM step's per-request prompt lengths come from (docs/skip_softmax.md: a row's phase and λ length).

The per-row law needs each request's prompt length, not the chunk's kv_len: a row at absolute position `pos` is a
prefill row iff `pos < prompt_len`. vLLM's attention builders do not get it in `CommonAttentionMetadata` (0.33 has
`is_prefilling`, a bool for the first new row, and `rswa_prefix_lens` only for R-SWA models), but the model runner
that builds the batch has it, per request, on the host:

- model runner V1 (`gpu_model_runner.GPUModelRunner`; the CPU runner subclasses it; 0.16 - 0.33):
  `runner.input_batch.num_prompt_tokens` (numpy, per persistent-batch row); metadata row i is batch row i.
- model runner V2 (`v1/worker/gpu/model_runner.py`, the default on GPU in 0.33): `runner.req_states.prompt_len`
  (numpy, or a UVA-backed tensor's `.np`) per request-table slot; `CommonAttentionMetadata.req_idx` (0.33) maps
  metadata rows to slots.

Both are the user's prompt length: a request resumed after preemption keeps it (V2 calls the recomputed length
`prefill_len >= prompt_len`), so its recomputed generated tokens stay decode rows with `n = pos + 1`, exactly as
when they were first generated. Speculative-decoding verification rows lie past the prompt: decode rows.

Not reachable, and then the kernel's default is used (`q_len > 1`: all prompt, `prompt_len = kv_len`; `q_len == 1`:
decode, `prompt_len = kv_len - 1`; right for unchunked prefill and plain decode, wrong for a chunked prompt's
earlier chunks and for spec-decode verification): model runner V2 of releases whose metadata has no `req_idx`
(< 0.33, where V2 is opt-in), micro-batching (DBO: the V1 metadata of a micro-batch is a slice whose first row is
not batch row 0), and any install without a runner (tests, direct `install_sparse_attention` on layers).
"""

from __future__ import annotations

import logging

import numpy as np

from .compat import v2_row_slots, v2_row_slots_problem

logger = logging.getLogger(__name__)


class InputBatchPromptLens:
    """Model runner V1: `input_batch.num_prompt_tokens[:num_reqs]` (read each step: the runner may replace its
    input batch when the KV-cache block sizes are final)."""

    name = "input_batch.num_prompt_tokens (model runner V1)"

    def __init__(self, runner) -> None:
        self._runner = runner

    def __call__(self, common_attn_metadata) -> np.ndarray | None:
        batch = self._runner.input_batch
        num_reqs = int(common_attn_metadata.num_reqs)
        live = min(num_reqs, int(batch.num_reqs))
        out = np.zeros(num_reqs, dtype=np.int32)  # rows past the live requests are CUDA-graph padding (q_len 0)
        out[:live] = batch.num_prompt_tokens[:live]
        return out


class RequestStatePromptLens:
    """Model runner V2: `req_states.prompt_len[req_idx]` (the metadata's row -> request-slot map)."""

    name = "req_states.prompt_len[req_idx] (model runner V2)"

    def __init__(self, runner) -> None:
        self._runner = runner

    def __call__(self, common_attn_metadata) -> np.ndarray | None:
        num_reqs = int(common_attn_metadata.num_reqs)
        idx = v2_row_slots(common_attn_metadata, num_reqs)
        if idx is None:
            return None
        prompt_len = self._runner.req_states.prompt_len
        table = getattr(prompt_len, "np", prompt_len)
        out = np.zeros(num_reqs, dtype=np.int32)
        out[: len(idx)] = table[idx]
        return out


def prompt_lens_source(runner, vllm_config=None):
    """`(source, reason)`: a callable `source(common_attn_metadata) -> int32 [num_reqs] | None`, or None and why
    this runner gives no prompt lengths (the kernel's default applies then)."""
    if runner is None:
        return None, "no model runner given (direct install)"
    parallel = getattr(vllm_config, "parallel_config", None)
    if getattr(parallel, "enable_dbo", False) or getattr(parallel, "use_ubatching", False):
        return None, "micro-batching (DBO) slices the batch; metadata rows do not start at batch row 0"
    req_states = getattr(runner, "req_states", None)
    if req_states is not None and hasattr(req_states, "prompt_len"):
        problem = v2_row_slots_problem()
        return (None, problem) if problem else (RequestStatePromptLens(runner), None)
    batch = getattr(runner, "input_batch", None)
    if batch is not None and hasattr(batch, "num_prompt_tokens"):
        return InputBatchPromptLens(runner), None
    return None, f"{type(runner).__name__} has neither input_batch.num_prompt_tokens nor req_states.prompt_len"
