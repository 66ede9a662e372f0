"""The kernel benchmark and the GPU check script run end to end on the CPU (small shapes, dry run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from benchmark_modules import load_benchmark, load_script

REPO = Path(__file__).resolve().parents[2]


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(x for x in (str(REPO), env.get("PYTHONPATH")) if x)
    env.pop("OUT", None)
    return env


def test_bench_kernels_cpu_quick(tmp_path):
    out = tmp_path / "bench"
    cmd = [sys.executable, str(REPO / "benchmarks" / "bench_kernels.py"), "--device", "cpu", "--quick",
           "--out", str(out), "--modelopt", "kernel-only", "--sparsities", "0.5,0.7", "--target-seconds", "0.05",
           "--synthetic"]
    r = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "ModelOpt baseline:" in r.stdout
    assert "2/(2-s)" in r.stdout
    data = json.loads((out / "results.json").read_text())
    rows = data["summary"]
    assert {row["case"] for row in rows} >= {"dense", "tiny", "s50", "s70"}
    assert {row["shape"].split()[0] for row in rows} == {"prefill", "decode"}
    for row in rows:
        assert row["ours_ms"] and row["ours_ms"] > 0, row
        assert row["sdpa_ms"] and row["sdpa_ms"] > 0, row
        assert not row["error"], row
    dense = [row for row in rows if row["case"] == "dense"]
    assert all(row["check"] == "ok" for row in dense), dense  # our dense output matches SDPA dense
    tiny = [row for row in rows if row["case"] == "tiny"]
    assert all(row["sparsity"] == 0.0 for row in tiny), tiny
    for row in rows:
        if row["case"] == "s50":
            assert 0.35 <= row["sparsity"] <= 0.65, row  # the λ search hit the target on this data
            assert row["program_share"] <= row["sparsity"] + 1e-9  # programs skip what all their rows drop
            assert abs(row["bound"] - 2 / (2 - row["program_share"])) < 1e-9
    for name in ("results.csv", "summary.csv", "table.txt"):
        assert (out / name).stat().st_size > 0


def test_bench_shapes_and_args():
    bench = load_benchmark("bench_kernels", "bench_kernels_under_test")
    args = bench.parse_args(["--device", "cpu", "--prefill-lens", "1024,2048", "--decode-shapes", "2:4096",
                             "--page-sizes", "16,64", "--heads", "4", "--kv-heads", "2", "--head-dim", "64"])
    shapes = bench.build_shapes(args)
    labels = [s.label for s in shapes]
    assert labels[0].startswith("prefill B=1 L=1k") and labels[1].startswith("decode B=2 L=4k")
    assert any(s.page_size == 64 for s in shapes)
    assert args.dtype == "fp32" and args.backend == "torch"
    inp = bench.Inputs(bench.Shape("decode", 2, 300, 4, 2, 64, 16), bench.DTYPES["fp32"], "cpu", seed=0)
    # The paged cache holds exactly the contiguous copy SDPA sees.
    for b in range(2):
        pages = inp.block_table[b].long()
        k = inp.k_cache[pages].reshape(-1, 2, 64)[:300]
        assert (k.permute(1, 0, 2) == inp.k_dense[b]).all()
    assert inp.q.abs().sum() > 0 and inp.v_dense.std() > 0.5


def test_gpu_check_refuses_to_start_without_real_attention_inputs(tmp_path):
    """The benchmark runs on captured real attention: without a capture (and no --inputs / --synthetic) the GPU
    check stops before anything runs, exit status 2, naming the capture command and what to carry."""
    check = load_script(REPO / "scripts" / "gpu_check.py", "gpu_check_under_test")
    empty = tmp_path / "captures"
    empty.mkdir()
    problem = check.bench_inputs_problem("", empty)
    assert "attention_inputs.py capture" in problem and ".cache/attention_inputs" in problem
    assert check.bench_inputs_problem("--synthetic", empty) is None
    assert check.bench_inputs_problem("--inputs x.npz --quick", empty) is None
    (empty / "SmolLM2_code_L11_8192.npz").write_bytes(b"not read here")
    assert check.bench_inputs_problem("", empty) is None
    if not any(check.CAPTURES.glob("*.npz")):  # as a user without a capture runs it
        proc = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_check.py"), "--out", str(tmp_path / "o")],
                              cwd=REPO, env=_env(), capture_output=True, text=True, timeout=240)
        assert proc.returncode == 2 and "no captured attention inputs" in proc.stderr, proc.stderr
        assert not (tmp_path / "o").exists()


def test_gpu_check_args_and_dry_run(tmp_path, monkeypatch):
    """The dry run checks the script's wiring (every phase's command, log and summary line), not speed: --budget
    does not apply there (a small one is passed to show it), each phase gets DRY_RUN_PHASE_TIMEOUT, so a loaded
    machine passes. The subprocess timeout stays below pytest's 900 s of the unit stage."""
    check = load_script(REPO / "scripts" / "gpu_check.py", "gpu_check_under_test")
    monkeypatch.setenv("OUT", str(tmp_path / "from_env"))
    assert check.parse_args([]).out == str(tmp_path / "from_env")
    assert check.parse_args(["--out", "x", "--budget", "60"]).budget == 60
    dry = check.Runner(tmp_path, budget=1.0, dry_run=True)
    assert dry.phase_timeout(30.0, 150.0) == check.DRY_RUN_PHASE_TIMEOUT  # the budget is spent: the dry run ignores it
    dry.log_fh.close()

    out = tmp_path / "check"
    cmd = [sys.executable, str(REPO / "scripts" / "gpu_check.py"), "--dry-run", "--out", str(out),
           "--tests-path", "tests/unit/kernels", "--budget", "1",
           "--bench-args",
           "--sparsities 0.5 --prefill-lens 1024 --decode-shapes 2:2048 --target-seconds 0.05 --synthetic"]
    r = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=780)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-3000:]
    text = (out / "summary.txt").read_text()
    assert "GPU CHECK SUMMARY" in text and "gpu tests:" in text and "benchmark: ok" in text
    assert "graphs: ok" in text and "self-test float32: passed" in text
    assert "tune: ok" in text and "w2 s3 exp" in text and "counts equal" in text
    assert "tune d64: ok" in text and "q64 w4 s2 split prefetch" in text
    assert "prefill B=1 L=1k" in text and "decode B=2 L=2k" in text
    summary = json.loads((out / "summary.json").read_text())
    assert summary["phases"]["benchmark"]["status"] == "ok"
    assert summary["bench_rows"]
    for name in ("gpu_check.log", "env.txt", "pytest.log", "bench.log", "bench/results.json", "graphs/graphs.json",
                 "tune/tune.json", "tune_d64/tune.json"):
        assert (out / name).is_file(), name


def test_fidelity_engine_reads_the_config_law_and_refits_modelopts_from_its_records(tmp_path):
    """`fidelity.py --config`: the length law as written, ModelOpt's 1/kv_len law refitted from the kept records."""
    import math

    import numpy as np

    from modelopt_ext.torch.sparsity.attention_sparsity.calibration.fit import (
        default_threshold_trials,
        fit_phases,
        points_from_merged_record,
    )
    from modelopt_ext.torch.sparsity.attention_sparsity.checkpoint.calibration_records import (
        records_path_for,
        save_calibration_records,
    )
    from modelopt_ext.torch.sparsity.attention_sparsity.checkpoint.config_io import (
        build_sparse_attention_config,
    )

    engine = load_benchmark("fidelity_engine", "fidelity_engine_under_test")
    trials = default_threshold_trials()
    rng = np.random.default_rng(7)
    kv_lens, is_decode, counts = [], [], []
    for n in (512, 1024, 2048, 4096):  # sparsity a function of ln λ + 1.5·ln n (γ = 1.5)
        for decode in (False, True):
            for _ in range(3):
                visited = 10_000
                s = np.clip((np.log(np.array(trials)) + 0.5 * np.log(n) - 4 + rng.normal(0, 0.2)) / 9, 0, 1)
                kv_lens.append(n), is_decode.append(decode)
                counts.append(np.stack([np.full(len(trials), visited), (s * visited).astype(np.int64)], 1))
    merged = dict(layers=["l"], scale_factors=trials, kv_lens=kv_lens, is_decode=is_decode, counts=np.array(counts))
    fits = fit_phases(points_from_merged_record(merged))
    config = tmp_path / "sparse_attention_config.json"
    config.write_text(json.dumps(build_sparse_attention_config(fits, target_sparsity=0.5)))
    save_calibration_records(records_path_for(config), merged, {"created": "test"})

    laws, source = engine.laws_from_config(config, ["length", "modelopt"])
    assert source["records"] == str(records_path_for(config))
    for phase in ("prefill", "decode"):
        length, modelopt = laws["length"][phase], laws["modelopt"][phase]
        assert abs(length.length_exponent - fits[phase].length_exponent) < 1e-9 and length.length_exponent > 1.2
        assert length.length_exponent_slope == pytest.approx(fits[phase].length_exponent_slope, abs=1e-9)
        assert modelopt.length_exponent == 1.0 and modelopt.length_exponent_slope == 0.0
        for t in (0.3, 0.7):
            assert math.isclose(length.log_scale_factor(t), fits[phase].log_scale_factor(t), rel_tol=1e-9)
    c_pre, c_dec, g_pre, g_dec = engine.trial_law(laws["length"], 0.3)
    assert math.isclose(c_pre - g_pre * math.log(1000), math.log(laws["length"]["prefill"].threshold(0.3, 1000)))
    assert math.isclose(c_dec - g_dec * math.log(1000), math.log(laws["length"]["decode"].threshold(0.3, 1000)))
    # without records only the written law is measured
    records_path_for(config).unlink()
    assert set(engine.laws_from_config(config, ["length", "modelopt"])[0]) == {"length"}


def test_fidelity_batch_check_separates_phases_and_names_prompts_whose_tokens_differ():
    import numpy as np

    engine = load_benchmark("fidelity_engine", "fidelity_engine_under_test")
    alone = np.array([[1000, 400], [50, 20]])
    same = engine.batch_comparison(alone, alone.copy(), [[1, 2], [3, 4]], [[1, 2], [3, 4]])
    assert same["equal"] and same["prefill_equal"] and same["decode_equal"] and same["tokens_differ"] == []
    other = engine.batch_comparison(alone, np.array([[1000, 400], [50, 21]]), [[1, 2], [3, 4]], [[1, 2], [3, 5]])
    assert other["prefill_equal"] and not other["decode_equal"] and not other["equal"]
    assert other["tokens_differ"] == [1] and other["batch"] == [[1000, 400], [50, 21]]


def test_fidelity_summary_reports_single_documents_and_their_spread_around_the_pooled_cell(tmp_path):
    """A cell pools its documents' counts; the summary also scores each document as a cell of its own."""
    import numpy as np

    engine = load_benchmark("fidelity_engine", "fidelity_engine_under_test")
    fidelity = load_benchmark("fidelity", "fidelity_under_test")
    # two documents of one cell at target 0.3: prefill 0.25 and 0.45 of equal weight (pooled 0.35), decode 0.2 / 0.3
    docs = [np.array([[1000, 250], [100, 20]]), np.array([[1000, 450], [300, 90]])]
    pooled = engine.phase_ratios(sum(docs))
    assert pooled == {"prefill": 0.35, "decode": 110 / 400}
    assert engine.phase_ratios(np.array([[0, 0], [10, 1]]))["prefill"] is None
    documents = [dict(seed=i, realized={"length": {0.3: engine.phase_ratios(d)}}) for i, d in enumerate(docs)]
    reachable = {"length": {0.3: {"prefill": False, "decode": False}}}
    cell = dict(realized={"length": {0.3: pooled}}, unreachable=reachable, documents=documents)
    summary = fidelity.summarize([cell], [0.3], "length")
    pre, dec = summary["prefill"], summary["decode"]
    assert pre["max_abs_error"] == pytest.approx(0.05) and pre["cells"] == 1
    assert pre["per_document"]["max_abs_error"] == pytest.approx(0.15) and pre["per_document"]["documents"] == 2
    assert pre["per_document"]["within_0_05"] == 1 and pre["per_document"]["within_0_10"] == 1
    assert pre["document_spread"]["rms"] == pytest.approx(0.10) and pre["document_spread"]["max"] == pytest.approx(0.10)
    assert dec["per_document"]["max_abs_error"] == pytest.approx(0.10)
    assert pre["per_order"][0]["max_abs_error"] == pytest.approx(0.05) and pre["per_order"][0]["cells"] == 1
    assert pre["per_order"][1]["max_abs_error"] == pytest.approx(0.15) and pre["per_order"][1]["within_0_10"] == 0
    # a one-document cell has no spread to report
    single = dict(cell, documents=cell["documents"][:1])
    assert "per_document" not in fidelity.summarize([single], [0.3], "length")["prefill"]
    # the plot draws the pooled cell and, faintly, each of its documents
    cells = [dict(cell, source="prose", length=1024), dict(single, source="code", length=1024)]
    fidelity.plot(cells, [0.3], ["prose", "code"], "length", tmp_path / "fidelity_length.png")
    assert (tmp_path / "fidelity_length.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_prefill_fma_bound_counts_and_bound():
    """studies/prefill_fma_bound.py: the multiply-adds of a causal call (also with a cached prefix) match a count of the
    visible (row, key) pairs of the mask, and the table's best speedup is native / (peak time × (2 − s) / 2)."""
    import torch

    fma_bound = load_benchmark("studies/prefill_fma_bound", "prefill_fma_bound_under_test")
    bench_cpu = fma_bound.bench_cpu
    for q_len, kv_len in ((1, 1), (7, 7), (5, 12), (64, 200)):
        rows = torch.arange(kv_len - q_len, kv_len)[:, None]
        visible = int((torch.arange(kv_len)[None, :] <= rows).sum())
        want = 2 * bench_cpu.HQ * bench_cpu.HEAD * visible
        assert fma_bound.causal_multiply_adds(q_len, kv_len) == want
    record = dict(kv_len=2048, multiply_adds=10**9, peak_per_s=5e10, realized={"s0.5": 0.5, "s0.7": 0.7},
                  seconds={"native": 0.05, "dense": 0.04, "s0.5": 0.03, "s0.7": 0.025})  # fmt: skip
    cells = [c.strip() for c in fma_bound.table_row(record).strip("|").split("|")]
    assert cells[3] == "20.0"  # ms at the peak
    assert cells[4] == "50.0 (40%)" and cells[5] == "40.0 (50%)"
    # bounds: s = 0.5, 20 ms × 0.75 = 15 ms (native / bound 3.33); s = 0.7, 20 ms × 0.65 = 13 ms (3.85)
    assert cells[6] == "30.0 (s 0.50), 1.67×, 3.33×"
    assert cells[7] == "25.0 (s 0.70), 2.00×, 3.85×"
