"""What every sparse attention impl shares: the forward that skips key tiles (serve) or counts skippable tiles
(calibrate), the K/V write, and the per-layer state the impl carries.

Each backend module (plugins/vllm/backends/) defines its impl as `class ModelOptSparse...Impl(SparseImplMixin,
<vLLM's native impl>)`: it keeps the native impl's initialised state (install clones it) and its K/V cache write
path. Its forward only runs kernels: the per-step plan is a field of the sparse metadata its builder built
(`modelopt_sparse_plan`), and every reason it could not run was checked at install or when vLLM built the builder.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from modelopt_ext.torch.kernels.sparsity.attention.api import kernel_launcher

from .compat import impl_sinks
from .kv_cache import as_cache_dtype, fp8_view_dtype, write_kv_cache

if TYPE_CHECKING:
    from .context import SparseAttentionContext
    from .plan import SparsePlan

logger = logging.getLogger(__name__)

STATE_ATTR = "_modelopt_sparse"
"""Attribute of a sparse impl that holds its `LayerState`."""


# ---------------------------------------------------------------------------------------------------------------
# Per-layer state


@dataclass(eq=False)
class LayerState:
    """What one sparse impl needs besides the native state: its engine's context, its cache facts, its counts."""

    layer_name: str
    context: SparseAttentionContext
    writes_in_forward: bool  # the backend's forward writes K/V itself (vLLM <= 0.16 FlashInfer)
    kv_first: bool | None = None  # FlashAttention 5D caches only
    native_backend: type | None = None  # the layer's attn_backend before install (restored by uninstall)
    isa: str | None = None  # CPU attention: the ISA the metadata builder chose (checked when it was built)
    softcap: float = 0.0  # the layer's logit soft-cap (Gemma 2; 0: none), applied by the kernels
    sinks: torch.Tensor | None = field(default=None, repr=False)  # float32 contiguous [Hq] (gpt-oss), or None
    phase_counts: torch.Tensor | None = None  # [2 phases (prefill, decode), 2 (visited, skipped)] int64, in place
    records: list = field(default_factory=list)  # calibration: (counts [B,T,2], law_lens [B], is_decode [B])
    kv_writes: int = 0
    views_of: torch.Tensor | None = field(default=None, repr=False)  # the cache tensor `views` were made of
    views: tuple | None = field(default=None, repr=False)  # its (K, V) views, reused every step

    @property
    def runs_sparse(self) -> bool:
        """Whether forward runs the skip-softmax kernel (calibration, or serving with a calibrated phase)."""
        return not self.context.serves_dense


def kernel_sinks(sinks: torch.Tensor | None, current: torch.Tensor | None = None) -> torch.Tensor | None:
    """The layer's attention sinks as the kernels take them: a contiguous float32 [Hq] tensor on the sinks' device
    (docs/skip_softmax.md, version 3), made once per layer (at install, and again only after vLLM reloads weights),
    never per step. vLLM's own tensor when it already is one (FlashInfer's float32 copy, a float32 model's parameter,
    so updates in place reach the kernel); else a float32 copy, refreshed in place into `current` when it has the
    same shape and device."""
    if sinks is None:
        return None
    sinks = sinks.detach()
    if sinks.dtype == torch.float32 and sinks.is_contiguous():
        return sinks
    if (current is not None and current.shape == sinks.shape and current.device == sinks.device
            and current.data_ptr() != sinks.data_ptr()):  # fmt: skip
        return current.copy_(sinks)
    return sinks.to(torch.float32).contiguous()


# ---------------------------------------------------------------------------------------------------------------
# The shared sparse forward


class SparseImplMixin:
    """Sparse forward and cache write shared by the sparse impls (placed before the native impl in the MRO)."""

    _modelopt_native: type  # the native impl class
    writes_with_flash_cache_op = True  # `_modelopt_write` uses vLLM's reshape_and_cache_flash (or its torch twin)

    @classmethod
    def cache_facts(cls, layer, impl, native_backend) -> dict:
        """`LayerState` fields this backend's views need, read once at install from the native impl and backend."""
        return {}

    def fused_output_quant_supported(self, *args, **kwargs) -> bool:
        """Never fuse output quantization into the sparse attention (vLLM then keeps the quant op separate)."""
        return False

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
        getattr(self, STATE_ATTR).kv_writes += 1

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

    def forward(
        self, layer, query, key, value, kv_cache, attn_metadata, output=None, output_scale=None, output_block_scale=None
    ):
        """Serving: drop tiles per row at the row's λ; calibration: dense output plus per-trial tile counts."""
        state: LayerState = getattr(self, STATE_ATTR)
        native = (layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale)
        if attn_metadata is None or not state.runs_sparse:  # profiling run, or no calibrated phase
            return self._modelopt_native_forward(*native)
        plan: SparsePlan = attn_metadata.modelopt_sparse_plan  # the sparse builder's metadata always carries one
        calibrate = state.context.calibrating
        if plan.dense:  # no row can drop a tile this step (a host decision made in build)
            return self._modelopt_native_forward(*native)

        if (
            state.writes_in_forward
            and self.kv_sharing_target_layer_name is None
            and key is not None
            and value is not None
        ):
            self._modelopt_write(layer, key, value, kv_cache, attn_metadata.slot_mapping)
            state.kv_writes += 1

        if output is None:  # vLLM v1 always passes `output`
            output = torch.empty(query.shape[0], self.num_heads, self.head_size, dtype=query.dtype, device=query.device)
        out3 = output if output.dim() == 3 else output.view(output.shape[0], self.num_heads, self.head_size)
        # q and out are read / written only up to the step's last query row (cu_seqlens): no slicing, no copy
        q = query if query.dim() == 3 else query.view(query.shape[0], self.num_heads, self.head_size)
        k_view, v_view = self._modelopt_cached_views(layer, kv_cache, state)
        fp8 = {}
        if fp8_view_dtype(self._modelopt_cache_dtype()) is not None:  # the layer's scales, host floats (vLLM's own)
            fp8 = dict(k_scale=float(layer._k_scale_float), v_scale=float(layer._v_scale_float))
        totals = None
        if not calibrate and state.context.track_sparsity:  # counters accumulate on the device, per phase
            if state.phase_counts is None or state.phase_counts.device != q.device:  # the first step only
                state.phase_counts = torch.zeros(2, 2, dtype=torch.int64, device=q.device)
            totals = (plan.phase_index, state.phase_counts)
        counts = kernel_launcher(state.context.kernel_backend)(
            q, k_view, v_view, plan.block_table, plan.query_start_loc, plan.seq_lens,
            softmax_scale=self.scale, log_sf=plan.kernel_log_sf, gamma=plan.length_exponents,
            prompt_lens=plan.prompt_lens, calibrate=calibrate, out=out3, max_seqlen_k=plan.max_seq_len,
            counts=plan.counts, workspace=plan.workspace, decode_only=plan.decode_only, totals=totals,
            softcap=state.softcap, sinks=state.sinks, **fp8,
        )  # fmt: skip
        if totals is not None and counts is not None and plan.request_index is not None:  # per request (device op)
            plan.request_table.index_add_(0, plan.request_index, counts[:, 0, :])
        if calibrate:
            law_lens, is_decode = plan.record_keys()
            state.records.append((counts, law_lens, is_decode))
        return output

    def process_weights_after_loading(self, act_dtype):
        """vLLM's step after (re)loading weights: the native impl's (FlashInfer refreshes its float32 sinks there),
        then the kernel's sinks follow the loaded values (in place, so a captured graph reads them)."""
        native = getattr(self._modelopt_native, "process_weights_after_loading", None)
        if native is not None:
            native(self, act_dtype)
        state: LayerState = getattr(self, STATE_ATTR)
        state.sinks = kernel_sinks(impl_sinks(self), state.sinks)

    def _modelopt_cached_views(self, layer, kv_cache: torch.Tensor, state) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K/V views as the kernels read them (an FP8 cache's bytes as its FP8 dtype), made once per bound
        cache tensor (vLLM binds it once; views are per layer)."""
        if state.views_of is not kv_cache:
            state.views = as_cache_dtype(self._modelopt_views(layer, kv_cache), self._modelopt_cache_dtype())
            state.views_of = kv_cache
        return state.views


def layer_state(layer) -> LayerState | None:
    """The sparse state of a vLLM attention layer, or None when its impl is native."""
    impl = getattr(layer, "impl", None)
    return getattr(impl, STATE_ATTR, None) if isinstance(impl, SparseImplMixin) else None


def native_impl_cls(impl) -> type:
    """The native impl class a (sparse or native) impl stands for."""
    return type(impl)._modelopt_native if isinstance(impl, SparseImplMixin) else type(impl)
