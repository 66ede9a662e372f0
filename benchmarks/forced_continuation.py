"""Teacher forcing through vLLM's decode: a logits processor that makes a request generate given tokens.

vLLM's `generate` samples its own tokens, so the perplexity of *decode* rows (each token attending to a paged KV
cache that decode steps wrote) cannot be read from `prompt_logprobs`, which come from one prefill. This processor
forces a request's next token to the one listed in its `extra_args["forced_token_ids"]`; with vLLM's default
`logprobs_mode="raw_logprobs"` the logprob returned for that token is computed from the model's logits *before*
any logits processor runs, so `SamplingParams(logprobs=0)` yields the model's own log-probability of each forced
token, decode step by decode step: a teacher-forced decode perplexity, through the engine users serve with.

Benchmarks only (benchmarks/decode_feedback.py). It is loaded by vLLM in the engine process as
`forced_continuation:ForcedContinuation`, so `benchmarks/` must be on that process's PYTHONPATH.
"""

from __future__ import annotations

import torch
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

FORCE_KEY = "forced_token_ids"
FQCN = "forced_continuation:ForcedContinuation"


class ForcedContinuation(AdapterLogitsProcessor):
    """Per request with `extra_args["forced_token_ids"]`: its i-th generated token is that list's i-th entry."""

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        ids = (sampling_params.extra_args or {}).get(FORCE_KEY)
        if ids is None:
            return
        if not isinstance(ids, list) or not all(isinstance(i, int) and i >= 0 for i in ids):
            raise ValueError(f"{FORCE_KEY} must be a list of token ids")
        if sampling_params.max_tokens is not None and sampling_params.max_tokens > len(ids):
            raise ValueError(f"max_tokens={sampling_params.max_tokens} exceeds the {len(ids)} {FORCE_KEY}")

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params):
        ids = (params.extra_args or {}).get(FORCE_KEY)
        if not ids:
            return None
        forced = [int(i) for i in ids]

        def force(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            out = torch.full_like(logits, float("-inf"))
            out[forced[min(len(output_ids), len(forced) - 1)]] = 0.0
            return out

        return force
