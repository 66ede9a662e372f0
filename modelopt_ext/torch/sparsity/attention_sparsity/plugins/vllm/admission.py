"""Per-request targets checked at admission, through vLLM's public per-request validation hook.

vLLM validates each request's `SamplingParams` before it reaches the engine, and runs there the `validate_params`
classmethod of every custom logits processor in `model_config.logits_processors`; a ValueError becomes an HTTP 400
on the OpenAI server and a ValueError from `LLM.generate`, and the engine never sees the request. The plugin adds one
such processor (whose logits work is nothing) to every engine that serves a checkpoint with a
`sparse_attention_config` block, when vLLM creates that engine's config (plugins/vllm/entry.py), so a malformed or
uncovered per-request target (plugins/vllm/request_targets.py) is refused at once, naming the key and the fix.

`validate_params` receives only the request's params, so the checkpoint's settings are kept per process here by
`enable_admission_checks` (the process that created the engine config is the one that admits its requests). With
several sparse engines in one process a target must be valid for each of them.

Model runner V2 (vLLM's GPU default from 0.33, its only GPU runner from 0.34) takes processors of another
interface, and keeps no request's SamplingParams where the plan could read them. There the processor also carries
the params to the worker: its sampler calls `add_request(slot, params)` on each new request, and the processor
records the extra_args per request-table slot (`request_rows.v2_slot_args`), which the plan reads through the
metadata's `req_idx`. V2 builds its sampler only on the last pipeline stage, so with pipeline parallelism a request
that sets a target is refused at admission, never served silently at the checkpoint's target on the other stages;
where this vLLM still has model runner V1 the refusal names the switch that serves it (VLLM_USE_V2_MODEL_RUNNER=0).
Which interfaces exist is detected (`compat.logits_processor_interfaces`): 0.34 has no V1 interface.
"""

from __future__ import annotations

import logging

import torch

from ...checkpoint.config_io import SparseAttentionSettings
from .compat import logits_processor_interfaces
from .request_rows import v2_slot_args
from .request_targets import RequestTargetError, request_law_of, requested_targets

logger = logging.getLogger(__name__)

_DISABLED = "disabled"
_SETTINGS: list = []  # per process: the settings of each sparse engine created here (or _DISABLED)
_V1_INTERFACE, _V2_INTERFACE = logits_processor_interfaces()
if _V1_INTERFACE is not None:
    _V2_PP_REFUSAL = ("per-request sparse-attention targets with pipeline parallelism need vLLM's model runner V1 "
                      "(model runner V2 hands request parameters only to the last stage); start the server with "
                      "VLLM_USE_V2_MODEL_RUNNER=0, or drop the sparse_attn_* keys")
else:  # vLLM 0.34+: no model runner V1 to switch to
    _V2_PP_REFUSAL = ("per-request sparse-attention targets are not served with pipeline parallelism on this vLLM "
                      "(its model runner V2 hands request parameters only to the last stage, and it has no model "
                      "runner V1): drop the sparse_attn_* keys, or serve without pipeline parallelism")


def _check(sampling_params) -> None:
    extra = getattr(sampling_params, "extra_args", None)
    if not _SETTINGS or requested_targets(extra) is None:  # parses the keys: a typo is refused here
        return
    for settings in _SETTINGS:
        if settings == _DISABLED:
            raise RequestTargetError("sparse attention is switched off on this server (MODELOPT_EXT_SPARSE_ATTN=0): "
                                     "drop the sparse_attn_* keys, or serve with the plugin on")
        request_law_of(extra, settings)


def _v1_class():
    """The V1-interface processor, defined only where vLLM has the interface (up to 0.33)."""
    if _V1_INTERFACE is None:
        return None

    class SparseAttentionTargets(_V1_INTERFACE):
        """Model runner V1: checks per-request targets at admission; leaves logits untouched."""

        @classmethod
        def validate_params(cls, sampling_params) -> None:
            _check(sampling_params)

        def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
            pass

        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            return logits

        def is_argmax_invariant(self) -> bool:
            return True

        def update_state(self, batch_update) -> None:
            pass

    SparseAttentionTargets.__qualname__ = SparseAttentionTargets.__name__  # vLLM loads it by module:qualname
    return SparseAttentionTargets


SparseAttentionTargets = _v1_class()


def _v2_classes():
    """The V2-interface processors, defined only where vLLM has the interface."""
    if _V2_INTERFACE is None:  # releases whose model runner V2 takes no custom processors
        return None, None
    _V2LogitsProcessor = _V2_INTERFACE

    class SparseAttentionTargetsV2(_V2LogitsProcessor):
        """Model runner V2: checks per-request targets at admission and, in the worker, records each new request's
        extra_args per request slot for the plan; leaves logits untouched."""

        @classmethod
        def validate_params(cls, sampling_params) -> None:
            _check(sampling_params)

        def __init__(self, vllm_config, req_states) -> None:
            self._slot_args = v2_slot_args(req_states)

        def add_request(self, req_idx: int, sampling_params) -> bool:
            self._slot_args[int(req_idx)] = getattr(sampling_params, "extra_args", None)
            return False  # no logits work for this request

        def apply(self, logits: torch.Tensor, ctx) -> torch.Tensor:
            return logits

    class SparseAttentionTargetsV2Staged(_V2LogitsProcessor):
        """Model runner V2 with pipeline parallelism: refuses per-request targets at admission (see above)."""

        @classmethod
        def validate_params(cls, sampling_params) -> None:
            if requested_targets(getattr(sampling_params, "extra_args", None)) is not None:
                raise RequestTargetError(_V2_PP_REFUSAL)

        def add_request(self, req_idx: int, sampling_params) -> bool:
            return False

        def apply(self, logits: torch.Tensor, ctx) -> torch.Tensor:
            return logits

    for cls in (SparseAttentionTargetsV2, SparseAttentionTargetsV2Staged):
        cls.__qualname__ = cls.__name__  # vLLM loads them by module:qualname
    return SparseAttentionTargetsV2, SparseAttentionTargetsV2Staged


SparseAttentionTargetsV2, SparseAttentionTargetsV2Staged = _v2_classes()


def _fqcn(cls) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def admission_problem(vllm_config) -> str | None:
    """Why this engine cannot check per-request targets at admission (None: it can)."""
    model_config = vllm_config.model_config
    if getattr(model_config, "runner_type", "generate") == "pooling":
        return "a pooling model takes no logits processors"
    if getattr(vllm_config, "speculative_config", None) is not None:
        return "vLLM refuses custom logits processors with speculative decoding"
    if SparseAttentionTargets is None and SparseAttentionTargetsV2 is None:
        return "this vLLM has neither custom logits-processor interface the plugin knows (model runner V1's or V2's)"
    return None


def enable_admission_checks(vllm_config, settings: SparseAttentionSettings | None) -> bool:
    """Check this engine's per-request targets at admission (`settings` None: the plugin is switched off, and any
    target is refused). Returns False, with one log line, where vLLM has no such hook for this engine."""
    problem = admission_problem(vllm_config)
    if problem is not None:
        logger.warning("per-request sparse-attention targets are not checked at admission (%s): the worker checks "
                       "them, and serves a request whose keys are invalid at the checkpoint's targets, with a warning",
                       problem)  # fmt: skip
        return False
    entry = _DISABLED if settings is None else settings
    if entry not in _SETTINGS:
        _SETTINGS.append(entry)
    cls = SparseAttentionTargets
    # model runner V2: where the config says so (0.29 - 0.33), or where V1 and its interface are gone (0.34)
    if SparseAttentionTargetsV2 is not None and (cls is None or getattr(vllm_config, "use_v2_model_runner", False)):
        staged = getattr(getattr(vllm_config, "parallel_config", None), "pipeline_parallel_size", 1) > 1
        cls = SparseAttentionTargetsV2Staged if staged else SparseAttentionTargetsV2
    model_config = vllm_config.model_config
    processors = list(model_config.logits_processors or ())
    if not any(p is cls or p == _fqcn(cls) for p in processors):
        model_config.logits_processors = [*processors, _fqcn(cls)]
    return True


def disable_admission_checks() -> None:
    """Forget the settings of this process (tests; `entry.unregister`)."""
    _SETTINGS.clear()
