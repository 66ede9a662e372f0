"""Attention sinks (gpt-oss) on the transformers path: transformers passes a module's `sinks` as `s_aux`; the
kernels put them into the softmax denominator and the skip test (docs/skip_softmax.md, version 3).

A tiny random gpt-oss (transformers' GptOssForCausalLM, float64) is compared with its own eager attention: at no
skip the sparse path equals it, disabled (sliding-window) layers keep their sinks and windows, and the HF path hands
the sinks to the kernel exactly as a direct kernel call does, counts included (serving and calibration)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from mtsa_models import random_ids

import modelopt_ext.torch.sparsity.attention_sparsity as mtsa
from modelopt_ext.torch.kernels.sparsity.attention import paged_skip_softmax_attention
from modelopt_ext.torch.sparsity.attention_sparsity.calibration.calibrate import CountCollector
from modelopt_ext.torch.sparsity.attention_sparsity.plugins.huggingface import (
    STATE_ATTR,
    dense_attention_with_sinks,
    skip_softmax_attention_forward,
)

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "GptOssForCausalLM"):
    pytest.skip("this transformers has no GptOssForCausalLM", allow_module_level=True)

# float64 model and kernel; the kernels take the sinks as float32 (the contract), eager keeps them float64
TOL = 1e-6
WINDOW = 32


def make_tiny_gpt_oss(seed: int = 0, *, layer_types=("full_attention", "full_attention"), sink_scale: float = 3.0):
    """A tiny random gpt-oss in float64 with peaked attention (tiles to skip) and sinks of a few logits' size, so
    they carry a real share of every row's softmax mass."""
    from transformers import GptOssConfig, GptOssForCausalLM

    cfg = GptOssConfig(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=len(layer_types),
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=2,
                       num_experts_per_tok=1, layer_types=list(layer_types),
                       sliding_window=WINDOW,  # gpt-oss builds both masks; full layers ignore the window
                       experts_implementation="eager")  # fmt: skip  (float64: no grouped GEMM)
    torch.manual_seed(seed)
    model = GptOssForCausalLM(cfg).to(torch.float64).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            attn.q_proj.weight.mul_(8.0)
            attn.k_proj.weight.mul_(8.0)
            attn.sinks.copy_(sink_scale * torch.randn(attn.sinks.shape, dtype=torch.float64) + sink_scale)
    model.config._attn_implementation = "eager"
    return model


def _logits(model, ids, **kwargs):
    with torch.no_grad():
        return model(ids, **kwargs).logits


def test_sparse_path_at_no_skip_equals_the_models_eager_attention_with_sinks():
    dense = make_tiny_gpt_oss(1)
    model = mtsa.sparsify(copy.deepcopy(dense), {"*self_attn*": {"thresholds": None, "backend": "torch"}})
    ids = random_ids(200, seed=1)
    ref = _logits(dense, ids)
    torch.testing.assert_close(_logits(model, ids), ref, rtol=0, atol=TOL)
    assert mtsa.realized_sparsity(model)["prefill"] == 0.0  # through the kernel
    # the comparison sees the sinks: without them the model differs by far more than the tolerance
    no_sinks = copy.deepcopy(dense)
    with torch.no_grad():
        for layer in no_sinks.model.layers:
            layer.self_attn.sinks.fill_(-1e4)
    assert (_logits(no_sinks, ids) - ref).abs().max() > 1e4 * TOL


def test_chunked_prefill_and_decode_with_sinks_equal_eager():
    from transformers import DynamicCache

    dense = make_tiny_gpt_oss(2)
    model = mtsa.sparsify(copy.deepcopy(dense), {"*self_attn*": {"backend": "torch"}})
    ids = random_ids(150, seed=2)
    outs = []
    for m in (dense, model):
        cache = DynamicCache(config=m.config)
        chunks = [_logits(m, ids[:, :70], past_key_values=cache), _logits(m, ids[:, 70:140], past_key_values=cache)]
        chunks += [_logits(m, ids[:, t : t + 1], past_key_values=cache) for t in range(140, 150)]
        outs.append(torch.cat(chunks, dim=1))
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=TOL)
    assert mtsa.realized_sparsity(model) == {"prefill": 0.0, "decode": 0.0}


def test_sliding_layers_are_refused_and_disabled_ones_keep_their_window_and_sinks():
    """gpt-oss's sliding-window layers cannot run sparse (an error naming the fix); with them disabled the model
    still equals its eager attention: the disabled layers take the dense path with sinks and the window's mask."""
    dense = make_tiny_gpt_oss(3, layer_types=("sliding_attention", "full_attention"))
    with pytest.raises(mtsa.UnsupportedModelError, match=r"GptOssAttention: sliding-window attention \(window 32\)"):
        mtsa.sparsify(copy.deepcopy(dense), {"*self_attn*": {"backend": "torch"}})
    cfg = {"*self_attn*": {"thresholds": None, "backend": "torch"},
           "*layers.*[02468].self_attn": {"enable": False}}  # fmt: skip  (README: gpt-oss's even layers slide)
    model = mtsa.sparsify(copy.deepcopy(dense), cfg)
    states = mtsa.sparse_attention_states(model)
    assert not states["model.layers.0.self_attn"].enabled and states["model.layers.1.self_attn"].enabled
    ids = random_ids(3 * WINDOW + 5, seed=3)
    ref = _logits(dense, ids)
    torch.testing.assert_close(_logits(model, ids), ref, rtol=0, atol=TOL)
    assert states["model.layers.1.self_attn"].stats["prefill"] is not None
    assert states["model.layers.0.self_attn"].stats["prefill"] is None
    # the window matters at this length (the comparison would see a layer that ignored it)
    wide = copy.deepcopy(dense)
    wide.model.layers[0].self_attn.sliding_window = None
    wide.config.layer_types = ["full_attention", "full_attention"]
    assert (_logits(wide, ids) - ref).abs().max() > 1e3 * TOL


def _hf_inputs(q_len, kv_len, batch, seed, anchor_norm=4.0):
    g = torch.Generator().manual_seed(seed)
    anchor = torch.randn(16, generator=g, dtype=torch.float64)
    anchor = anchor_norm * anchor / anchor.norm()  # key 0 attracts every query: tiles become skippable
    query = torch.randn(batch, 4, q_len, 16, generator=g, dtype=torch.float64) + anchor
    key = torch.randn(batch, 2, kv_len, 16, generator=g, dtype=torch.float64)
    key[:, :, 0] = 3 * anchor
    value = torch.randn(batch, kv_len, 2, 16, generator=g, dtype=torch.float64).transpose(1, 2)
    return query, key, value


def _direct(query, key, value, scaling, sinks, **kw):
    """The kernel on hand-packed contiguous copies (one page per sequence): the independent side."""
    batch, hq, q_len, d = query.shape
    kv_len = key.shape[2]
    q = query.transpose(1, 2).reshape(batch * q_len, hq, d).contiguous()
    table = torch.arange(batch, dtype=torch.int32).view(batch, 1)
    cu = torch.arange(batch + 1, dtype=torch.int32) * q_len
    lens = torch.full((batch,), kv_len, dtype=torch.int32)
    return paged_skip_softmax_attention(q, key.transpose(1, 2).contiguous(), value.transpose(1, 2).contiguous(),
                                        table, cu, lens, softmax_scale=scaling, backend="torch", sinks=sinks,
                                        **kw)  # fmt: skip


@pytest.mark.parametrize("q_len,kv_len,batch", [(320, 320, 2), (64, 448, 1), (1, 600, 3)])
def test_hf_path_hands_s_aux_to_the_kernel(q_len, kv_len, batch):
    model = make_tiny_gpt_oss(6, layer_types=("full_attention",))
    mtsa.sparsify(model, {"*self_attn*": {"thresholds": 0.05, "backend": "torch"}})
    module = model.model.layers[0].self_attn
    state = getattr(module, STATE_ATTR)
    # no anchor key: what skips is what the sinks make skippable (heads 0 and 1, one GQA group, far above every
    # score: a decode row's group decides together)
    query, key, value = _hf_inputs(q_len, kv_len, batch, q_len * 1000 + kv_len, anchor_norm=0.0)
    sinks = torch.tensor([30.0, 25.0, 4.5, 0.5], dtype=torch.float64)
    out, weights = skip_softmax_attention_forward(module, query, key, value, None, scaling=0.25, s_aux=sinks)
    assert weights is None
    ref, ref_counts = _direct(query, key, value, 0.25, sinks, skip_threshold=0.05, return_skip_counts=True)
    torch.testing.assert_close(out, ref.view(batch, q_len, 4, 16), rtol=0, atol=1e-12)
    phase = "decode" if q_len == 1 else "prefill"
    assert state.stats[phase].tolist() == ref_counts.sum(dim=(0, 1)).tolist()
    without, counts_without = _direct(query, key, value, 0.25, None, skip_threshold=0.05, return_skip_counts=True)
    assert (without - ref).abs().max() > 1e-3, "the sinks change the output"
    assert ref_counts[..., 1].sum() > counts_without[..., 1].sum(), "a high sink makes more tiles skippable"
    # without s_aux the module's own sinks are used
    state.reset_stats()
    with torch.no_grad():
        module.sinks.copy_(sinks)
    out_own, _ = skip_softmax_attention_forward(module, query, key, value, None, scaling=0.25)
    torch.testing.assert_close(out_own, out, rtol=0, atol=0)


def test_calibration_counts_include_the_sinks():
    """Calibration's trial counts (dense output) are the kernel's calibration counts with the sinks."""
    model = make_tiny_gpt_oss(7, layer_types=("full_attention",))
    mtsa.sparsify(model, {"*self_attn*": {"backend": "torch"}})
    module = model.model.layers[0].self_attn
    state = getattr(module, STATE_ATTR)
    query, key, value = _hf_inputs(400, 400, 1, 7, anchor_norm=0.0)
    sinks = torch.tensor([30.0, -2.0, 4.5, 0.5], dtype=torch.float64)
    factors = [0.5, 4.0, 30.0, 120.0]
    state.collector = CountCollector(factors)
    try:
        out, _ = skip_softmax_attention_forward(module, query, key, value, None, scaling=0.25, s_aux=sinks)
        state.collector.end_step()
        records = state.collector.records
    finally:
        state.collector = None
    log_sf = torch.tensor([[math.log(sf)] * 2 for sf in factors], dtype=torch.float32).expand(1, -1, 2)
    dense, counts = _direct(query, key, value, 0.25, sinks, log_scale_factors=log_sf,
                            length_exponents=torch.ones(2))  # fmt: skip
    torch.testing.assert_close(out, dense.view(1, 400, 4, 16), rtol=0, atol=1e-12)
    assert len(records) == 1 and records[0].phase == "prefill" and records[0].kv_len == 400
    assert torch.equal(torch.as_tensor(records[0].counts), counts[0])
    _, counts_without = _direct(query, key, value, 0.25, None, log_scale_factors=log_sf,
                                length_exponents=torch.ones(2))  # fmt: skip
    assert counts[..., 1].sum() > counts_without[..., 1].sum()


def test_dense_sinks_fallback_matches_eager_with_masks():
    """The dense path of disabled sink modules: boolean, additive and no mask, GQA, against gpt-oss's eager."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    model = make_tiny_gpt_oss(8, layer_types=("full_attention",))
    module = model.model.layers[0].self_attn
    query, key, value = _hf_inputs(20, 50, 2, 8)
    rows = torch.arange(20).unsqueeze(1) + 30
    allowed = (torch.arange(50).unsqueeze(0) <= rows) & (torch.arange(50).unsqueeze(0) > rows - 16)
    additive = torch.zeros(2, 1, 20, 50, dtype=torch.float64).masked_fill(~allowed, torch.finfo(torch.float64).min)
    for mask in (None, allowed.expand(2, 1, 20, 50), additive):
        eager_mask = additive if mask is not None else torch.zeros_like(additive).masked_fill(
            ~(torch.arange(50).unsqueeze(0) <= rows), torch.finfo(torch.float64).min)  # fmt: skip
        ref, _ = eager_attention_forward(module, query, key, value, eager_mask, scaling=0.25)
        out = dense_attention_with_sinks(module, query, key, value, mask, module.sinks, scaling=0.25)
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
