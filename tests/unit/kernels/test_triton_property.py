"""Property test: Triton (interpreter) vs the float64 oracle of docs/skip_softmax.md over random shapes."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("hypothesis")  # the GPU machine may lack it; collection must not fail there

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from skip_attention_helpers import log_lams_tensor, make_case, oracle, safe_log_lambda  # noqa: E402

from modelopt_ext.torch.kernels.sparsity.attention import paged_skip_softmax_attention  # noqa: E402

# (q_len, extra keys before the new tokens, decode rows at the end of the call): rows reach pos >= 255 (tiles before
# the recent window), calls start anywhere (mid-block included), and the last rows of a call may be decode rows
sequence = st.tuples(st.integers(0, 140), st.integers(0, 330), st.integers(0, 12))


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seqs=st.lists(sequence, min_size=1, max_size=4),
    hkv=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2, 3]),
    d=st.sampled_from([16, 32, 48]),
    page=st.sampled_from([16, 32, 64]),
    calibrate=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.float16]),
    seed=st.integers(0, 2**16),
)
def test_triton_matches_oracle(seqs, hkv, group, d, page, calibrate, dtype, seed):
    q_lens = [q for q, _, _ in seqs]
    kv_lens = [max(q + extra, 1) for q, extra, _ in seqs]
    prompt_lens = [kv - tail for (_, _, tail), kv in zip(seqs, kv_lens, strict=True)]
    case = make_case(q_lens, kv_lens, hq=hkv * group, hkv=hkv, d=d, page=page, dtype=dtype, seed=seed)
    g = torch.Generator().manual_seed(seed)
    lams = torch.exp(torch.empty(case.batch, 2).uniform_(math.log(1e-3), math.log(0.9), generator=g))
    lams[0, 0] = 1.0  # a dense sequence
    # nudged off the unit statistics of these prompt lengths (decode rows decide per GQA group, prompt rows per block)
    stats = oracle(case, None, law=(torch.full((case.batch, 1, 2), -math.inf), torch.zeros(case.batch, 2),
                                    prompt_lens)).tile_stats  # fmt: skip
    for b in range(case.batch):
        for t in range(2):
            if lams[b, t] < 1.0:
                lams[b, t] = math.exp(safe_log_lambda(math.log(float(lams[b, t])), stats[b]))
    total_q = case.q.shape[0]
    out = torch.full((total_q + 1, hkv * group, d), math.nan, dtype=dtype)
    kw = {"threshold_trials": lams} if calibrate else {"skip_threshold": lams[:, 0].contiguous()}
    _, counts = paged_skip_softmax_attention(
        *case.args(), softmax_scale=case.scale, return_skip_counts=True, out=out, backend="triton",
        prompt_lens=torch.tensor(prompt_lens, dtype=torch.int32), **kw,
    )  # fmt: skip
    log_lams = log_lams_tensor(lams if calibrate else lams[:, :1], case.batch).double()
    law = (log_lams.unsqueeze(-1).expand(-1, -1, 2), torch.zeros(case.batch, 2), prompt_lens)
    expected = oracle(case, None, calibrate=calibrate, law=law)
    assert torch.equal(counts, expected.counts)
    assert torch.isnan(out[total_q:]).all()
    tol = 3e-5 if dtype == torch.float32 else 4e-3
    torch.testing.assert_close(out[:total_q].double(), expected.out, atol=tol, rtol=max(tol, 1e-4))
