"""Which of a model's vLLM attention layers the plugin acts on: the layer walk, the checkpoint's `targets`
(attention class names) and its `ignore` list (layer names or patterns).
"""

from __future__ import annotations

import difflib
import fnmatch
import logging

import torch

from ...checkpoint.config_io import SparseAttentionSettings

logger = logging.getLogger(__name__)

BUILDER_MARK = "_modelopt_sparse_builder"
"""Set on a vLLM attention layer once a sparse metadata builder covers it (so a later install may make it sparse)."""

DENSE_REASONS_ATTR = "_modelopt_dense_reasons"
IGNORED = "kept dense by the checkpoint's ignore list"
UNTARGETED = "kept dense: its attention class is not in the checkpoint's targets"
"""Set on a vLLM attention layer that runs dense on its own backend: why (what `sparse_attn_status` reports)."""


def is_attention_layer(module) -> bool:
    if not hasattr(module, "impl"):
        return False
    try:
        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    except ImportError:  # pragma: no cover - older layouts
        return hasattr(module, "attn_backend")
    return isinstance(module, AttentionLayerBase)


def attention_layers(model_or_layers) -> list[tuple[str, object]]:
    """(name, layer) pairs from a model, a {name: layer} dict (e.g. static_forward_context) or a layer list."""
    if isinstance(model_or_layers, torch.nn.Module) and not is_attention_layer(model_or_layers):
        items = list(model_or_layers.named_modules())
    elif isinstance(model_or_layers, dict):
        items = list(model_or_layers.items())
    elif is_attention_layer(model_or_layers):
        items = [("", model_or_layers)]
    else:
        items = [("", layer) for layer in model_or_layers]
    out = []
    for name, layer in items:
        if is_attention_layer(layer):
            out.append((getattr(layer, "layer_name", None) or name, layer))
    return out


def attention_classes(model_or_layers, layers) -> dict[str, set[str]]:
    """Per layer name, the class names `targets` may list: the layer's own (vLLM's `Attention`) and, when a model is
    given, its parent module's (vLLM's model attention class, e.g. `LlamaAttention`, usually named as in
    transformers)."""
    # A layer's class and its bases up to vLLM's `Attention`: the default target `Attention` covers the subclasses
    # vLLM gives some layers (`ChunkedLocalAttention`, ...); whether those can run sparse is decided on their own.
    classes = {name: {c.__name__ for c in type(layer).__mro__ if c.__module__.startswith("vllm")} or
               {type(layer).__name__} for name, layer in layers}  # fmt: skip
    if isinstance(model_or_layers, torch.nn.Module) and not is_attention_layer(model_or_layers):
        for path, module in model_or_layers.named_modules():
            if is_attention_layer(module) and "." in path:
                parent = model_or_layers.get_submodule(path.rsplit(".", 1)[0])
                classes.setdefault(getattr(module, "layer_name", None) or path, set()).add(type(parent).__name__)
    return classes


def untargeted_layers(settings: SparseAttentionSettings | None, classes: dict[str, set[str]]) -> set[str]:
    """Layers whose classes the checkpoint's `targets` do not list: served dense, like the ignore list.

    Targets that name no class of this vLLM model (transformers and vLLM name some attention classes differently,
    e.g. vLLM serves Mistral with its Llama classes) are not applied, with a warning: a checkpoint never goes dense
    silently because of a class name.
    """
    wanted = set(settings.attention_classes or ()) if settings is not None else set()
    if not wanted:
        return set()
    present = set().union(*classes.values()) if classes else set()
    if not wanted & present:
        logger.warning(
            "sparse attention: targets %s name no attention class of this vLLM model (its classes: %s), so targets "
            "is not applied: every attention layer goes sparse unless ignored. Write this model's class names into "
            "targets to restrict which layers go sparse", sorted(wanted), ", ".join(sorted(present)) or "-",
        )  # fmt: skip
        return set()
    return {name for name, names in classes.items() if not wanted & names}


def kv_cache_bound(layer) -> bool:
    """Whether vLLM already bound a KV cache to the layer (then its attention group and builder exist)."""
    kv = getattr(layer, "kv_cache", None)
    if isinstance(kv, (list, tuple)):
        kv = kv[0] if kv else None
    return isinstance(kv, torch.Tensor) and kv.numel() > 0


def is_ignored(name: str, settings: SparseAttentionSettings | None) -> bool:
    """Whether `ignore` keeps this layer dense. HF exports name the attention module (`model.layers.1.self_attn`)
    while vLLM names its layer inside it (`model.layers.1.self_attn.attn`), so a name also matches by prefix."""
    patterns = settings.disabled_layers if settings is not None else ()
    return any(_ignore_matches(name, p) for p in patterns)


def _ignore_matches(name: str, pattern: str) -> bool:
    return (name == pattern or name.startswith(pattern + ".") or fnmatch.fnmatchcase(name, pattern)
            or fnmatch.fnmatchcase(name, pattern + ".*"))  # fmt: skip


def warn_unmatched_ignores(settings: SparseAttentionSettings | None, names: list[str]) -> None:
    """An `ignore` pattern that matches no vLLM layer would leave the layer it meant sparse: say so, with the
    nearest vLLM layer names (HF-style names match vLLM's by prefix; other spellings do not)."""
    for pattern in settings.disabled_layers if settings is not None else ():
        if not any(_ignore_matches(name, pattern) for name in names):
            near = difflib.get_close_matches(pattern, names, n=3, cutoff=0.3)
            logger.warning("sparse attention: ignore pattern %r matches no attention layer of this engine, so "
                           "nothing is kept dense for it; nearest vLLM layer names: %s", pattern,
                           ", ".join(near) or "-")  # fmt: skip
