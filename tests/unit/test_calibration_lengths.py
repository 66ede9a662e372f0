"""Calibration covers the lengths that are served (issue #67 item 3): the length bins reach --calib_max_seqlen, the
written block records the calibrated lengths, the calibration ends with one line naming them, and the serve script
warns once when its --max-model-len lies far beyond them. No engine: the refit path fits synthetic records."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from modelopt_ext.torch.sparsity.attention_sparsity.calibration.data import target_lengths
from modelopt_ext.torch.sparsity.attention_sparsity.cli import arguments

SMOL_LIKE = {"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 8192, "num_attention_heads": 9,
             "num_key_value_heads": 3}


def _config(lengths: dict | None) -> dict:
    producer = {"name": "modelopt_ext", "version": "0"}
    if lengths is not None:
        producer[arguments.CALIBRATION_LENGTHS_KEY] = lengths
    return {**SMOL_LIKE, "sparse_attention_config": {"config_groups": {}, "producer": producer}}


def test_exact_top_bins_reach_max_seqlen():
    assert target_lengths(8160, exact_top=True) == [8160, 4080, 2040, 1020]
    assert target_lengths(8160) == [4096, 2048, 1024, 512]  # powers of two stop up to half below (the library's)
    assert target_lengths(2048, exact_top=True) == target_lengths(2048) == [2048, 1024, 512, 256]
    assert target_lengths(3000, 700, exact_top=True) == [3000, 1500, 750]
    assert target_lengths(1000, 1000, exact_top=True) == [1000]
    with pytest.raises(ValueError, match="no length bin"):
        target_lengths(1000, 1001, exact_top=True)


def test_default_calibration_covers_the_models_context(tmp_path):
    """The README command's default: bins from the model's context minus --decode_tokens down, so serving at the
    model's context (vLLM's default --max-model-len) is inside the calibrated range (within one tile)."""
    plan_max, _ = arguments._check_lengths(
        arguments.argparse.Namespace(decode_tokens=32, calib_samples=24, calib_max_seqlen=None, calib_min_seqlen=None,
                                     prompts_file=None, max_model_len=None),
        SMOL_LIKE,
    )
    assert target_lengths(plan_max, exact_top=True)[0] == 8192 - 32


@pytest.mark.parametrize(
    ("serve_args", "expected"),
    [
        (["--max-model-len", "2048"], "--max-model-len 2048"),
        (["--max_model_len=2k"], "--max-model-len 2000"),
        (["--port", "1"], "the model's context (max_position_embeddings 8192; --max-model-len unset)"),
        (["--max-model-len", "-1"], "the model's context"),
    ],
)
def test_serve_warns_when_max_model_len_is_far_beyond_the_calibrated_lengths(serve_args, expected):
    note = arguments.served_length_warning(_config({"prefill": [124, 1017], "decode": [125, 1025]}), serve_args)
    assert note is not None and expected in note
    assert "prefill 124..1017, decode 125..1025" in note and "--calib_max_seqlen" in note


@pytest.mark.parametrize(
    ("lengths", "serve_args"),
    [
        ({"prefill": [250, 2047], "decode": [251, 2055]}, ["--max-model-len", "2048"]),  # the demo, calibrated
        ({"prefill": [1000, 8160], "decode": [1001, 8191]}, []),  # the README default at the model's context
        ({"prefill": [124, 1017]}, ["--max-model-len", "1500"]),  # within the factor
        (None, ["--max-model-len", "100000"]),  # an older calibration or another producer: nothing known
        ({"prefill": [124, 1017]}, ["--max-model-len", "lots"]),  # unreadable: vLLM itself will say so
        ({"prefill": "124..1017"}, ["--max-model-len", "100000"]),  # malformed record: ignored
    ],
)
def test_serve_is_quiet_within_the_calibrated_lengths(lengths, serve_args):
    assert arguments.served_length_warning(_config(lengths), serve_args) is None


def test_refit_records_the_calibrated_lengths_and_logs_them(tmp_path, caplog):
    """Calibration's end (here through --refit_from, the same fit and write as after an engine run): the block's
    producer names the fitted lengths, one line names the range, and the block still loads."""
    from modelopt_ext.torch.sparsity.attention_sparsity.calibration.fit import default_threshold_trials
    from modelopt_ext.torch.sparsity.attention_sparsity.checkpoint.calibration_records import (
        save_calibration_records,
    )
    from modelopt_ext.torch.sparsity.attention_sparsity.checkpoint.config_io import load_sparse_attention_config
    from modelopt_ext.torch.sparsity.attention_sparsity.cli import calibrate

    trials = default_threshold_trials()
    rng = np.random.default_rng(3)
    kv_lens, is_decode, counts = [], [], []
    for n in (256, 512, 1024, 2048):
        for decode in (False, True):
            for step in range(3):
                s = np.clip((np.log(np.array(trials)) + 0.5 * np.log(n) - 4 + rng.normal(0, 0.2)) / 9, 0, 1)
                kv_lens.append(n + (step + 1 if decode else 0)), is_decode.append(decode)
                counts.append(np.stack([np.full(len(trials), 10_000), (s * 10_000).astype(np.int64)], 1))
    merged = dict(layers=["l"], scale_factors=trials, kv_lens=kv_lens, is_decode=is_decode, counts=np.array(counts))
    records = save_calibration_records(tmp_path / "r.records.npz", merged, {"created": "test"})
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(SMOL_LIKE))

    with caplog.at_level(logging.INFO):
        code = calibrate.main([str(ckpt), "--refit_from", str(records), "--output", str(tmp_path / "c.json"),
                               "--update_checkpoint_config"])
    assert code == 0
    config = json.loads((ckpt / "config.json").read_text())
    lengths = arguments.calibrated_lengths(config["sparse_attention_config"])
    assert lengths == {"prefill": (256, 2048), "decode": (257, 2051)}
    assert json.loads((tmp_path / "c.json").read_text())["producer"][arguments.CALIBRATION_LENGTHS_KEY] == {
        "prefill": [256, 2048], "decode": [257, 2051]}
    lines = [r.getMessage() for r in caplog.records if "calibrated length range" in r.getMessage()]
    assert lines == ["calibrated length range: prefill 256..2048, decode 257..2051 tokens; serve with "
                     "--max-model-len up to about 2051: longer prompts get the law extrapolated in length (the serve "
                     "script warns; --calib_max_seqlen widens the range)"]
    assert load_sparse_attention_config(ckpt) is not None  # the producer's extra key is kept, not refused
    assert arguments.served_length_warning(config, ["--max-model-len", "2048"]) is None
    assert "--max-model-len 8000" in arguments.served_length_warning(config, ["--max-model-len", "8000"])
