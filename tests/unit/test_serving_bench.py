"""The serving benchmark without a server: its prompt sets, the command lines it builds, and the results it writes
from a vLLM result file (benchmarks/serving.py, cli/serving_bench.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from benchmark_modules import load_benchmark

from modelopt_ext.torch.sparsity.attention_sparsity.cli import serving_bench as sb

FAKE_RESULT = {
    "date": "20261207-230000", "backend": "vllm", "model_id": "bench-model", "num_prompts": 2, "completed": 2,
    "duration": 10.0, "total_input_tokens": 1000, "total_output_tokens": 16, "request_throughput": 0.2,
    "output_throughput": 1.6, "total_token_throughput": 101.6, "mean_ttft_ms": 4000.0, "median_ttft_ms": 4000.0,
    "p99_ttft_ms": 4100.0, "mean_tpot_ms": 50.0, "median_tpot_ms": 50.0, "p99_tpot_ms": 55.0, "mean_itl_ms": 50.0,
    "mean_e2el_ms": 4400.0, "max_concurrency": 1,
}  # fmt: skip


class WordTokenizer:
    """One token per whitespace-separated word: enough to check budgets without a model."""

    def encode(self, text: str) -> list[int]:
        return [hash(w) % 50000 for w in text.split()] if text else []

    def decode(self, ids, skip_special_tokens=True) -> str:
        return " ".join(f"w{i}" for i in ids)


@pytest.fixture
def serving():
    return load_benchmark("serving")


def test_fixed_length_prompts_fit_the_budget_and_share_no_prefix():
    text = sb.HeldOutText(WordTokenizer())
    prompts = sb.fixed_length_prompts(text, 300, 6)
    assert [p.source for p in prompts] == ["prose", "code"] * 3
    assert all(290 <= p.tokens <= 300 for p in prompts)
    assert len({p.text[:200] for p in prompts}) == 6  # consecutive windows: no shared prefix


def test_mixed_prompts_share_system_prompts_and_cycle_lengths():
    text = sb.HeldOutText(WordTokenizer())
    prompts = sb.mixed_prompts(text, [200, 400], 4, system_prompts=2, system_tokens=50)
    heads = [p.text.split("Document:")[0] for p in prompts]
    assert heads[0] == heads[2] != heads[1] == heads[3]
    assert [p.source for p in prompts] == ["system0+prose", "system1+code", "system0+prose", "system1+code"]
    assert all(abs(p.tokens - want) <= 2 for p, want in zip(prompts, [200, 400, 200, 400], strict=True))


def test_dataset_is_vllm_custom_jsonl_with_the_run_tag(tmp_path):
    prompts = [sb.Prompt("alpha beta", 2, "prose"), sb.Prompt("gamma", 1, "code")]
    path = sb.write_dataset(tmp_path / "d" / "set.jsonl", prompts, sb.run_tag("2048", 4))
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [set(line) for line in lines] == [{"prompt"}, {"prompt"}]
    assert lines[0]["prompt"].startswith("[serving benchmark: set 2048, concurrency 4]\n")
    assert lines[1]["prompt"].endswith("gamma")
    assert sb.run_tag("2048", 4) != sb.run_tag("2048", 1)  # no run hits another run's cached blocks
    assert sb.dataset_record(prompts) == {"prompts": 2, "tokens": [2, 1], "sources": ["prose", "code"],
                                          "min_tokens": 1, "max_tokens": 2}  # fmt: skip


def test_prompt_budget_leaves_room_for_the_output_and_the_tag():
    assert sb.prompt_budget(2048, 8192, 128) == 2048 - 32
    assert sb.prompt_budget(8192, 8192, 32) == 8192 - 32 - 32


def test_bench_command_is_vllm_bench_serve_with_the_run(tmp_path):
    run = sb.BenchRun(server="sparse", label="sparse0.7", base_url="http://127.0.0.1:9", model="m", tokenizer="/ck",
                      dataset=tmp_path / "d.jsonl", num_prompts=8, concurrency=4, output_len=32,
                      result_dir=tmp_path, result_file="r.json", extra_body={"vllm_xargs": {"sparse_attn_target": 0.7}})
    cmd = sb.bench_command(run, python="py")
    assert cmd[:3] == ["py", "-m", "modelopt_ext.torch.sparsity.attention_sparsity.cli.serving_bench"]

    def value(flag):
        return cmd[cmd.index(flag) + 1]

    assert (value("--max-concurrency"), value("--num-prompts"), value("--custom-output-len")) == ("4", "8", "32")
    assert value("--dataset-name") == "custom" and value("--endpoint") == "/v1/completions"
    assert value("--ready-check-timeout-sec") == "0"
    assert {"--ignore-eos", "--disable-shuffle", "--skip-chat-template", "--save-result"} <= set(cmd)
    assert json.loads(value("--extra-body")) == {"vllm_xargs": {"sparse_attn_target": 0.7}}
    assert "--extra-body" not in sb.bench_command(sb.BenchRun(**{**sb.as_dict(run), "extra_body": None}))


def test_servers_differ_only_in_the_dense_switch_and_the_command():
    dense = sb.server_command("dense", Path("/ck"), 8001, "m", ["--dtype", "bfloat16"], Path("/serve.py"), "py")
    sparse = sb.server_command("sparse", Path("/ck"), 8002, "m", ["--dtype", "bfloat16"], Path("/serve.py"), "py")
    assert dense[:5] == ["py", "-m", "vllm.entrypoints.openai.api_server", "--model", "/ck"]
    assert sparse[:3] == ["py", "/serve.py", "/ck"]
    assert [a for a in dense[5:] if a != "8001"] == [a for a in sparse[3:] if a != "8002"]
    assert dense[-2:] == ["--dtype", "bfloat16"]
    base = {"VLLM_SERVER_DEV_MODE": "1", "PATH": "/bin"}
    fixed = {"VLLM_CPU_KVCACHE_SPACE": "2"}
    d, s = sb.server_environment("dense", base, fixed), sb.server_environment("sparse", base, fixed)
    assert d.pop("MODELOPT_EXT_SPARSE_ATTN") == "0" and d == s == {"PATH": "/bin", "VLLM_CPU_KVCACHE_SPACE": "2"}


def test_kv_cache_size_covers_the_largest_run():
    smol = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}
    # 30 layers x K,V x 3 heads x 64 x 2 bytes = 23040 bytes a token: 16 x 8192 tokens 2.8 GiB, + 25 % -> 4
    assert sb.kv_cache_gib(smol, 2, 16 * 8192) == 4
    assert sb.kv_cache_gib(smol, 4, 16 * 8192) == 8
    assert sb.kv_cache_gib(smol, 2, 1000) == 1


def test_parse_args_quick_and_lengths(serving):
    args = serving.parse_args(["--checkpoint", "/ck", "--quick"])
    assert (args.lengths, args.concurrency, args.num_prompts) == ([512], [1, 2], 2)
    args = serving.parse_args(["--checkpoint", "/ck", "--lengths", "2k,4096", "--concurrency", "1,4",
                               "--targets", "calibrated,0.7"])  # fmt: skip
    assert (args.lengths, args.concurrency, args.num_prompts, args.output_len) == ([2048, 4096], [1, 4], 16, 128)
    assert serving.sparse_variants(args.targets, 0.5) == [(0.5, None),
                                                          (0.7, {"vllm_xargs": {"sparse_attn_target": 0.7}})]
    assert serving.sparse_variants(["0.5", "calibrated"], 0.5) == [(0.5, None)]


def _record(server, concurrency, target, ttft, tpot, throughput):
    result = {**FAKE_RESULT, "mean_ttft_ms": ttft, "mean_tpot_ms": tpot, "output_throughput": throughput}
    return {"set": "8192", "concurrency": concurrency, "server": server, "target": target, "result": result}


def test_results_json_table_and_png_from_vllm_result_files(serving, tmp_path):
    """Rows from vLLM's result fields as written, ratios dense / sparse, one PNG."""
    runs = [_record("dense", 1, None, 4000.0, 50.0, 1.6), _record("sparse", 1, 0.5, 2000.0, 40.0, 2.4),
            _record("dense", 4, None, 9000.0, 90.0, 3.0), _record("sparse", 4, 0.5, 6000.0, 60.0, 4.5)]  # fmt: skip
    data = {"machine": sb.machine_info(), "runs": runs}
    rows = serving.write_results(tmp_path, data)
    written = json.loads((tmp_path / "serving.json").read_text())
    assert written["runs"][0]["result"] == {**FAKE_RESULT, "mean_ttft_ms": 4000.0, "mean_tpot_ms": 50.0,
                                            "output_throughput": 1.6}  # every field of vLLM's file  # fmt: skip
    assert written["machine"]["cpus"] >= 1 and "isa_flags" in written["machine"]
    ratio = written["summary"]["ratios"][0]
    assert (ratio["ttft_speedup"], ratio["tpot_speedup"], ratio["throughput_ratio"]) == pytest.approx((2.0, 1.25, 1.5))
    table = sb.markdown_table(rows)
    assert "| 8192 | 1 | sparse @ 0.5 | 2000 / 4100 | 40.0 / 55.0 | 2.40 | 2.00 | 1.25 | 1.50 |" in table
    serving.plot(rows, tmp_path / "serving.png", "test")
    assert (tmp_path / "serving.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_realized_sparsity_is_the_difference_of_two_metrics_reads():
    from modelopt_ext.torch.sparsity.attention_sparsity.cli.local_server import tiles_between

    before = {"prefill": (100.0, 40.0), "decode": (10.0, 0.0)}
    after = {"prefill": (300.0, 140.0), "decode": (10.0, 0.0)}
    got = tiles_between(before, after)
    assert got["prefill"]["sparsity"] == 0.5 and got["decode"]["sparsity"] is None


def test_run_bench_raises_with_the_log_tail(tmp_path, monkeypatch):
    run = sb.BenchRun(server="dense", label="dense", base_url="http://127.0.0.1:9", model="m", tokenizer="/ck",
                      dataset=tmp_path / "d.jsonl", num_prompts=1, concurrency=1, output_len=1,
                      result_dir=tmp_path, result_file="r.json")  # fmt: skip
    monkeypatch.setattr(sb, "bench_command", lambda run: ["sh", "-c", "echo boom; exit 3"])
    with pytest.raises(RuntimeError, match="exit 3") as err:
        sb.run_bench(run, tmp_path / "log", {"PATH": "/usr/bin:/bin"}, timeout=30)
    assert "boom" in str(err.value)
    write = f"echo '{{\"completed\": 1}}' > {tmp_path}/r.json"
    monkeypatch.setattr(sb, "bench_command", lambda run: ["sh", "-c", write])
    assert sb.run_bench(run, tmp_path / "log", {"PATH": "/usr/bin:/bin"}, timeout=30) == {"completed": 1}


def test_a_failed_run_is_recorded_and_the_sweep_goes_on(serving, tmp_path, monkeypatch):
    run = sb.BenchRun(server="dense", label="dense", base_url="http://127.0.0.1:9", model="m", tokenizer="/ck",
                      dataset=tmp_path / "d.jsonl", num_prompts=1, concurrency=1, output_len=1,
                      result_dir=tmp_path, result_file="r.json")  # fmt: skip

    def fail(*args):
        raise RuntimeError("vllm bench serve failed (exit 1)")

    monkeypatch.setattr(sb, "run_bench", fail)
    args = serving.parse_args(["--checkpoint", "/ck", "--quick"])
    record = serving._one_run(run, args, tmp_path, {"set": "512", "concurrency": 1, "server": "dense", "target": None})
    assert record["error"] == "vllm bench serve failed (exit 1)" and record["result"] == {}
    row = sb.summary_row(record)
    assert row["mean_ttft_ms"] is None and "| 512 | 1 | dense | – / – |" in sb.markdown_table([row])
