"""The sparse attention impls: subclasses of vLLM's native impls whose forward skips key tiles (serve) or counts
skippable tiles (calibrate), and the per-layer state they carry.

    FlashInferImpl          -> ModelOptSparseFlashInferImpl
    FlashAttentionImpl      -> ModelOptSparseAttentionImpl
    CPUAttentionBackendImpl -> ModelOptSparseCPUAttentionImpl

Each keeps the native impl's initialised state (it is cloned from it) and its K/V cache write path.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from modelopt_ext.torch.kernels.sparsity.attention import paged_skip_softmax_attention

from .sparse_attn_config import SparseAttentionSettings
from .vllm_compat import cpu_native_write_op, vllm_facts
from .vllm_kv_cache import (
    CPU_KNOWN_ISAS,
    _cpu_attn_kv_cache_views,
    _flash_attn_kv_cache_views,
    _flashinfer_kv_cache_views,
    write_kv_cache,
    write_kv_through_views,
)
from .vllm_plan import PLAN_ATTR, SparsePlan, plan_from_backend_metadata

logger = logging.getLogger(__name__)

_STATE_ATTR = "_modelopt_sparse"


def _native(kind: str, role: str):
    native = vllm_facts().native(kind)
    return getattr(native, role) if native is not None else None


FlashInferImpl, FlashInferBackend = _native("flashinfer", "impl"), _native("flashinfer", "backend")
FlashAttentionImpl, FlashAttentionBackend = _native("flash_attn", "impl"), _native("flash_attn", "backend")
CPUAttentionBackendImpl, CPUAttentionBackend = _native("cpu_attn", "impl"), _native("cpu_attn", "backend")

# ---------------------------------------------------------------------------------------------------------------
# Per-layer state


@dataclass
class _LayerState:
    """What one sparse impl needs besides the native state: settings, mode and its measurements."""

    layer_name: str
    mode: str
    settings: SparseAttentionSettings | None
    kernel_backend: str
    scale_factor_trials: tuple[float, ...]
    track_sparsity: bool
    writes_in_forward: bool
    kv_first: bool | None = None  # FlashAttention 5D caches only
    phase_counts: torch.Tensor | None = None  # [2 phases (prefill, decode), 2 (visited, skipped)] int64
    records: list = field(default_factory=list)  # calibration: (counts [B,T,2], kv_lens [B], is_decode [B])
    kv_writes: int = 0
    checked_isa: str | None = None

    @property
    def scale_factors(self) -> tuple[float | None, float | None]:
        s = self.settings
        if s is None:
            return None, None
        return (s.prefill.scale_factor if s.prefill else None, s.decode.scale_factor if s.decode else None)

    @property
    def always_dense(self) -> bool:
        return self.mode == "serve" and self.scale_factors == (None, None)

    def same_config(self, other: _LayerState) -> bool:
        keys = ("mode", "settings", "kernel_backend", "scale_factor_trials", "track_sparsity", "writes_in_forward")
        return all(getattr(self, k) == getattr(other, k) for k in keys)


_LOGGED: set[str] = set()


def _log_once(key: str, msg: str, *args) -> None:
    if key not in _LOGGED:
        _LOGGED.add(key)
        logger.info(msg, *args)


# ---------------------------------------------------------------------------------------------------------------
# The shared sparse forward


class _SparseImplMixin:
    """Sparse forward and cache write shared by the three sparse impls (placed before the native impl in the MRO)."""

    _modelopt_native: type  # the native impl class

    # -- cache layout ---------------------------------------------------------------------------------------
    def _modelopt_views(self, layer, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _modelopt_cache_dtype(self) -> str:
        for name in ("cache_dtype", "kv_cache_dtype"):
            value = getattr(self, name, None)
            if isinstance(value, str):
                return value
        return "auto"

    def _modelopt_write(self, layer, key, value, kv_cache, slot_mapping) -> None:
        k_view, v_view = self._modelopt_views(layer, kv_cache)
        write_kv_cache(
            key,
            value,
            k_view,
            v_view,
            slot_mapping,
            self._modelopt_cache_dtype(),
            getattr(layer, "_k_scale", None),
            getattr(layer, "_v_scale", None),
        )

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        """The K/V write vLLM calls before forward when the backend's forward does not include it."""
        if self.kv_sharing_target_layer_name is not None or key is None or value is None:
            return
        self._modelopt_write(layer, key, value, kv_cache, slot_mapping)
        getattr(self, _STATE_ATTR).kv_writes += 1

    # -- forward --------------------------------------------------------------------------------------------
    def _modelopt_native_forward(
        self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale
    ):
        kwargs = {"output": output}
        if output_scale is not None:
            kwargs["output_scale"] = output_scale
        if output_block_scale is not None:
            kwargs["output_block_scale"] = output_block_scale
        return self._modelopt_native.forward(self, layer, query, key, value, kv_cache, attn_metadata, **kwargs)

    def _modelopt_plan(self, attn_metadata) -> SparsePlan:
        return plan_from_backend_metadata(attn_metadata)

    def forward(
        self, layer, query, key, value, kv_cache, attn_metadata, output=None, output_scale=None, output_block_scale=None
    ):
        """Serving: skip tiles at each sequence's λ; calibration: dense output plus per-trial tile counts."""
        state: _LayerState = getattr(self, _STATE_ATTR)
        native = (layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale)
        if attn_metadata is None:  # profiling / warm-up run
            return self._modelopt_native_forward(*native)
        if state.always_dense:
            _log_once(
                f"dense-{state.layer_name}",
                "sparse attention: %s has no calibrated phase; running the native %s forward",
                state.layer_name,
                self._modelopt_native.__name__,
            )
            return self._modelopt_native_forward(*native)
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("sparse attention does not support fused output quantization")
        plan = self._modelopt_plan(attn_metadata)
        calibrate = state.mode == "calibrate"
        if not calibrate and plan.is_dense(*state.scale_factors):
            _log_once(
                "dense-step",
                "sparse attention: steps where every sequence has λ >= 1 run the native "
                "attention forward (logged once)",
            )
            return self._modelopt_native_forward(*native)

        if (
            state.writes_in_forward
            and self.kv_sharing_target_layer_name is None
            and key is not None
            and value is not None
        ):
            self._modelopt_write(layer, key, value, kv_cache, attn_metadata.slot_mapping)
            state.kv_writes += 1

        n = int(attn_metadata.num_actual_tokens)
        if output is None:
            output = torch.empty(query.shape[0], self.num_heads, self.head_size, dtype=query.dtype, device=query.device)
        out3 = output if output.dim() == 3 else output.view(output.shape[0], self.num_heads, -1)
        q = query[:n]
        if q.dim() == 2:
            q = q.view(n, self.num_heads, self.head_size)
        q = q.contiguous()
        k_view, v_view = self._modelopt_views(layer, kv_cache)
        args = (q, k_view, v_view, plan.block_table, plan.query_start_loc, plan.seq_lens)
        common = {
            "softmax_scale": self.scale,
            "out": out3,
            "backend": state.kernel_backend,
            "max_seqlen_k": plan.max_seq_len,
        }
        if calibrate:
            _, counts = paged_skip_softmax_attention(
                *args, threshold_trials=plan.trial_thresholds(state.scale_factor_trials), **common
            )
            kv_lens, is_decode = _record_keys(plan)
            state.records.append((counts, kv_lens, is_decode))
        else:
            result = paged_skip_softmax_attention(
                *args,
                skip_threshold=plan.thresholds(*state.scale_factors),
                return_skip_counts=state.track_sparsity,
                **common,
            )
            if state.track_sparsity:
                _accumulate(state, result[1][:, 0, :], plan.is_decode())
        return output


def _record_keys(plan: SparsePlan) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_lens and phases of this step, copied once per step (vLLM reuses its buffers) and shared by layers."""
    keys = plan._cache.get("record_keys")
    if keys is None:
        keys = (plan.seq_lens.clone(), plan.is_decode().clone())
        plan._cache["record_keys"] = keys
    return keys


def _accumulate(state: _LayerState, counts: torch.Tensor, is_decode: torch.Tensor) -> None:
    """Add [B, 2] serving counts into per-phase totals on the device (no host sync)."""
    dec = is_decode.to(counts.dtype).unsqueeze(1)
    step = torch.stack([(counts * (1 - dec)).sum(0), (counts * dec).sum(0)])
    state.phase_counts = step if state.phase_counts is None else state.phase_counts + step


# ---------------------------------------------------------------------------------------------------------------
# The three sparse impls


if FlashInferImpl is not None:

    class ModelOptSparseFlashInferImpl(_SparseImplMixin, FlashInferImpl):
        """FlashInferImpl whose attention skips tiles (serve) or counts skippable tiles (calibrate)."""

        _modelopt_native = FlashInferImpl

        def _modelopt_views(self, layer, kv_cache):
            return _flashinfer_kv_cache_views(kv_cache, self.head_size)

        def _modelopt_plan(self, attn_metadata):
            plan = getattr(attn_metadata, PLAN_ATTR, None)
            if plan is None:
                raise RuntimeError(
                    "FlashInfer metadata carries no sparse plan: FlashInferMetadataBuilder.build is not wrapped in "
                    "this process. Call install_sparse_attention (or wrap_flashinfer_metadata_builder) in the worker "
                    "process before the first step."
                )
            return plan
else:  # pragma: no cover - depends on the installed vLLM
    ModelOptSparseFlashInferImpl = None


if FlashAttentionImpl is not None:

    class ModelOptSparseAttentionImpl(_SparseImplMixin, FlashAttentionImpl):
        """FlashAttentionImpl whose attention skips tiles (serve) or counts skippable tiles (calibrate)."""

        _modelopt_native = FlashAttentionImpl

        def _modelopt_views(self, layer, kv_cache):
            return _flash_attn_kv_cache_views(kv_cache, self.head_size, getattr(self, _STATE_ATTR).kv_first)
else:  # pragma: no cover
    ModelOptSparseAttentionImpl = None

if CPUAttentionBackendImpl is not None:

    class ModelOptSparseCPUAttentionImpl(_SparseImplMixin, CPUAttentionBackendImpl):
        """vLLM CPU-attention impl whose attention skips tiles (serve) or counts skippable tiles (calibrate)."""

        _modelopt_native = CPUAttentionBackendImpl

        def _modelopt_views(self, layer, kv_cache):
            state = getattr(self, _STATE_ATTR)
            isa = getattr(layer, "isa", None) or getattr(self, "isa", None)
            if isa != state.checked_isa:
                if isa is None:
                    raise RuntimeError(
                        f"layer {state.layer_name} has no CPU attention ISA yet (vLLM's CPU metadata builder sets "
                        "layer.isa); the sparse CPU impl cannot tell the cache layout"
                    )
                if isa not in CPU_KNOWN_ISAS:
                    raise ValueError(
                        f"layer {state.layer_name}: CPU attention ISA {isa!r} is not supported "
                        f"(supported: {CPU_KNOWN_ISAS})"
                    )
                state.checked_isa = isa
            return _cpu_attn_kv_cache_views(kv_cache, self.head_size, isa)

        def _modelopt_write(self, layer, key, value, kv_cache, slot_mapping):
            if cpu_native_write_op() is not None:
                CPUAttentionBackendImpl.do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping)
                return
            _log_once(
                "cpu-write",
                "torch.ops._C.cpu_attn_reshape_and_cache is unavailable; writing the CPU KV "
                "cache (transposed K) with the torch equivalent",
            )
            k_view, v_view = self._modelopt_views(layer, kv_cache)
            write_kv_through_views(key, value, k_view, v_view, slot_mapping)
else:  # pragma: no cover
    ModelOptSparseCPUAttentionImpl = None


_SPARSE_BY_NATIVE = {
    native: sparse
    for native, sparse in (
        (FlashInferImpl, ModelOptSparseFlashInferImpl),
        (FlashAttentionImpl, ModelOptSparseAttentionImpl),
        (CPUAttentionBackendImpl, ModelOptSparseCPUAttentionImpl),
    )
    if native is not None
}
_SPARSE_CLASSES = tuple(_SPARSE_BY_NATIVE.values())
_BACKEND_BY_NATIVE = {
    native: backend
    for native, backend in (
        (FlashInferImpl, FlashInferBackend),
        (FlashAttentionImpl, FlashAttentionBackend),
        (CPUAttentionBackendImpl, CPUAttentionBackend),
    )
    if native is not None
}

