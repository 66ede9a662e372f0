"""Real attention inputs (benchmarks/attention_inputs.py) and the coherence report (benchmarks/coherence.py).

No download: a tiny random-weight Llama (2 layers, 4 heads, 2 KV heads, head 16) is written to a temporary folder
and captured from. Tolerances: the captured q/k/v reproduce the module's attention output within 2e-5 absolute
(float64 recomputation against transformers' float32 sdpa output, outputs O(1)); decisions are compared exactly.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from benchmark_modules import load_benchmark

REPO = Path(__file__).resolve().parents[2]


ai = load_benchmark("attention_inputs")
co = load_benchmark("coherence")  # its main imports attention_inputs by name: `ai`


@pytest.fixture(scope="module")
def tiny_capture(tmp_path_factory):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny_llama")
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=1024)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").eval()
    ids = torch.randint(0, 256, (1, 300), generator=torch.Generator().manual_seed(1))
    records = ai.capture_model(model, ids, [0, 1], keep_outputs=True)
    assert model.config._attn_implementation == "sdpa"  # restored
    return records


def test_capture_reproduces_the_attention_output(tiny_capture):
    for layer, r in tiny_capture.items():
        q, k, v = (r[n].double() for n in ("q", "k", "v"))
        assert q.shape == (300, 4, 16) and k.shape == (300, 2, 16) and v.shape == (300, 2, 16)
        assert r["scale"] == pytest.approx(16**-0.5)
        kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
        s = torch.einsum("qhd,khd->hqk", q, kk) * r["scale"]
        s.masked_fill_(torch.ones(300, 300, dtype=torch.bool).triu(1), -math.inf)
        out = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vv)
        err = (out - r["out"].double()).abs().max().item()
        assert err < 2e-5, (layer, err)


def test_file_round_trip_and_tile_to_shape(tiny_capture, tmp_path):
    r = tiny_capture[1]
    meta = dict(model="tiny", source="test", layer=1, heads=4, kv_heads=2, head_dim=16, tokens=300,
                softmax_scale=r["scale"])
    path = ai.save_inputs(tmp_path / "tiny_test_L1_300.npz", r["q"], r["k"], r["v"], meta)
    inp = ai.load_inputs(path)
    assert inp.meta["layer"] == 1 and inp.softmax_scale == r["scale"] and inp.length == 300
    for name in ("q", "k", "v"):
        assert getattr(inp, name).dtype == torch.float16
        assert torch.equal(getattr(inp, name), r[name].half())
    assert ai.default_inputs_path(tmp_path) == path

    for heads, kv_heads, head, length in ((8, 4, 32, 200), (4, 2, 16, 300), (12, 2, 64, 700)):
        q, k, v, scale = ai.tile_to_shape(inp, heads, kv_heads, head, length, dtype=torch.float32)
        assert q.shape == (length, heads, head) and k.shape == v.shape == (length, kv_heads, head)
        assert scale == inp.softmax_scale
        g, g_c = heads // kv_heads, 2
        pos = torch.arange(length) % 300
        for h in range(heads):
            kv = h // g
            kv_c = kv % 2
            h_c = kv_c * g_c + (h % g) % g_c
            # zero padding keeps every q·k exact: the scores are those of the captured head
            s = q[:, h] @ k[:, kv].T
            s_c = inp.q[pos, h_c].float() @ inp.k[pos, kv_c].float().T
            assert torch.equal(s, s_c), (heads, kv_heads, head, h)
            assert torch.equal(v[:, kv, :16], inp.v[pos, kv_c].float())
        assert (q[..., 16:] == 0).all() and (k[..., 16:] == 0).all()
    with pytest.raises(ValueError, match="smaller"):
        ai.tile_to_shape(inp, 4, 2, 8, 100)


def _structured(n: int, hq: int, hkv: int, d: int, seed: int = 0):
    """Peaky float64 attention (a sink at key 0, salient keys, recency) so every λ decides something."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(n, hkv, d, generator=gen, dtype=torch.float64)
    q = torch.randn(n, hq, d, generator=gen, dtype=torch.float64)
    k[0] *= 4
    k[torch.randperm(n, generator=gen)[: n // 50]] *= 3
    q[:, :, 0] += 3.0
    k[:, :, 0] += torch.linspace(0, 3, n, dtype=torch.float64)[:, None]
    v = torch.randn(n, hkv, d, generator=gen, dtype=torch.float64)
    return q, k, v


def test_coherence_decisions_equal_the_reference_counts():
    """coherence.py's per-row gaps against version 5's reference (the window's max joins it), protected by the
    recent window and reduced over the contract's units
    (`block_stat` over aligned 64-row blocks for a prompt, `group_stat` over a decode row's GQA group), count what
    the reference drops."""
    from modelopt_ext.torch.kernels.sparsity.attention import paged_skip_softmax_attention
    from modelopt_ext.torch.kernels.sparsity.attention.semantics import (
        DECISION_BLOCK_ROWS,
        first_droppable_window_tile,
        log_thresholds,
    )

    n, hq, hkv, d = 2200, 4, 2, 16  # past one 2048-key split: the anchor and the split restart are exercised
    q, k, v = _structured(n, hq, hkv, d)
    scale = d**-0.5
    gaps = co.sequence_gaps(q, k, scale, window_reference=True)
    assert gaps.dtype == torch.float64 and gaps.shape == (hq, n, -(-n // 64))
    tiles = torch.arange(gaps.shape[-1])
    in_window = tiles[None, :] >= first_droppable_window_tile(torch.arange(n))[:, None]  # [n, nt]
    gaps = gaps.masked_fill(in_window & co.visited_mask(n), math.inf)
    lams = [1e-6, 1e-3, 0.05, 0.3, 0.8]
    log_lams = log_thresholds(torch.tensor(lams)).tolist()
    stat, needed = co.block_stat(gaps, DECISION_BLOCK_ROWS)
    finite = stat[torch.isfinite(stat)]
    for ll in log_lams:  # no statistic within float rounding of a threshold (the contract leaves those open)
        assert (finite - ll).abs().min() > 1e-6
    table = torch.zeros(1, 1, dtype=torch.int32)
    cu = torch.tensor([0, n], dtype=torch.int32)
    lens = torch.tensor([n], dtype=torch.int32)
    _, counts = paged_skip_softmax_attention(q, k[None], v[None], table, cu, lens, softmax_scale=scale,
                                             threshold_trials=lams, backend="torch")
    visited = int(co.visited_mask(n).sum()) * hq
    rows_visiting = co.block_rows_visiting(n, DECISION_BLOCK_ROWS, gaps.shape[-1])  # [nb, nt]
    ours = [int((((stat < ll) & needed) * rows_visiting).sum()) for ll in log_lams]
    assert counts[0, :, 0].tolist() == [visited] * len(lams)
    assert counts[0, :, 1].tolist() == ours
    assert ours == sorted(ours) and ours[-1] > 0

    # a decode row (the last position) as the reference decides it: per GQA group
    gd = co.row_tile_gaps(q[-1:], k, scale, torch.tensor([n - 1]), window_reference=True)
    gd = gd.masked_fill(tiles[None, None, :] >= first_droppable_window_tile(n - 1), math.inf)
    _, c1 = paged_skip_softmax_attention(q[-1:], k[None], v[None], table, torch.tensor([0, 1], dtype=torch.int32),
                                         lens, softmax_scale=scale, skip_threshold=0.3, return_skip_counts=True,
                                         backend="torch")
    ll = log_lams[3]
    group_drops = co.drops(co.group_stat(gd, hq // hkv), ll)  # [Hkv, 1, nt]
    assert int(c1[0, 0, 1]) == int(group_drops.sum()) * (hq // hkv) > 0


def test_block_share_is_at_most_the_row_share_and_equal_for_one_row_blocks():
    n, hq, hkv, d = 700, 4, 2, 16
    q, k, _ = _structured(n, hq, hkv, d, seed=3)
    scale = d**-0.5
    gaps = co.sequence_gaps(q, k, scale)
    vis = co.visited_mask(n)
    for lam in (1e-3, 0.1, 0.6):
        ll = math.log(lam)
        row = float(co.drops(gaps, ll).sum()) / (int(vis.sum()) * hq)
        one = co.prefill_program_share(q, k, scale, lam, 1, max_blocks=None)
        assert one["program"] == pytest.approx(row) and one["row"] == pytest.approx(row)
        prev = row
        for rows in (16, 64, 128):
            stat, need = co.block_stat(gaps, rows)
            share = float(((stat < ll) & need).sum()) / (int(need.sum()) * hq)
            direct = co.prefill_program_share(q, k, scale, lam, rows, max_blocks=None)
            assert direct["program"] == pytest.approx(share) and direct["row"] == pytest.approx(row)
            assert share <= prev + 1e-12  # bigger blocks never skip more
            prev = share
            # a 128-key program tile is skipped iff both of its 64-key tiles are (those some row needs)
            s2, n2 = co.block_stat(gaps, rows, 128)
            st = torch.where(need, stat, torch.full_like(stat, -math.inf))
            st = torch.nn.functional.pad(st, (0, st.shape[-1] % 2), value=-math.inf)
            pairs = st.unflatten(-1, (-1, 2)).amax(-1)
            assert torch.equal((s2 < ll) & n2, (pairs < ll) & n2)
        grp = co.group_stat(gaps, hq // hkv)
        assert float(((grp < ll) & vis).sum()) / (int(vis.sum()) * hkv) <= row + 1e-12

    # the pooled bisection finds the λ of a target row share
    pool = co.Pool()
    pool.add(gaps, int(vis.sum()) * hq)
    ll, got = co.bisect(pool, 0.3)
    assert got == pytest.approx(0.3, abs=0.01) and pool.share(ll - 1e-3) <= got


def test_program_share_matches_the_direct_count():
    n, hq, hkv, d = 700, 4, 2, 16
    q, k, _ = _structured(n, hq, hkv, d, seed=5)
    scale = d**-0.5
    for lam in (1e-3, 0.2):
        direct = co.prefill_program_share(q, k, scale, lam, 64, max_blocks=None, window=True)
        share = co.ProgramShare(q, k, scale, "prefill", 64)  # the recent window by default (contract version 4)
        assert share.share(lam) == pytest.approx(direct["program"]) and share.row(lam) == pytest.approx(direct["row"])
        # a GQA group's work item skips a tile only when both heads' rows drop it
        assert co.ProgramShare(q, k, scale, "prefill", 64, group_heads=True).share(lam) <= share.share(lam) + 1e-12
        dec = co.ProgramShare(q, k, scale, "decode")
        want = co.decode_group_share(q[-1], k, scale, lam, window=True)
        assert dec.share(lam) == pytest.approx(want["program"]) and dec.row(lam) == pytest.approx(want["row"])
    assert co.ProgramShare(q, k, scale, "prefill", 64).share(None) == 0.0


def test_bench_kernels_runs_on_a_capture_and_refuses_to_run_without_one(tmp_path):
    import json
    import os
    import subprocess

    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("OUT", None)
    bench = [sys.executable, str(REPO / "benchmarks" / "bench_kernels.py"), "--device", "cpu", "--quick",
             "--modelopt", "off", "--target-seconds", "0.02"]
    r = subprocess.run(bench + ["--inputs", str(tmp_path / "missing.npz")], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode != 0 and "attention_inputs.py capture" in r.stderr, r.stderr[-2000:]

    q, k, v = _structured(600, 4, 2, 16, seed=2)
    path = ai.save_inputs(tmp_path / "cap.npz", q, k, v, dict(model="test", source="code", layer=0, heads=4,
                                                               kv_heads=2, head_dim=16, tokens=600,
                                                               softmax_scale=0.25))
    out = tmp_path / "bench"
    r = subprocess.run(bench + ["--inputs", str(path), "--prefill-lens", "512", "--decode-shapes", "2:600",
                                "--sparsities", "0.5", "--out", str(out)],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    data = json.loads((out / "results.json").read_text())
    assert data["meta"]["inputs"]["source"] == "code"
    rows = [row for row in data["summary"] if row["case"] == "s50"]
    assert len(rows) == 2
    for row in rows:
        assert 0 <= row["program_share"] <= row["sparsity"] + 1e-9
        assert row["bound"] == pytest.approx(2 / (2 - row["program_share"]))
