"""transformers integration: skip-softmax attention registered in `AttentionInterface` under one name.

A model opts in with `model.set_attn_implementation(ATTN_IMPLEMENTATION)`; no model code is patched. The registered
function runs per attention module: a module without enabled sparse state (or not converted at all) takes
transformers' own sdpa path unchanged; an enabled module turns HF's K/V (`[B, Hkv, kv_len, D]` after the cache update)
into paged views and calls the same `paged_skip_softmax_attention` kernel the vLLM plugin serves with, so HF
calibration counts are the counts vLLM serving skips.

Logit soft-capping (Gemma 2's `softcap`) and attention sinks (gpt-oss: transformers passes the module's `sinks` as
`s_aux`) are applied by the kernels. A disabled module whose model passes sinks takes a dense path with the sinks
(transformers' sdpa function would drop them), so disabling a layer never changes its attention.

Not supported (clear errors naming the model / attention class): padded batches or any mask other than plain
causal, sliding window, non-causal attention, attention dropout, paged caches.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import logging
import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from modelopt_ext.torch.kernels.sparsity.attention import paged_skip_softmax_attention
from modelopt_ext.torch.kernels.sparsity.attention.reference import softmax_with_sinks

from ..checkpoint.config_io import PHASES, PhaseCalibration
from ..checkpoint.law import Law, PhaseLaw

logger = logging.getLogger(__name__)

ATTN_IMPLEMENTATION = "modelopt_ext_skip_softmax"
"""Name under which the attention function (and sdpa's mask builder) are registered in transformers."""

STATE_ATTR = "_modelopt_ext_sparse_attn"
"""Attribute holding a module's `SparseAttentionState` (plain Python state: no parameters, no state_dict keys)."""

TRITON_PAGE_SIZE = 64
"""Page size of the K/V views for the Triton backend (a power of two >= 16, compiled in; equals TILE_K)."""


class UnsupportedModelError(ValueError):
    """The model or one of its attention modules uses a feature skip-softmax attention does not implement."""


@dataclass
class SparseAttentionState:
    """Per-module sparse attention settings, calibration and counters."""

    name: str
    enabled: bool = True
    threshold: dict[str, float | None] = field(default_factory=lambda: {p: None for p in PHASES})
    calibration: dict[str, PhaseCalibration | None] = field(default_factory=lambda: {p: None for p in PHASES})
    backend: str = "auto"
    collect_stats: bool = True
    # Realized counts per phase: int64 [2] tensors (visited, skipped), kept on the device (no host sync).
    stats: dict[str, torch.Tensor | None] = field(default_factory=lambda: {p: None for p in PHASES})
    # Set by calibration: receives [B, T, 2] counts for the trials instead of serving thresholds.
    collector: Any = None

    def threshold_for(self, phase: str, kv_len: int) -> float | None:
        """λ of a row of this phase whose law length is `kv_len` (for reports; the kernel computes it per row)."""
        law = self.law_for(phase)
        lam = None if law.is_dense else math.exp(law.c - law.gamma * math.log(max(kv_len, 1)))
        return lam if lam is not None and lam < 1.0 else None

    def law_for(self, phase: str) -> PhaseLaw:
        """The phase's law (docs/skip_softmax.md: ln λ_row = c − γ·ln(n); c = -inf means dense).

        Calibrated: the calibration's (c, γ), as vLLM serves it; a static λ: c = ln λ, γ = 0.
        """
        cal = self.calibration.get(phase)
        if cal is not None:
            return PhaseLaw.of(cal)
        lam = self.threshold.get(phase)
        if lam is None or not 0.0 < lam < 1.0:
            return PhaseLaw(-math.inf, 0.0)
        return PhaseLaw(math.log(lam), 0.0)

    def add_stats(self, phase: str, counts: torch.Tensor) -> None:
        total = counts.sum(dim=(0, 1))
        prev = self.stats.get(phase)
        self.stats[phase] = total if prev is None else prev + total.to(prev.device)

    def realized_sparsity(self, phase: str) -> float | None:
        stats = self.stats.get(phase)
        if stats is None:
            return None
        visited, skipped = (int(x) for x in stats.tolist())
        return skipped / visited if visited else None

    def reset_stats(self) -> None:
        self.stats = {p: None for p in PHASES}


# ---------------------------------------------------------------------------------------------- paged K/V views


def _uniform_paged_view(x: torch.Tensor, page: int) -> tuple[torch.Tensor, int] | None:
    """Zero-copy [num_blocks, page, Hkv, D] view of x [B, Hkv, kv, D] with pages of sequence b at b*M + p.

    Possible when kv % page == 0 and the batch stride is a multiple of one page of tokens; returns (view, M).
    """
    batch, hkv, kv_len, d = x.shape
    if kv_len % page:
        return None
    sb, sh, st, sd = x.stride()
    block_stride = page * st
    pages = kv_len // page
    if batch > 1 and (block_stride == 0 or sb % block_stride):
        return None
    per_seq = sb // block_stride if batch > 1 else pages
    num_blocks = (batch - 1) * per_seq + pages
    # The view's last element must stay inside x's storage (true for any layout where x itself fits).
    last = x.storage_offset() + (num_blocks - 1) * block_stride + (page - 1) * st + (hkv - 1) * sh + (d - 1) * sd
    if last >= x.untyped_storage().nbytes() // x.element_size():
        return None
    view = x.as_strided((num_blocks, page, hkv, d), (block_stride, st, sh, sd))
    return view, per_seq


def hf_kv_as_paged(
    key: torch.Tensor, value: torch.Tensor, page_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Turn HF K/V [B, Hkv, kv_len, D] into paged views [num_blocks, page, Hkv, D] and a shared block table.

    `page_size=None` uses one page per sequence (page = kv_len): always a zero-copy view, for the torch backend.
    A fixed page size (the Triton backend compiles it in) is zero-copy when kv_len is a page multiple and K and V
    share a page layout (always for B == 1); otherwise both are packed into a padded contiguous buffer.
    """
    batch, _, kv_len, _ = key.shape
    device = key.device
    if page_size is None:
        table = torch.arange(batch, dtype=torch.int32, device=device).unsqueeze(1)
        return key.transpose(1, 2), value.transpose(1, 2), table
    pages = -(-kv_len // page_size)
    k_view = _uniform_paged_view(key, page_size)
    v_view = _uniform_paged_view(value, page_size)
    if k_view is not None and v_view is not None and (batch == 1 or k_view[1] == v_view[1]):
        per_seq = k_view[1]
        table = (torch.arange(batch, device=device).unsqueeze(1) * per_seq + torch.arange(pages, device=device)).to(
            torch.int32
        )
        return k_view[0], v_view[0], table

    def pack(x: torch.Tensor) -> torch.Tensor:
        _, hkv, _, d = x.shape
        buf = x.new_zeros(batch, pages * page_size, hkv, d)
        buf[:, :kv_len] = x.transpose(1, 2)
        return buf.view(batch * pages, page_size, hkv, d)

    table = torch.arange(batch * pages, dtype=torch.int32, device=device).view(batch, pages)
    return pack(key), pack(value), table


# ------------------------------------------------------------------------------------------------ support checks


def _where(module: nn.Module) -> str:
    state = getattr(module, STATE_ATTR, None)
    name = f" ({state.name})" if state is not None and state.name else ""
    return f"{type(module).__name__}{name}"


def check_module_supported(module: nn.Module, hf_config: Any = None) -> None:
    """Raise `UnsupportedModelError` when an attention module uses a feature the kernel does not implement."""
    cls = type(module).__name__
    cfg = hf_config if hf_config is not None else getattr(module, "config", None)
    if getattr(module, "is_causal", True) is False:
        raise UnsupportedModelError(f"{cls}: non-causal attention is not supported by skip-softmax attention")
    sliding = getattr(module, "sliding_window", None)
    if sliding is None and cfg is not None and getattr(cfg, "sliding_window", None) is not None:
        layer_types = getattr(cfg, "layer_types", None)
        idx = getattr(module, "layer_idx", None)
        uses_window = getattr(cfg, "use_sliding_window", True)
        if layer_types is not None and idx is not None and idx < len(layer_types):
            uses_window = layer_types[idx] == "sliding_attention"
        if uses_window:
            sliding = cfg.sliding_window
    if sliding is not None:
        raise UnsupportedModelError(
            f"{cls}: sliding-window attention (window {sliding}) is not supported; disable sparse attention for "
            "these layers (mtsa.disable_sparse_attention(model, pattern)) or use a full-attention model"
        )
    sinks = getattr(module, "sinks", None)
    if sinks is not None and not (isinstance(sinks, torch.Tensor) and sinks.dim() == 1 and sinks.is_floating_point()):
        raise UnsupportedModelError(f"{cls}: attention sinks must be a 1-D float tensor (one logit per query head), "
                                    f"got {type(sinks).__name__}")  # fmt: skip


def _check_call(module, query, key, attention_mask, dropout, is_causal, kwargs) -> None:
    where = _where(module)
    if dropout and dropout > 0:
        raise UnsupportedModelError(f"{where}: attention dropout ({dropout}) is not supported; call model.eval()")
    if is_causal is False or getattr(module, "is_causal", True) is False:
        raise UnsupportedModelError(f"{where}: non-causal attention is not supported by skip-softmax attention")
    for kw, what in (("sliding_window", "sliding-window attention"), ("position_bias", "position-bias attention")):
        if kwargs.get(kw) is not None:
            raise UnsupportedModelError(f"{where}: {what} is not supported by skip-softmax attention")
    if kwargs.get("cache") is not None:
        raise UnsupportedModelError(f"{where}: transformers' paged (continuous batching) cache is not supported")
    if kwargs.get("output_attentions"):
        raise UnsupportedModelError(f"{where}: output_attentions=True is not supported (no attention weights)")
    if key.shape[2] < query.shape[2]:
        raise UnsupportedModelError(f"{where}: fewer keys ({key.shape[2]}) than queries ({query.shape[2]})")
    if attention_mask is not None:
        _check_plain_causal(module, attention_mask, query.shape[2], key.shape[2])


# The last mask proven plain causal (masks are shared by all layers of a forward): skip re-checking it.
_last_ok_mask: weakref.ref | None = None


def _check_plain_causal(module: nn.Module, mask: torch.Tensor, q_len: int, kv_len: int) -> None:
    """Accept only masks equal to the causal-suffix pattern (what the kernel implements); padding is an error."""
    global _last_ok_mask
    if _last_ok_mask is not None and _last_ok_mask() is mask:
        return
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4 or mask.shape[-2:] != (q_len, kv_len):
        raise UnsupportedModelError(f"{_where(module)}: unsupported attention mask {type(mask).__name__}")
    allowed = mask if mask.dtype == torch.bool else mask == 0
    rows = torch.arange(q_len, device=mask.device).unsqueeze(1) + (kv_len - q_len)
    expected = torch.arange(kv_len, device=mask.device).unsqueeze(0) <= rows
    if not bool((allowed == expected).all()):
        raise UnsupportedModelError(
            f"{_where(module)}: the attention mask is not plain causal (a padded batch, a static cache or a custom "
            "mask). Skip-softmax attention needs unpadded sequences: run batch size 1 or equal-length prompts "
            "without padding, with a DynamicCache"
        )
    _last_ok_mask = weakref.ref(mask)


# ------------------------------------------------------------------------------------------ the attention function


def _sdpa_forward() -> Callable:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


def skip_softmax_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: query [B, Hq, q, D], key/value [B, Hkv, kv, D] -> ([B, q, Hq, D], None)."""
    state: SparseAttentionState | None = getattr(module, STATE_ATTR, None)
    sinks = _sinks_of(module, kwargs)
    if state is None or not state.enabled:
        if sinks is not None:  # transformers' sdpa function ignores `s_aux`: the sinks' own dense path
            return dense_attention_with_sinks(module, query, key, value, attention_mask, sinks, dropout=dropout,
                                              scaling=scaling, softcap=kwargs.get("softcap")), None  # fmt: skip
        return _sdpa_forward()(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    _check_call(module, query, key, attention_mask, dropout, is_causal, kwargs)
    out, counts = run_skip_softmax(state, query, key, value, scaling, softcap=kwargs.get("softcap"), sinks=sinks)
    return out, None


def _sinks_of(module: nn.Module, kwargs: dict) -> torch.Tensor | None:
    """The attention sinks of this call: transformers' `s_aux` keyword (gpt-oss passes its `sinks` so), else the
    module's own `sinks` parameter; None for a model without sinks."""
    sinks = kwargs.get("s_aux")
    return sinks if sinks is not None else getattr(module, "sinks", None)


def dense_attention_with_sinks(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    sinks: torch.Tensor,
    *,
    dropout: float = 0.0,
    scaling: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Dense attention whose softmax denominator also holds one sink logit per query head (docs/skip_softmax.md,
    "The softmax with a sink"), for modules that do not run sparse: query [B, Hq, q, D], key/value [B, Hkv, kv, D],
    `attention_mask` as the sdpa mask builder makes it (boolean: True = attend; additive float; None: causal,
    queries the last q positions) -> [B, q, Hq, D]. Scores are soft-capped (never the sinks) when `softcap` is set."""
    _, hq, q_len, d = query.shape
    hkv, kv_len = key.shape[1], key.shape[2]
    if hq % hkv:
        raise UnsupportedModelError(f"{_where(module)}: {hq} query heads do not group over {hkv} KV heads")
    if sinks.shape != (hq,):
        raise UnsupportedModelError(f"{_where(module)}: sinks of shape {tuple(sinks.shape)}, expected [{hq}]")
    group = hq // hkv
    k = key.repeat_interleave(group, dim=1)
    v = value.repeat_interleave(group, dim=1)
    scale = float(scaling) if scaling is not None else d**-0.5
    scores = torch.matmul(query, k.transpose(2, 3)) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if attention_mask is None:
        rows = torch.arange(q_len, device=query.device).unsqueeze(1) + (kv_len - q_len)
        attention_mask = torch.arange(kv_len, device=query.device).unsqueeze(0) <= rows
    if attention_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attention_mask, float("-inf"))
    else:
        scores = scores + attention_mask.to(scores.dtype)
    probs = softmax_with_sinks(scores, sinks.view(1, hq, 1, 1))
    if dropout and module.training:
        probs = nn.functional.dropout(probs, p=dropout)
    return torch.matmul(probs.to(value.dtype), v).transpose(1, 2).contiguous()


_PROMPT: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar("modelopt_ext_prompt", default=None)
_REQUEST_IDS = itertools.count()


@contextlib.contextmanager
def prompt_length(num_tokens: int):
    """Tell the attention the prompt length while a prompt is prefilled in chunks (and its tokens decoded).

    transformers' `generate` runs a prompt whole, where the kernel's default (q_len > 1 is all prompt) is exact;
    a caller that cuts the prompt into chunks wraps the whole request in this, so every row gets the λ of its
    phase and length exactly as vLLM serves it (docs/skip_softmax.md, "λ of a row").
    """
    token = _PROMPT.set((int(num_tokens), next(_REQUEST_IDS)))
    try:
        yield
    finally:
        _PROMPT.reset(token)


def run_skip_softmax(
    state: SparseAttentionState,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Call the kernel on HF-layout tensors; returns ([B, q, Hq, D], counts or None) and records stats/calibration.
    `softcap`: the model's logit soft-cap (transformers passes Gemma 2's `attn_logit_softcapping` as `softcap`);
    `sinks`: the module's attention sinks ([Hq], gpt-oss's `s_aux`), in the softmax denominator and the skip test."""
    batch, hq, q_len, d = query.shape
    kv_len = key.shape[2]
    prompt = _PROMPT.get()
    request = None if prompt is None else prompt[1]
    prompt_len = kv_len - 1 if q_len == 1 else kv_len
    if prompt is not None:
        prompt_len = prompt[0]
    # A call's phase (for statistics and calibration records) is its first row's; n is the law's length.
    phase = "decode" if kv_len - q_len >= prompt_len else "prefill"
    law_len = kv_len if phase == "decode" else prompt_len
    scale = float(scaling) if scaling is not None else d**-0.5
    on_triton = query.is_cuda and state.backend != "torch"
    k_view, v_view, table = hf_kv_as_paged(key, value, TRITON_PAGE_SIZE if on_triton else None)
    q = query.transpose(1, 2).reshape(batch * q_len, hq, d)
    device = query.device
    cu = torch.arange(0, batch + 1, dtype=torch.int32, device=device) * q_len
    seq_lens = torch.full((batch,), kv_len, dtype=torch.int32, device=device)
    prompt_lens = torch.full((batch,), prompt_len, dtype=torch.int32, device=device)
    common = dict(softmax_scale=scale, backend=state.backend, prompt_lens=prompt_lens, logits_soft_cap=softcap,
                  sinks=sinks)
    if state.collector is not None:
        if state.collector.law is None:
            # Trials as scale factors with ModelOpt's law (γ = 1): λ_t = sf_t / n for every row of both phases.
            log_sf = torch.tensor([[math.log(sf)] * 2 for sf in state.collector.scale_factors], dtype=torch.float32)
            gamma = torch.ones(2)
        else:
            # Per-trial laws ((c_prefill, c_decode), (γ_prefill, γ_decode)): every row of this call has the same
            # phase and law length, so each trial folds into a plain ln λ (γ = 0) exactly.
            log_n = math.log(max(law_len, 1))
            log_sf = torch.tensor(
                [[c[i] - g[i] * log_n for i in range(2)] for c, g in state.collector.law], dtype=torch.float32
            )
            gamma = torch.zeros(2)
        out, counts = paged_skip_softmax_attention(
            q, k_view, v_view, table, cu, seq_lens, log_scale_factors=log_sf.to(device).expand(batch, -1, 2),
            length_exponents=gamma.to(device), **common,
        )  # fmt: skip
        state.collector.add(phase, law_len, counts, request=request)
    else:
        served = Law(state.law_for("prefill"), state.law_for("decode"))
        law = dict(
            log_scale_factors=torch.tensor([served.c], dtype=torch.float32, device=device).expand(batch, 2),
            length_exponents=torch.tensor(served.gamma, dtype=torch.float32, device=device),
        )
        result = paged_skip_softmax_attention(
            q, k_view, v_view, table, cu, seq_lens, return_skip_counts=state.collect_stats, **law, **common
        )
        out, counts = result if state.collect_stats else (result, None)
        if counts is not None:
            state.add_stats(phase, counts)
    return out.view(batch, q_len, hq, d), counts


_registered = False


def register_attention() -> str:
    """Register the attention function and sdpa's mask builder under `ATTN_IMPLEMENTATION` (idempotent)."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionInterface.register(ATTN_IMPLEMENTATION, skip_softmax_attention_forward)
        # Same masks as sdpa: None for plain causal batches (kernel path), explicit masks for the sdpa fallback.
        AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
        _registered = True
    return ATTN_IMPLEMENTATION


# -------------------------------------------------------------------------------------------- model-level helpers


def is_hf_model(model: nn.Module) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover
        return False
    return isinstance(model, PreTrainedModel)


def find_attention_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Attention modules of a transformers model: classes named `*Attention` that carry a `layer_idx`."""
    return {
        name: m
        for name, m in model.named_modules()
        if type(m).__name__.endswith("Attention") and hasattr(m, "layer_idx") and hasattr(m, "config")
    }


def check_model_supported(model: nn.Module) -> None:
    """Raise `UnsupportedModelError` unless `model` is a transformers model whose attention uses the interface."""
    if not is_hf_model(model):
        raise UnsupportedModelError(
            f"{type(model).__name__} is not a transformers PreTrainedModel; skip-softmax sparse attention for "
            "PyTorch models works through transformers' attention interface (use a Hugging Face causal LM)"
        )
    if not type(model)._can_set_attn_implementation():
        raise UnsupportedModelError(
            f"{type(model).__name__}: its attention does not dispatch through transformers' AttentionInterface, "
            "so skip-softmax attention cannot be plugged in"
        )


def set_model_attention(model: nn.Module) -> str | None:
    """Route the model's attention through `ATTN_IMPLEMENTATION`; returns the implementation it had before."""
    check_model_supported(model)
    previous = model.config._attn_implementation
    register_attention()
    if previous != ATTN_IMPLEMENTATION:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    if model.config._attn_implementation != ATTN_IMPLEMENTATION:
        raise UnsupportedModelError(f"{type(model).__name__}: could not set attn_implementation={ATTN_IMPLEMENTATION}")
    return previous


def restore_model_attention(model: nn.Module, implementation: str | None) -> None:
    """Put the model back on the attention implementation it had before conversion (sdpa by default)."""
    if is_hf_model(model):
        model.set_attn_implementation(implementation or "sdpa")
