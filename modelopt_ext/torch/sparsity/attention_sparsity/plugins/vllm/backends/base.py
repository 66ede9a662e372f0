"""What every sparse backend shares: the backend role (its `supports_*` answers come from capabilities.py), the
metadata that carries the step's plan, and the metadata builder that plans each step.

vLLM asks each attention layer for its backend class (`layer.get_attn_backend()`, i.e. `layer.attn_backend`) when
the engine builds its KV cache: the backend's `get_builder_cls()` gives the metadata builder of the layer's group,
the builders' `get_cudagraph_support()` decide the CUDA-graph mode, and `get_supported_kernel_block_sizes()` the
page size. The sparse builders run the native `build` unchanged and return the sparse metadata: the native
metadata's values plus the step's `SparsePlan` (plugins/vllm/plan.py) in its declared field `modelopt_sparse_plan`.
They plan from the engine context of their layers, never from a process-wide registry. They declare:

- CUDA graphs (plugins/vllm/cudagraphs.py): full graphs for uniform decode batches (at most
  `UNIFORM_SINGLE_TOKEN_DECODE`, never more than the native builder) when the engine serves sparse on a CUDA device
  with the Triton kernel and the start-up self-test passes; `NEVER` otherwise (vLLM then resolves its default
  `FULL_AND_PIECEWISE` to `PIECEWISE`), the native builder's support when the engine serves dense. The decision
  and the CUDA-graph mode vLLM chose are logged once per engine.
- no cascade attention (the sparse kernel reads each sequence's whole paged cache), no in-place block-table update
  of built metadata (the plan is built in `build`), no draft-decode metadata refresh without `build`.
- page sizes (plugins/vllm/kernel_pages.py): where CUDA runs the Triton kernel, only the kernel block sizes it
  covers (powers of two >= 16), so vLLM's block-size selection plans a covered page size; a builder whose page size
  is not covered refuses at start-up.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, ClassVar

import torch

from ..compat import vllm_facts
from ..cudagraphs import decide as decide_cudagraphs
from ..cudagraphs import graph_path
from ..impls import layer_state
from ..kernel_pages import TRITON_PAGE_SIZES, covered_kernel_block_sizes, kernel_page_problem
from ..layers import BUILDER_MARK
from ..plan import SparsePlanner
from .capabilities import SparseCapabilities

if TYPE_CHECKING:
    from ..plan import SparsePlan

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------------------------
# The backend role


class SparseBackendMixin(SparseCapabilities):
    """What a sparse backend adds to its native backend (placed before it in the MRO): the capabilities of the
    sparse path (backends/capabilities.py) and the page sizes it offers vLLM."""

    @classmethod
    def get_supported_kernel_block_sizes(cls, kv_cache_spec=None) -> list:
        """The native backend's kernel block sizes, restricted to the Triton kernel's where CUDA runs it."""
        return covered_kernel_block_sizes(cls.native_backend, kv_cache_spec)


# ---------------------------------------------------------------------------------------------------------------
# The metadata role


def sparse_metadata(cls):
    """Decorator of a sparse metadata class: a dataclass like its native base (frozen where the base is)."""
    base = cls.__mro__[1]
    if not dataclasses.is_dataclass(base):
        return cls
    return dataclasses.dataclass(frozen=base.__dataclass_params__.frozen)(cls)


def with_plan(metadata_cls, metadata, plan):
    """The native `metadata` as an instance of the sparse `metadata_cls` (the same values) carrying `plan`."""
    sparse = object.__new__(metadata_cls)
    values = getattr(metadata, "__dict__", None)
    if values is not None:
        sparse.__dict__.update(values)
    else:  # a slotted dataclass
        for f in dataclasses.fields(metadata):
            object.__setattr__(sparse, f.name, getattr(metadata, f.name))
    object.__setattr__(sparse, "modelopt_sparse_plan", plan)
    return sparse


# ---------------------------------------------------------------------------------------------------------------
# The metadata builder role


def _context_of(layers):
    """The sparse context the layers share (one per engine), or None when none of them is sparse."""
    for layer in layers:
        state = layer_state(layer)
        if state is not None:
            return state.context
    return None


def _engine_context_of(vllm_config):
    """The sparse context of an engine's layers, found through its static forward context."""
    return _context_of((getattr(vllm_config.compilation_config, "static_forward_context", {}) or {}).values())


class SparseBuilderMixin:
    """What a sparse metadata builder adds to its native builder (placed before it in the MRO)."""

    sparse_metadata_cls: ClassVar[type]  # the backend's sparse metadata (a subclass of the native one)
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

    def _modelopt_log_engine(self, context) -> None:
        """Once per engine: the CUDA-graph mode vLLM runs and where prompt lengths come from."""
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

    def build(self, common_prefix_len, common_attn_metadata, *args, **kwargs):
        """The native metadata when this group serves dense; else the sparse metadata with the step's plan (for a
        step the sparse kernel serves, from `_modelopt_sparse_step_values` where the backend has cheaper ones)."""
        context = self._modelopt_context()
        if context is None:
            return super().build(common_prefix_len, common_attn_metadata, *args, **kwargs)
        self._modelopt_log_engine(context)
        if context.serves_dense:
            return super().build(common_prefix_len, common_attn_metadata, *args, **kwargs)
        bound = self._modelopt_plan_bound(common_attn_metadata)
        plan: SparsePlan = self._modelopt_planner.plan(context, common_attn_metadata, bound)
        values = None if plan.dense else self._modelopt_sparse_step_values(context, common_attn_metadata)
        if values is not None:
            return self.sparse_metadata_cls(**values, modelopt_sparse_plan=plan)
        # the dense path may run: the native metadata, planned as vLLM plans it
        native = super().build(common_prefix_len, common_attn_metadata, *args, **kwargs)
        return with_plan(self.sparse_metadata_cls, native, plan)

    def _modelopt_sparse_step_values(self, context, common_attn_metadata) -> dict | None:
        """The native metadata's field values for a step every layer of the group runs with the sparse kernel, or
        None (the native build runs)."""
        return None
