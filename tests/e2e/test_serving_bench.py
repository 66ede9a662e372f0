"""The serving benchmark's smoke configuration end to end on vLLM's CPU engine: `benchmarks/serving.py --quick`
starts the dense and the sparse server from one sparse checkpoint, runs vLLM's `vllm bench serve` on both, and
writes one JSON with dense and sparse rows (TTFT and TPOT measured) and one PNG."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
from e2e_lib import REPO, env, fixed_fit_checkpoint

pytestmark = pytest.mark.e2e


NO_PANDAS = "vllm bench serve reads its custom dataset with pandas (vLLM's bench extra): pip install pandas"


@pytest.mark.skipif(importlib.util.find_spec("pandas") is None, reason=NO_PANDAS)
def test_quick_run_writes_dense_and_sparse_rows(smollm2_checkpoint, tmp_path):
    """Eager servers and no warm-up keep it short (the compiled default adds minutes of torch.compile per server)."""
    ckpt = fixed_fit_checkpoint(smollm2_checkpoint, tmp_path / "ckpt")
    out = tmp_path / "out"
    cmd = [sys.executable, str(REPO / "benchmarks" / "serving.py"), "--checkpoint", str(ckpt), "--quick",
           "--concurrency", "1", "--no-mixed", "--no-warmup", "--server-arg=--enforce-eager",
           "--out-dir", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "[512 c=1] sparse0.5: TTFT" in proc.stderr  # progress lines while it runs
    data = json.loads((out / "serving.json").read_text())
    rows = {row["server"]: row for row in data["summary"]["rows"]}
    assert set(rows) == {"dense", "sparse"}
    for row in rows.values():
        assert row["completed"] == 2 and row["mean_ttft_ms"] > 0 and row["mean_tpot_ms"] > 0, row
        assert row["total_output_tokens"] == 2 * 8  # --ignore-eos: every request its full output
    sparse = next(r for r in data["runs"] if r["server"] == "sparse")
    assert sparse["realized"]["prefill"]["skipped"] > 0  # the sparse server skipped tiles in this run
    assert data["machine"]["cpu_model"] and data["machine"]["vllm"]
    assert data["non_defaults"]["server_env_dense"]["MODELOPT_EXT_SPARSE_ATTN"] == "0"
    assert (out / "serving.png").read_bytes()[:4] == b"\x89PNG"
