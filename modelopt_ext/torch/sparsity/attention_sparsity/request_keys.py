"""The per-request keys a client sends in `vllm_xargs` (docs/serving.md) and the error a bad one raises: importable
without vLLM, so clients and benchmarks can name them without loading the vLLM plugin (`plugins/vllm/request_targets.py`
reads them)."""

KEY_PREFIX = "sparse_attn_"
TARGET_KEY = "sparse_attn_target"
PHASE_TARGET_KEYS = {"prefill": "sparse_attn_prefill_target", "decode": "sparse_attn_decode_target"}
FEEDBACK_KEY = "sparse_attn_decode_feedback"
KEYS = (TARGET_KEY, *PHASE_TARGET_KEYS.values(), FEEDBACK_KEY)
DENSE = "dense"


class RequestTargetError(ValueError):
    """A request's sparse-attention keys are malformed or outside what the checkpoint's calibration covers."""
