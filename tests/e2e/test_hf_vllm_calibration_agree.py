"""The Hugging Face path and the vLLM path calibrate the same way on the same prompts (issue #13).

Three short prompts (held-out prose, a RULER-style needle-in-a-haystack, held-out code; 300..700 tokens) go through

- the vLLM path as a user runs it: `calibrate_sparse_attn.py --prompts_file ... --dtype float32` in a subprocess
  (vLLM's CPU engine, default multi-process engine), which keeps its raw records beside the written config;
- the HF path in this process: the same checkpoint in float32 through transformers, `mtsa.sparsify` then
  `mtsa.calibrate` with a forward loop that runs `calibration.calibrate.run_sample` on the same token ids, with the
  same scale-factor trials as the records.

Both sides run float32 with the compiled CPU kernel, so the samples are paired one to one (prefill: one per prompt,
law length = prompt length; decode: one per (prompt, step), law length = position + 1) and every trial's sparsity
must agree to float rounding, and both phase fits must agree. Both fits come from `calibration.fit.fit_phase`.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
from e2e_lib import CALIBRATE, env

from modelopt_ext.torch.sparsity.attention_sparsity.checkpoint.config_io import linked_checkpoint_copy

pytestmark = pytest.mark.e2e

DECODE_TOKENS = 8
CHUNK_SIZE = 4096  # longer than every prompt: one prefill forward, as vLLM runs these prompts (budget 4096)
# Per (sample, trial): |Δ skipped|, the net count of row-tiles the paths decide differently (float rounding of the
# scores in two model implementations flips a tile whose max lies right at ln λ), and that in sparsity. One decode
# flip is 1/visited ≈ 3.4e-4 at n ≈ 700 (30 layers x 9 heads x 11 tiles). Measured 2026-12-01 (SmolLM2, 2 busy
# cores), over all samples and trials: prefill |Δ skipped| sums to 10 of 3.8e7 decisions, at most 1 per point
# (|Δ sparsity| <= 4.3e-6); decode 1 of 8.9e5, at most 1 per point (3.4e-4); equal decode counts: same greedy tokens.
POINT_TOL = 1e-3
MAX_FLIPS = 4
DIFFERING_TOL = 1e-5  # of all (row-tile, trial) decisions of a phase; measured <= 1.1e-6
# Fit parameters on the paired samples. Measured: prefill |Δ ln a| 2.5e-6, |Δ b| 7.5e-6, |Δ γ| 7.6e-6; decode
# 3.8e-6, 2.2e-5, 0 (γ = 4.0 on both, the fit's upper clip).
LN_A_TOL, B_TOL, GAMMA_TOL = 1e-4, 1e-4, 1e-4


def _prompts(tokenizer) -> list[str]:
    from modelopt_ext.torch.sparsity.attention_sparsity.calibration import data, natural_text

    prose, _ = natural_text.heldout_prompt(tokenizer, "prose", 300, seed=0)
    code, _ = natural_text.heldout_prompt(tokenizer, "code", 700, seed=0)
    (needle,) = data.build_calibration_prompts(tokenizer, num_samples=1, max_seqlen=512, min_seqlen=512, seed=0,
                                               tasks=("niah_needle",), use_cache=False)  # fmt: skip
    # Lengths 2.3x apart, so both fits include the length exponent γ (fit.MIN_LENGTH_SPAN is 1.5).
    return [prose, needle.prompt, code]


@pytest.fixture(scope="module")
def both_paths(smollm2_checkpoint, tmp_path_factory):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import modelopt_ext.torch.sparsity.attention_sparsity as mtsa
    from modelopt_ext.torch.sparsity.attention_sparsity.calibration.calibrate import run_sample
    from modelopt_ext.torch.sparsity.attention_sparsity.checkpoint.calibration_records import (
        load_calibration_records,
    )

    work = tmp_path_factory.mktemp("hf_vllm_agree")
    ckpt = linked_checkpoint_copy(smollm2_checkpoint, work / "ckpt")
    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    prompts = _prompts(tokenizer)
    prompts_file = work / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))

    # vLLM path: the calibrate script as a user runs it.
    output = work / "sparse_attention_config.json"
    cmd = [sys.executable, str(CALIBRATE), str(ckpt), "--prompts_file", str(prompts_file), "--decode_tokens",
           str(DECODE_TOKENS), "--dtype", "float32", "--output", str(output)]  # fmt: skip
    proc = subprocess.run(cmd, env=env(), cwd=work, capture_output=True, text=True, timeout=800)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    merged, _ = load_calibration_records(output.with_name("sparse_attention_config.records.npz"))
    scale_factors = list(merged["scale_factors"])

    # HF path: the same checkpoint, prompts, token ids (what vLLM's tokenizer makes: `tokenizer(prompt)`, special
    # tokens as the tokenizer adds them; SmolLM2 adds none) and trials.
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    model = mtsa.sparsify(model, mtsa.SKIP_SOFTMAX_DEFAULT)
    states = mtsa.sparse_attention_states(model, enabled_only=True)
    token_ids = [tokenizer(p, return_tensors="pt").input_ids for p in prompts]
    seen = {}

    def forward_loop(m):
        seen["collector"] = next(iter(states.values())).collector  # the shared collector mtsa.calibrate set up
        for ids in token_ids:
            run_sample(m, ids, chunk_size=CHUNK_SIZE, decode_tokens=DECODE_TOKENS)

    calib = {"target_sparse_ratio": {"prefill": 0.5, "decode": 0.5}, "threshold_trials": scale_factors}
    mtsa.calibrate(model, {"sparse_cfg": {**mtsa.SKIP_SOFTMAX_DEFAULT["sparse_cfg"], "calibration": calib}},
                   forward_loop)  # fmt: skip
    return {
        "merged": merged,
        "config": json.loads(output.read_text()),
        "scale_factors": scale_factors,
        "prompt_lens": [ids.shape[1] for ids in token_ids],
        "hf_records": seen["collector"].records,
        "hf_calibration": {p: [s.calibration[p] for s in states.values()] for p in ("prefill", "decode")},
    }


def _vllm_samples(merged) -> dict[tuple[str, int], np.ndarray]:
    """(phase, law length) -> counts [T, 2] of each sequence-step of the merged vLLM record."""
    out = {}
    for n, is_decode, counts in zip(merged["kv_lens"].tolist(), merged["is_decode"].tolist(), merged["counts"],
                                    strict=True):  # fmt: skip
        key = ("decode" if is_decode else "prefill", n)
        assert key not in out, f"two vLLM samples {key}: the prompts' lengths must differ by > {DECODE_TOKENS}"
        out[key] = np.asarray(counts, dtype=np.int64)
    return out


def _hf_samples(records) -> dict[tuple[str, int], np.ndarray]:
    """(phase, law length) -> counts [T, 2] of each HF sample (per-layer records summed, as `aggregate_counts`)."""
    by_sample = {}
    for r in records:
        key = (r.phase, r.seq_id, r.kv_len)
        counts = np.asarray(r.counts, dtype=np.int64)
        by_sample[key] = counts if key not in by_sample else by_sample[key] + counts
    out = {}
    for (phase, _, n), counts in by_sample.items():
        assert (phase, n) not in out, f"two HF samples {(phase, n)}"
        out[(phase, n)] = counts
    return out


def _paired(both_paths):
    vllm, hf = _vllm_samples(both_paths["merged"]), _hf_samples(both_paths["hf_records"])
    # --decode_tokens 8 and run_sample(decode_tokens=8) both generate 8 tokens: 7 decode steps after the prefill.
    assert set(vllm) == set(hf), f"samples differ: vLLM only {sorted(set(vllm) - set(hf))}, HF only " \
        f"{sorted(set(hf) - set(vllm))}"  # fmt: skip
    return vllm, hf


def test_same_prompts_same_samples(both_paths):
    vllm = _vllm_samples(both_paths["merged"])
    prefill = sorted(n for phase, n in vllm if phase == "prefill")
    assert prefill == sorted(both_paths["prompt_lens"])  # same token ids count on both sides: same tokenization
    assert 300 >= min(prefill) >= 250 and 700 >= max(prefill) >= 600, prefill
    for n in prefill:  # decode law length = position + 1, on both sides
        assert [k for p, k in vllm if p == "decode" and n < k <= n + DECODE_TOKENS] == list(
            range(n + 1, n + DECODE_TOKENS)
        )
    hf = _hf_samples(both_paths["hf_records"])
    for n in prefill:
        assert [k for p, k in sorted(hf) if p == "decode" and n < k <= n + DECODE_TOKENS] == list(
            range(n + 1, n + DECODE_TOKENS)
        )


def test_every_trial_of_every_sample_agrees(both_paths):
    vllm, hf = _paired(both_paths)
    trials = np.asarray(both_paths["scale_factors"])
    worst = {phase: {"sparsity": 0.0, "tiles": 0, "differing": 0, "decisions": 0} for phase in ("prefill", "decode")}
    for (phase, n), v in vllm.items():
        h = hf[(phase, n)]
        # Visited row-tiles are geometry only (rows, heads, tiles of the law length): exactly equal.
        assert np.array_equal(v[:, 0], h[:, 0]), (phase, n, v[:, 0], h[:, 0])
        used = (trials < n) & (v[:, 0] > 0)  # the trials `aggregate_counts` turns into fit points
        assert used.sum() >= 10, (phase, n)
        flips = np.abs(v[used, 1] - h[used, 1])
        w = worst[phase]
        w["sparsity"] = max(w["sparsity"], float((flips / v[used, 0]).max()))
        w["tiles"] = max(w["tiles"], int(flips.max()))
        w["differing"] += int(flips.sum())
        w["decisions"] += int(v[used, 0].sum())
    for phase, w in worst.items():
        ok = w["differing"] <= DIFFERING_TOL * w["decisions"]
        assert w["sparsity"] <= POINT_TOL and w["tiles"] <= MAX_FLIPS and ok, (
            f"{phase}: |Δ sparsity| up to {w['sparsity']:.3g} (tolerance {POINT_TOL}), up to {w['tiles']} row-tiles "
            f"decided differently (tolerance {MAX_FLIPS}); decode: did the greedy tokens diverge? {worst}"
        )
    assert sum(v[:, 1].sum() for v in vllm.values()) > 0  # something was skipped to compare


def test_both_phase_fits_agree(both_paths):
    from modelopt_ext.torch.sparsity.attention_sparsity.calibration.fit import (
        CalibrationRecord,
        aggregate_counts,
        fit_phases,
        points_from_merged_record,
    )

    vllm, hf = _paired(both_paths)
    trials = both_paths["scale_factors"]
    vllm_fits = fit_phases(points_from_merged_record(both_paths["merged"]))
    hf_fits = fit_phases(aggregate_counts([CalibrationRecord(p, n, c) for (p, n), c in hf.items()], trials))
    for phase in ("prefill", "decode"):
        v, h = vllm_fits[phase], hf_fits[phase]
        assert v.reference_length is not None and h.reference_length is not None, "lengths too close for γ"
        assert abs(math.log(v.a) - math.log(h.a)) <= LN_A_TOL, (phase, v, h)
        assert abs(v.b - h.b) <= B_TOL, (phase, v, h)
        assert abs(v.length_exponent - h.length_exponent) <= GAMMA_TOL, (phase, v, h)
        assert v.n_points == h.n_points and v.n_points >= 20, (phase, v, h)


def test_both_paths_fit_with_the_same_code(both_paths):
    """The script's written config is `fit_phases` of its records, and `mtsa.calibrate` stored `fit_phase` of its
    own records: one implementation, `calibration.fit.fit_phase`, on both paths."""
    from modelopt_ext.torch.sparsity.attention_sparsity.calibration import calibrate, fit

    assert calibrate.fit_phase is fit.fit_phase and calibrate.aggregate_counts is fit.aggregate_counts
    group = both_paths["config"]["config_groups"]["group_0"]
    vllm_fits = fit.fit_phases(fit.points_from_merged_record(both_paths["merged"]))
    hf_fits = fit.fit_phases(fit.aggregate_counts(both_paths["hf_records"], both_paths["scale_factors"]))
    for phase in ("prefill", "decode"):
        assert group["threshold_scale_factor"][phase] == {"a": vllm_fits[phase].a, "b": vllm_fits[phase].b}
        assert group["length_exponent"][phase] == vllm_fits[phase].length_exponent
        assert group["reference_length"][phase] == vllm_fits[phase].reference_length
        expected = hf_fits[phase].to_phase_calibration(0.5)
        assert all(c == expected for c in both_paths["hf_calibration"][phase]), (phase, expected)
