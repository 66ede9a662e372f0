"""The transformers attention path: equality with sdpa when dense, skipping when not, and the kernel contract."""

from __future__ import annotations

import pytest
import torch
from mtsa_models import make_tiny_llama, random_ids

import modelopt_ext.torch.sparsity.attention_sparsity as mtsa
from modelopt_ext.torch.kernels.sparsity.attention import paged_skip_softmax_attention
from modelopt_ext.torch.sparsity.attention_sparsity.plugins.huggingface import (
    STATE_ATTR,
    SparseAttentionState,
    hf_kv_as_paged,
    skip_softmax_attention_forward,
)

# float64 model and kernel: sdpa and the skip-softmax reference differ only by summation order.
TOL = 1e-10


def _logits(model, ids, **kwargs):
    with torch.no_grad():
        return model(ids, **kwargs).logits


@pytest.mark.parametrize("threshold", [None, 1e-30])
def test_dense_equals_sdpa(dense_and_copy, threshold):
    dense, model = dense_and_copy(seed=1)
    mtsa.sparsify(model, {"*self_attn*": {"thresholds": threshold, "backend": "torch"}})
    assert model.config._attn_implementation == mtsa.ATTN_IMPLEMENTATION
    ids = random_ids(200, batch=2, seed=1)
    torch.testing.assert_close(_logits(model, ids), _logits(dense, ids), rtol=0, atol=TOL)
    sparsity = mtsa.realized_sparsity(model)
    assert sparsity["prefill"] == 0.0


def test_chunked_prefill_and_decode_equal_sdpa(dense_and_copy):
    from transformers import DynamicCache

    dense, model = dense_and_copy(seed=2)
    mtsa.sparsify(model, {"*self_attn*": {}})
    ids = random_ids(150, seed=2)
    outs = []
    for m in (dense, model):
        cache = DynamicCache(config=m.config)
        chunks = [_logits(m, ids[:, :70], past_key_values=cache), _logits(m, ids[:, 70:140], past_key_values=cache)]
        for t in range(140, 150):  # decode steps
            chunks.append(_logits(m, ids[:, t : t + 1], past_key_values=cache))
        outs.append(torch.cat(chunks, dim=1))
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=TOL)
    sparsity = mtsa.realized_sparsity(model)
    assert sparsity == {"prefill": 0.0, "decode": 0.0}


def test_large_threshold_skips_but_stays_close(dense_and_copy):
    dense, model = dense_and_copy(seed=3)
    mtsa.sparsify(model, {"*self_attn*": {"thresholds": {"prefill": 0.05, "decode": 0.05}}})
    ids = random_ids(512, seed=3)
    ref, out = _logits(dense, ids), _logits(model, ids)
    sparsity = mtsa.realized_sparsity(model)["prefill"]
    assert sparsity > 0.05, sparsity
    diff = (out - ref).abs().max().item()
    # Skipped tiles hold at most λ of a row's mass each: outputs move, but little.
    assert diff > 1e-8, "a skipping run must not be bit-identical to dense"
    assert diff < 0.5 * ref.abs().max().item(), diff
    agree = (out.argmax(-1) == ref.argmax(-1)).double().mean().item()
    assert agree > 0.8, agree


def test_disabled_module_takes_sdpa_path(dense_and_copy):
    dense, model = dense_and_copy(seed=4)
    mtsa.sparsify(model, {"*self_attn*": {"thresholds": 0.5}})
    names = mtsa.disable_sparse_attention(model, "*layers.1.*")
    assert names == ["model.layers.1.self_attn"]
    ids = random_ids(130, seed=4)
    _logits(model, ids)
    states = mtsa.sparse_attention_states(model)
    assert states["model.layers.0.self_attn"].stats["prefill"] is not None
    assert states["model.layers.1.self_attn"].stats["prefill"] is None  # never reached the kernel
    mtsa.disable_sparse_attention(model, "*")
    torch.testing.assert_close(_logits(model, ids), _logits(dense, ids), rtol=0, atol=TOL)
    mtsa.enable_sparse_attention(model, "model.layers.0.*")
    assert [n for n, s in mtsa.sparse_attention_states(model).items() if s.enabled] == ["model.layers.0.self_attn"]
    with pytest.raises(ValueError, match="matches no sparse attention module"):
        mtsa.enable_sparse_attention(model, "*mlp*")


def test_unmatched_pattern_leaves_modules_dense(dense_and_copy):
    dense, model = dense_and_copy(seed=5)
    mtsa.sparsify(model, {"*layers.0.self_attn": {"thresholds": 0.5}})
    states = mtsa.sparse_attention_states(model)
    assert states["model.layers.0.self_attn"].enabled and not states["model.layers.1.self_attn"].enabled


def _direct_kernel(query, key, value, lam, scaling, softcap=None):
    """Pack HF tensors by hand (contiguous copies) and call the kernel: the independent side of the comparison."""
    batch, hq, q_len, d = query.shape
    kv_len = key.shape[2]
    q = query.transpose(1, 2).reshape(batch * q_len, hq, d).contiguous()
    k_cache = key.transpose(1, 2).contiguous()  # [B, kv, Hkv, D]: one page per sequence
    v_cache = value.transpose(1, 2).contiguous()
    table = torch.arange(batch, dtype=torch.int32).view(batch, 1)
    cu = torch.arange(batch + 1, dtype=torch.int32) * q_len
    lens = torch.full((batch,), kv_len, dtype=torch.int32)
    out, counts = paged_skip_softmax_attention(
        q, k_cache, v_cache, table, cu, lens, softmax_scale=scaling, skip_threshold=lam, return_skip_counts=True,
        backend="torch", logits_soft_cap=softcap,
    )
    return out.view(batch, q_len, hq, d), counts


@pytest.mark.parametrize("softcap", [None, 5.0], ids=["no-cap", "softcap"])
@pytest.mark.parametrize("q_len,kv_len,batch", [(320, 320, 2), (64, 448, 1), (1, 600, 3)])
def test_hf_path_matches_direct_kernel_call(q_len, kv_len, batch, softcap):
    """`softcap` is what transformers passes for Gemma 2's attn_logit_softcapping: the kernel caps the scores."""
    model = make_tiny_llama(6, layers=1)
    mtsa.sparsify(model, {"*self_attn*": {"thresholds": 0.3}})
    module = model.model.layers[0].self_attn
    state: SparseAttentionState = getattr(module, STATE_ATTR)
    g = torch.Generator().manual_seed(q_len * 1000 + kv_len)
    sink = torch.randn(16, generator=g, dtype=torch.float64)  # key 0 attracts every query: tiles become skippable
    sink = 4 * sink / sink.norm()
    query = torch.randn(batch, 4, q_len, 16, generator=g, dtype=torch.float64) + sink
    key = torch.randn(batch, 2, kv_len, 16, generator=g, dtype=torch.float64)
    key[:, :, 0] = 3 * sink
    value = torch.randn(batch, kv_len, 2, 16, generator=g, dtype=torch.float64).transpose(1, 2)  # HF V strides
    out, weights = skip_softmax_attention_forward(module, query, key, value, None, scaling=0.25, softcap=softcap)
    assert weights is None
    ref, ref_counts = _direct_kernel(query, key, value, 0.3, 0.25, softcap)
    if softcap:
        assert (ref - _direct_kernel(query, key, value, 0.3, 0.25)[0]).abs().max() > 1e-3
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    phase = "decode" if q_len == 1 else "prefill"
    assert state.stats[phase].tolist() == ref_counts.sum(dim=(0, 1)).tolist()
    assert ref_counts[..., 1].sum() > 0, "choose inputs where something is skipped"


def test_paged_views_zero_copy_and_padded():
    g = torch.Generator().manual_seed(7)
    for batch, kv_len in ((1, 128), (3, 192), (2, 100)):
        key = torch.randn(batch, 2, kv_len, 16, generator=g, dtype=torch.float64)
        value = torch.randn(batch, kv_len, 2, 16, generator=g, dtype=torch.float64).transpose(1, 2)
        k_one, v_one, t_one = hf_kv_as_paged(key, value, None)
        assert k_one.data_ptr() == key.data_ptr() and v_one.data_ptr() == value.data_ptr()
        k_p, v_p, t_p = hf_kv_as_paged(key, value, 16)
        zero_copy = k_p.data_ptr() == key.data_ptr()
        assert zero_copy == (kv_len % 16 == 0 and batch == 1), (batch, kv_len)
        # Same keys/values behind both views.
        for b in range(batch):
            for pos in (0, kv_len // 2, kv_len - 1):
                page, slot = divmod(pos, 16)
                torch.testing.assert_close(k_p[t_p[b, page], slot], key[b, :, pos], rtol=0, atol=0)
                torch.testing.assert_close(v_p[t_p[b, page], slot], value[b, :, pos], rtol=0, atol=0)
                torch.testing.assert_close(k_one[t_one[b, 0], pos], key[b, :, pos], rtol=0, atol=0)
        # Results do not depend on the page size (tiles are fixed in tokens).
        q = torch.randn(batch * 5, 4, 16, generator=g, dtype=torch.float64)
        cu = torch.arange(batch + 1, dtype=torch.int32) * 5
        lens = torch.full((batch,), kv_len, dtype=torch.int32)
        kw = dict(softmax_scale=1.0, skip_threshold=0.05, return_skip_counts=True, backend="torch")
        o1, c1 = paged_skip_softmax_attention(q, k_one, v_one, t_one, cu, lens, **kw)
        o2, c2 = paged_skip_softmax_attention(q, k_p, v_p, t_p, cu, lens, **kw)
        torch.testing.assert_close(o1, o2, rtol=0, atol=1e-12)
        assert torch.equal(c1, c2)


def test_padded_batch_is_a_clear_error(tiny_llama):
    model = mtsa.sparsify(tiny_llama(8), {"*self_attn*": {}})
    ids = random_ids(20, batch=2, seed=8)
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[0, :5] = 0
    expected = r"LlamaAttention \(model.layers.0.self_attn\).*not plain causal"
    with pytest.raises(mtsa.UnsupportedModelError, match=expected):
        _logits(model, ids, attention_mask=mask)
    # An all-ones mask is plain causal and runs.
    _logits(model, ids, attention_mask=torch.ones(2, 20, dtype=torch.long))


def test_unsupported_models_are_named():
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, sliding_window=16)  # fmt: skip
    mistral = MistralForCausalLM(cfg)
    with pytest.raises(mtsa.UnsupportedModelError, match="MistralAttention: sliding-window"):
        mtsa.sparsify(mistral, {"*self_attn*": {}})
    assert mistral.config._attn_implementation != mtsa.ATTN_IMPLEMENTATION  # nothing half-converted
    with pytest.raises(mtsa.UnsupportedModelError, match="Sequential is not a transformers PreTrainedModel"):
        mtsa.sparsify(torch.nn.Sequential(torch.nn.Linear(2, 2)), {"*": {}})


def test_generate_matches_dense(dense_and_copy):
    dense, model = dense_and_copy(seed=9)
    mtsa.sparsify(model, {"*self_attn*": {"thresholds": None}})
    ids = random_ids(90, seed=9)
    with torch.no_grad():
        ref = dense.generate(ids, max_new_tokens=12, do_sample=False)
        out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(out, ref)
    assert mtsa.realized_sparsity(model)["decode"] == 0.0  # decode steps went through the kernel


def test_package_import_is_light_and_registers_the_mode_on_use():
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import modelopt_ext.torch.sparsity.attention_sparsity as mtsa\n"
        "heavy = [m for m in ('modelopt', 'transformers', 'vllm') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "mtsa.SparseAttentionConfig\n"
        "from modelopt.torch.opt.mode import _ModeRegistryCls\n"
        "assert _ModeRegistryCls.get_from_any('modelopt_ext_sparse_attention').name == mtsa.MODE_NAME\n"
        "assert 'modelopt_ext.torch.sparsity.attention_sparsity.plugins.vllm' not in sys.modules\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
