"""The real small model (SmolLM2-135M, built by `make model`): dense equality, skipping, generate()."""

from __future__ import annotations

import copy

import pytest
import torch

import modelopt_ext.torch.sparsity.attention_sparsity as mtsa


@pytest.fixture(scope="module")
def smollm2(smollm2_checkpoint):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_checkpoint)
    model = AutoModelForCausalLM.from_pretrained(smollm2_checkpoint, dtype=torch.float32, attn_implementation="sdpa")
    return tok, model.eval()


TEXT = (
    "The river keeps running past the old mill. Somewhere a bell rings and then stops. "
    "Remember this: the secret code for the blue door is 48213. "
) * 12 + "Question: what is the secret code for the blue door? Answer:"


def test_smollm2_dense_matches_sdpa_and_skips_when_asked(smollm2):
    tok, dense = smollm2
    ids = tok(TEXT, return_tensors="pt").input_ids
    assert ids.shape[1] > 256
    model = mtsa.sparsify(copy.deepcopy(dense), {"*self_attn*": {"thresholds": None}})
    assert len(mtsa.sparse_attention_states(model, enabled_only=True)) == 30
    with torch.no_grad():
        ref = dense(ids).logits
        out = model(ids).logits
    # fp32: the reference kernel and sdpa differ by summation order only.
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=2e-4)

    sparse = mtsa.sparsify(copy.deepcopy(dense), {"*self_attn*": {"thresholds": {"prefill": 0.1, "decode": 0.1}}})
    with torch.no_grad():
        out = sparse(ids).logits
        gen_dense = dense.generate(ids, max_new_tokens=8, do_sample=False)
        gen_sparse = sparse.generate(ids, max_new_tokens=8, do_sample=False)
    real = mtsa.realized_sparsity(sparse)
    assert real["prefill"] > 0.0 and real["decode"] is not None
    assert (out.argmax(-1) == ref.argmax(-1)).double().mean() > 0.9
    assert gen_sparse.shape == gen_dense.shape
