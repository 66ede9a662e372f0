"""Sparse attention backends and metadata builders: vLLM's own roles, filled by subclasses of the native ones.

vLLM asks each attention layer for its backend class (`layer.get_attn_backend()`, i.e. `layer.attn_backend`) when
the engine builds its KV cache: the backend's `get_builder_cls()` gives the metadata builder of the layer's group,
the builders' `get_cudagraph_support()` decide the CUDA-graph mode, and `get_supported_kernel_block_sizes()` the
page size. Install (plugins/vllm/install.py) sets a layer's `attn_backend` to the sparse backend of its native one
and its `impl` to the sparse impl, right after the model loads and before the KV cache exists:

    FlashInferBackend      -> ModelOptSparseFlashInferBackend      (builder ModelOptSparseFlashInferMetadataBuilder)
    FlashAttentionBackend  -> ModelOptSparseFlashAttentionBackend  (builder ModelOptSparseFlashAttentionMetadataBuilder)
    CPUAttentionBackend    -> ModelOptSparseCPUAttentionBackend    (builder ModelOptSparseCPUAttentionMetadataBuilder)

(`register_backend` would override a backend for every engine of the process, and vLLM caches its selection; the
per-layer attribute is what vLLM reads after construction, per engine, and uninstall restores it.)

The builders run the native `build` unchanged and attach the step's `SparsePlan` (plugins/vllm/plan.py); they plan
from the engine context of their layers, never from a process-wide registry. They declare:

- CUDA graphs (plugins/vllm/cudagraphs.py): full graphs for uniform decode batches (at most
  `UNIFORM_SINGLE_TOKEN_DECODE`, never more than the native builder) when the engine serves sparse on a CUDA device
  with the Triton kernel and the start-up self-test passes; `NEVER` otherwise (vLLM then resolves its default
  `FULL_AND_PIECEWISE` to `PIECEWISE`), the native builder's support when the engine serves dense. The decision
  and the CUDA-graph mode vLLM chose are logged once per engine.
- no cascade attention (the sparse kernel reads each sequence's whole paged cache), no in-place block-table update
  of built metadata (the plan is built in `build`), no draft-decode metadata refresh without `build`.
- page sizes (plugins/vllm/kernel_pages.py): where CUDA runs the Triton kernel, only the kernel block sizes it
  covers (powers of two >= 16), so vLLM's block-size selection plans a covered page size; a builder whose page size
  is not covered refuses at start-up. The CPU builder sets its group's ISA to one whose cache layout the kernels
  read (`amx` -> `vec`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import torch

from .compat import vllm_facts
from .cudagraphs import decide as decide_cudagraphs
from .cudagraphs import graph_path
from .impls import (
    _STATE_ATTR,
    ModelOptSparseAttentionImpl,
    ModelOptSparseCPUAttentionImpl,
    ModelOptSparseFlashInferImpl,
    layer_state,
)
from .kernel_pages import TRITON_PAGE_SIZES, covered_kernel_block_sizes, kernel_page_problem
from .kv_cache import cpu_isa_problem
from .plan import PLAN_ATTR, SparsePlanner

logger = logging.getLogger(__name__)

BUILDER_MARK = "_modelopt_sparse_builder"
"""Set on a vLLM attention layer once a sparse metadata builder covers it (so a later install may make it sparse)."""


def _context_of(layers):
    """The sparse context the layers share (one per engine), or None when none of them is sparse."""
    for layer in layers:
        state = layer_state(layer) if hasattr(layer, "impl") else None
        if state is not None:
            return state.context
    return None


def _engine_context_of(vllm_config):
    """The sparse context of an engine's layers, found through its static forward context."""
    return _context_of((getattr(vllm_config.compilation_config, "static_forward_context", {}) or {}).values())


class _SparseBuilderMixin:
    """What the three sparse builders add to their native builder (placed before it in the MRO)."""

    supports_update_block_table = False  # the plan is built in build(); never patch built metadata in place
    supports_draft_decode_metadata_update = False

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec):
        """Full graphs for uniform decode when sparse decode is capture-safe here (module docstring), else NEVER."""
        native = super().get_cudagraph_support(vllm_config, kv_cache_spec)
        context = _engine_context_of(vllm_config)
        if context is None or graph_path(context) == "dense":
            return native  # every forward is the native one
        cg = vllm_facts().cg_support
        if decide_cudagraphs(vllm_config, kv_cache_spec, context).full:
            return native if native.value <= cg.UNIFORM_SINGLE_TOKEN_DECODE.value else cg.UNIFORM_SINGLE_TOKEN_DECODE
        return cg.NEVER

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device, *args, **kwargs):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device, *args, **kwargs)
        forward_context = getattr(vllm_config.compilation_config, "static_forward_context", {}) or {}
        self._modelopt_layers = [forward_context[n] for n in layer_names if n in forward_context]
        for layer in self._modelopt_layers:
            setattr(layer, BUILDER_MARK, True)
        scheduler = getattr(vllm_config, "scheduler_config", None)
        self._modelopt_planner = SparsePlanner(getattr(scheduler, "max_num_seqs", None) or 256, device)
        self._modelopt_graph_bound = None  # max_model_len when uniform decode steps may run in full graphs
        self._modelopt_graph_sizes = 0  # the largest batch vLLM captures
        self._modelopt_check_startup(kv_cache_spec)
        self._modelopt_prepare_graphs(vllm_config, kv_cache_spec)

    def _modelopt_context(self):
        return _context_of(self._modelopt_layers)

    def _modelopt_check_startup(self, kv_cache_spec) -> None:
        """Refuse at start-up (KV-cache init) what the sparse kernel cannot serve with this group's page size."""
        context = self._modelopt_context()
        if context is None:
            return
        page = int(kv_cache_spec.block_size)
        problem = kernel_page_problem(context.kernel_backend, page, int(kv_cache_spec.head_size),
                                      getattr(kv_cache_spec, "dtype", torch.float16))
        if problem is not None:
            raise ValueError(
                f"sparse attention: vLLM chose kernel block size {page} for layers {self.layer_names[:3]}..., which "
                f"the {context.kernel_backend} skip-softmax kernel does not cover ({problem}). Serve with "
                f"--block-size {TRITON_PAGE_SIZES[0]} (or another power of two >= 16), or set "
                "MODELOPT_EXT_SPARSE_ATTN_BACKEND=torch (PyTorch reference, slow)"
            )

    def _modelopt_prepare_graphs(self, vllm_config, kv_cache_spec) -> None:
        """Persistent split-K workspace for the Triton kernel, and whether uniform decode steps get capture-safe
        plans (the engine asked for full graphs and this group declares them)."""
        context = self._modelopt_context()
        if context is None or context.serves_dense or context.calibrating:
            return
        model = vllm_config.model_config
        if context.kernel_backend == "triton":
            heads = max((int(layer.impl.num_heads) for layer in self._modelopt_layers), default=0)
            size = self._modelopt_planner.reserve_workspace(heads, int(kv_cache_spec.head_size),
                                                             int(model.max_model_len))
            if size:
                context.log_once("workspace", "sparse attention: %.1f MiB split-K workspace for %d sequences of up "
                                 "to %d tokens", size / 2**20, self._modelopt_planner.capacity, model.max_model_len)
        compilation = vllm_config.compilation_config
        mode = getattr(compilation, "cudagraph_mode", None)
        wants_full = bool(mode is not None and getattr(mode, "has_full_cudagraphs", lambda: False)())
        decision = decide_cudagraphs(vllm_config, kv_cache_spec, context)
        context.log_once("graph-decision", "sparse attention: full CUDA graphs for uniform decode %s: %s",
                         "declared" if decision.full else "not declared", decision.reason)
        if wants_full and decision.full:
            self._modelopt_graph_bound = int(model.max_model_len)
            sizes = getattr(compilation, "cudagraph_capture_sizes", None) or [0]
            self._modelopt_graph_sizes = int(getattr(compilation, "max_cudagraph_capture_size", None) or max(sizes))
            context.graph_path = graph_path(context)

    def _modelopt_plan_bound(self, cam) -> int | None:
        """`max_model_len` for a uniform decode step vLLM may capture or replay in a full graph, else None."""
        if self._modelopt_graph_bound is None or int(cam.max_query_len) != 1:
            return None
        return self._modelopt_graph_bound if int(cam.num_reqs) <= self._modelopt_graph_sizes else None

    def use_cascade_attention(self, *args, **kwargs) -> bool:
        """Never: the sparse kernel reads each sequence's whole paged cache (no shared-prefix split)."""
        return False

    def build(self, common_prefix_len, common_attn_metadata, *args, **kwargs):
        """The step's sparse plan when this group has sparse layers, on the native metadata (or, for a step the
        sparse kernel serves, on `_modelopt_sparse_step_metadata` where the backend has a cheaper one)."""
        context = self._modelopt_context()
        if context is None:
            return super().build(common_prefix_len, common_attn_metadata, *args, **kwargs)
        context.log_once(
            "cudagraph",
            "sparse attention (%s): vLLM runs CUDA graph mode %s; prompt lengths from %s",
            context.describe(),
            getattr(getattr(self.vllm_config, "compilation_config", None), "cudagraph_mode", None),
            context.prompt_lens.name if context.prompt_lens is not None
            else f"the kernel's default rule ({context.prompt_lens_reason})",
        )
        if context.prompt_lens is None and not context.serves_dense:
            context.log_once(
                "prompt-lens-fallback",
                "sparse attention: this engine gives no per-request prompt lengths (%s); the kernel's default rule "
                "applies (a query of one token is decode, a longer one all prompt). What it costs: the chunks of a "
                "chunked prompt get the chunk's end instead of the prompt length as law length, and "
                "speculative-decoding verification rows are taken for prompt rows, so those rows skip differently "
                "from calibration (docs/skip_softmax.md, 'λ of a row')",
                context.prompt_lens_reason, level=logging.WARNING,
            )  # fmt: skip
        if context.serves_dense:
            return super().build(common_prefix_len, common_attn_metadata, *args, **kwargs)
        bound = self._modelopt_plan_bound(common_attn_metadata)
        plan = self._modelopt_planner.plan(context, common_attn_metadata, bound)
        metadata = None if plan.dense else self._modelopt_sparse_step_metadata(context, common_attn_metadata)
        if metadata is None:  # the dense path may run: the native metadata, planned as vLLM plans it
            metadata = super().build(common_prefix_len, common_attn_metadata, *args, **kwargs)
        setattr(metadata, PLAN_ATTR, plan)
        return metadata

    def _modelopt_sparse_step_metadata(self, context, common_attn_metadata):
        """Metadata for a step every layer of the group runs with the sparse kernel, or None (the native build)."""
        return None


class _FlashInferSparseStepMixin:
    """FlashInfer: a step the sparse kernel serves skips FlashInfer's plan (its host-side scheduling and copies).

    The metadata is vLLM's own `FlashInferMetadata` with the batch's counts and slot mapping and no prefill or
    decode plan (`prefill=None, decode=None`): only the dense path reads those, and it never runs on such a step.
    Where this vLLM's `FlashInferMetadata` needs fields this does not know, the native build runs (logged once).
    """

    def _modelopt_sparse_step_metadata(self, context, common_attn_metadata):
        metadata_cls, required, known = _flashinfer_metadata_fields()
        if metadata_cls is None:
            return None
        missing = sorted(required - _LIGHT_FLASHINFER_FIELDS)
        if missing:
            context.log_once("flashinfer-plan", "sparse attention: FlashInfer's plan runs on sparse steps too (this "
                             "vLLM's FlashInferMetadata also needs %s)", ", ".join(missing))
            return None
        from vllm.v1.attention.backends.utils import split_decodes_and_prefills

        cam = common_attn_metadata
        num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens = split_decodes_and_prefills(
            cam, decode_threshold=self.reorder_batch_threshold
        )
        values = {
            "kv_cache_layout": getattr(self, "kv_cache_layout", None), "num_actual_tokens": cam.num_actual_tokens,
            "slot_mapping": cam.slot_mapping, "q_data_type_prefill": getattr(self, "q_data_type_prefill", None),
            "q_data_type_decode": getattr(self, "q_data_type_decode", None), "num_decodes": num_decodes,
            "num_decode_tokens": num_decode_tokens, "num_prefills": num_prefills,
            "num_prefill_tokens": num_prefill_tokens, "causal": getattr(cam, "causal", True), "prefill": None,
            "decode": None,
        }  # fmt: skip
        return metadata_cls(**{k: v for k, v in values.items() if k in known})


_LIGHT_FLASHINFER_FIELDS = frozenset((
    "kv_cache_layout", "num_actual_tokens", "slot_mapping", "q_data_type_prefill", "q_data_type_decode",
    "num_decodes", "num_decode_tokens", "num_prefills", "num_prefill_tokens", "causal", "prefill", "decode",
))  # fmt: skip
"""The FlashInferMetadata fields a sparse step fills (`_FlashInferSparseStepMixin`)."""


@functools.cache
def _flashinfer_metadata_fields():
    """(FlashInferMetadata, its required init fields, all its fields), read once; (None, ...) without FlashInfer."""
    try:
        from vllm.v1.attention.backends.flashinfer import FlashInferMetadata
    except ImportError:  # pragma: no cover - vLLM without FlashInfer
        return None, frozenset(), frozenset()
    if not dataclasses.is_dataclass(FlashInferMetadata):
        return None, frozenset(), frozenset()
    fields = dataclasses.fields(FlashInferMetadata)
    required = frozenset(f.name for f in fields if f.init and f.default is dataclasses.MISSING
                         and f.default_factory is dataclasses.MISSING)  # fmt: skip
    return FlashInferMetadata, required, frozenset(f.name for f in fields)


def _backend_pair(kind: str, impl_cls, name: str):
    """(sparse backend, sparse builder) classes for one native backend, or (None, None) when vLLM lacks it."""
    native = vllm_facts().native(kind)
    if native is None or impl_cls is None:
        return None, None
    extra = (_FlashInferSparseStepMixin,) if kind == "flashinfer" else ()
    builder = type(f"ModelOptSparse{name}MetadataBuilder", (*extra, _SparseBuilderMixin, native.builder), {
        "__module__": __name__,
        "__doc__": f"{native.builder.__name__} that attaches the per-step sparse plan (see module docstring).",
    })

    def get_impl_cls():
        return impl_cls

    def get_builder_cls():
        return builder

    def get_supported_kernel_block_sizes(cls, kv_cache_spec=None):
        return covered_kernel_block_sizes(native.backend, kv_cache_spec)

    backend = type(f"ModelOptSparse{name}Backend", (native.backend,), {
        "__module__": __name__,
        "__doc__": f"{native.backend.__name__} whose impl and metadata builder are the sparse ones.",
        "get_impl_cls": staticmethod(get_impl_cls),
        "get_builder_cls": staticmethod(get_builder_cls),
        "get_supported_kernel_block_sizes": classmethod(get_supported_kernel_block_sizes),
        "_modelopt_native_backend": native.backend,
    })
    return backend, builder


ModelOptSparseFlashInferBackend, ModelOptSparseFlashInferMetadataBuilder = _backend_pair(
    "flashinfer", ModelOptSparseFlashInferImpl, "FlashInfer"
)
ModelOptSparseFlashAttentionBackend, ModelOptSparseFlashAttentionMetadataBuilder = _backend_pair(
    "flash_attn", ModelOptSparseAttentionImpl, "FlashAttention"
)
ModelOptSparseCPUAttentionBackend, _CPUBuilderBase = _backend_pair("cpu_attn", ModelOptSparseCPUAttentionImpl,
                                                                   "CPUAttention")
if _CPUBuilderBase is not None:
    _CPUBuilderBase.__name__ = _CPUBuilderBase.__qualname__ = "_ModelOptSparseCPUAttentionMetadataBuilderBase"

if _CPUBuilderBase is not None:

    class ModelOptSparseCPUAttentionMetadataBuilder(_CPUBuilderBase):
        """The sparse CPU builder checks the ISA vLLM chose for its group, and with it the cache layout the impl
        reads (`vec`, `vec16`, `amx`: all read in place), at start-up; the impls learn it from here."""

        def _modelopt_check_startup(self, kv_cache_spec) -> None:
            super()._modelopt_check_startup(kv_cache_spec)
            context = self._modelopt_context()
            if context is None:
                return
            isa = getattr(self, "isa", None)
            problem = cpu_isa_problem(isa) if isa is not None else "vLLM's CPU builder chose no ISA"
            if problem is not None:
                raise ValueError(f"sparse attention on {len(self.layer_names)} layers ({self.layer_names[0]}, ...): "
                                 f"{problem}, or set MODELOPT_EXT_SPARSE_ATTN=0")
            for layer in self._modelopt_layers:
                state = getattr(layer.impl, _STATE_ATTR, None)
                if state is not None:
                    state.isa = isa

    ModelOptSparseCPUAttentionBackend.get_builder_cls = staticmethod(
        lambda: ModelOptSparseCPUAttentionMetadataBuilder
    )
else:  # pragma: no cover - vLLM without CPU attention
    ModelOptSparseCPUAttentionMetadataBuilder = None

SPARSE_BACKENDS = {
    kind: backend
    for kind, backend in (
        ("flashinfer", ModelOptSparseFlashInferBackend),
        ("flash_attn", ModelOptSparseFlashAttentionBackend),
        ("cpu_attn", ModelOptSparseCPUAttentionBackend),
    )
    if backend is not None
}
"""The sparse backend of each native backend kind this vLLM has."""


def native_backend_of(backend_cls):
    """The native backend class a (sparse or native) backend class stands for."""
    return getattr(backend_cls, "_modelopt_native_backend", backend_cls)
