"""The `modelopt_ext_sparse_attention` mode, registered with ModelOpt's mode framework.

Its own registry and name keep it apart from ModelOpt's "sparse_attention" mode, so both packages can be imported
in one process; `mto.save` / `mto.restore` / `mto.modelopt_state` then carry the config and per-module states.
"""

from __future__ import annotations

from modelopt.torch.opt.config import ModeloptBaseConfig
from modelopt.torch.opt.mode import (
    ConvertEntrypoint,
    ModeDescriptor,
    RestoreEntrypoint,
    UpdateEntrypoint,
    _ModeRegistryCls,
)

from .config import SparseAttentionConfig
from .conversion import (
    convert_to_sparse_attention_model,
    restore_sparse_attention_model,
    update_sparse_attention_metadata,
)

MODE_NAME = "modelopt_ext_sparse_attention"

SparseAttentionModeRegistry = _ModeRegistryCls(MODE_NAME)


@SparseAttentionModeRegistry.register_mode
class SkipSoftmaxSparseAttentionModeDescriptor(ModeDescriptor):
    """Skip-softmax sparse attention (calibrated per phase) for transformers models."""

    @property
    def name(self) -> str:
        return MODE_NAME

    @property
    def config_class(self) -> type[ModeloptBaseConfig]:
        return SparseAttentionConfig

    @property
    def next_prohibited_modes(self) -> set[str] | None:
        # Two sparse-attention conversions would fight over the attention function.
        return {"sparse_attention", MODE_NAME}

    @property
    def convert(self) -> ConvertEntrypoint:
        return convert_to_sparse_attention_model

    @property
    def restore(self) -> RestoreEntrypoint:
        return restore_sparse_attention_model

    @property
    def update_for_save(self) -> UpdateEntrypoint:
        return update_sparse_attention_metadata

    @property
    def update_for_new_mode(self) -> UpdateEntrypoint:
        return update_sparse_attention_metadata
