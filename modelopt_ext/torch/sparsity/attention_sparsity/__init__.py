"""mtsa: calibrated skip-softmax sparse attention for Hugging Face models, on ModelOpt's mode framework.

    import modelopt_ext.torch.sparsity.attention_sparsity as mtsa
    model = mtsa.sparsify(model, mtsa.SKIP_SOFTMAX_CALIB, forward_loop)   # sparsify + calibrate
    mtsa.export_sparse_attention_config(model, ckpt_dir)                   # write the checkpoint block

Attributes load lazily (PEP 562): importing this package, or the submodules the vLLM plugin reads checkpoints with
(`checkpoint.config_io`, `checkpoint.resolve`), imports neither ModelOpt nor transformers nor vLLM. The ModelOpt
mode is registered at import when ModelOpt is already imported, else when the first `mtsa.<name>` is used; in a
fresh process that imports mtsa before ModelOpt and goes straight to `mto.restore`, call `mtsa.register_mode()`
first.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

_EXPORTS = {
    "CalibrationFitError": ".calibration.fit",
    "SKIP_SOFTMAX_CALIB": ".config",
    "SKIP_SOFTMAX_DEFAULT": ".config",
    "SkipSoftmaxCalibrationConfig": ".config",
    "SkipSoftmaxLayerConfig": ".config",
    "SparseAttentionConfig": ".config",
    "is_sparse_attention_model": ".conversion",
    "sparse_attention_states": ".conversion",
    "MODE_NAME": ".mode",
    "SparseAttentionModeRegistry": ".mode",
    "calibrate": ".model_sparsify",
    "disable_sparse_attention": ".model_sparsify",
    "enable_sparse_attention": ".model_sparsify",
    "export_sparse_attention_config": ".model_sparsify",
    "print_sparse_attention_summary": ".model_sparsify",
    "realized_sparsity": ".model_sparsify",
    "reset_sparse_attention_stats": ".model_sparsify",
    "save_sparse_attention_config": ".model_sparsify",
    "set_target_sparsity": ".model_sparsify",
    "sparsify": ".model_sparsify",
    "ATTN_IMPLEMENTATION": ".plugins.huggingface",
    "UnsupportedModelError": ".plugins.huggingface",
}

__all__ = sorted([*_EXPORTS, "register_mode"])


def register_mode() -> str:
    """Register the `modelopt_ext_sparse_attention` mode with ModelOpt (idempotent); returns its name."""
    return importlib.import_module(".mode", __name__).MODE_NAME


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    register_mode()  # any use of mtsa makes saved models restorable
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


if "modelopt.torch.opt" in sys.modules:
    # ModelOpt is loaded already (e.g. `import modelopt.torch.opt as mto` came first): registering costs nothing,
    # and `mto.restore` of a saved sparse model then works right after `import ... as mtsa`.
    register_mode()
