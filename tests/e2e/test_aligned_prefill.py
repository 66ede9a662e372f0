"""Aligned prefill chunks on vLLM's CPU engine (plugins/vllm/aligned_scheduler.py): a sparse checkpoint served the
user's way, with no scheduler named anywhere, gets the plugin's scheduler in vLLM's engine-core process, and every
prefill chunk that process emits starts at a multiple of 64 (or at the prompt's end), including after prefix-cache
hits, under a chunk budget that is not a multiple of 64.

Two engines, each vLLM's default multi-process engine: `vllm.LLM` (offline), and plain vLLM's OpenAI server
(`python -m vllm.entrypoints.openai.api_server`, the plugin's entry point only). Each is forced into small chunks
(`max_num_batched_tokens` 200), prefix caching on 32-token pages, several long prompts at once sharing a 300-token
prefix (hits of 288 tokens before alignment). The engine core writes one JSON line per step
(`MODELOPT_EXT_SCHEDULER_TRACE`); the tests read what it scheduled. Nothing here depends on the kernels' decisions.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading

import pytest
from e2e_lib import env, fixed_fit_checkpoint, free_port, http_json, server_process

pytestmark = pytest.mark.e2e

ALIGN = 64
BUDGET = 200  # not a multiple of 64
PAGE = 32  # the CPU attention's smallest page: hits come in multiples of 32
SHARED = " ".join(f"Rule {i}: keep crate {i % 11} on shelf {i % 5}." for i in range(40))  # ~ 300+ tokens
SUFFIXES = [" ".join(f"Note {k}.{i}: parcel {i % 9} goes to bay {(i * k) % 7}." for i in range(12 + 9 * k))
            for k in range(4)]  # fmt: skip

DRIVER = textwrap.dedent(
    """
    import json, os, sys
    from vllm import LLM, SamplingParams

    def main():
        ckpt, shared, suffixes = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
        llm = LLM(model=ckpt, dtype="float32", max_model_len=2048, enforce_eager=True, seed=0, block_size=%(page)d,
                  max_num_batched_tokens=%(budget)d, enable_chunked_prefill=True, enable_prefix_caching=True,
                  kv_cache_memory_bytes=256 * 2**20)
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        first = llm.generate([shared + " " + suffixes[0]], params, use_tqdm=False)  # fills the prefix cache
        rest = llm.generate([shared + " " + s for s in suffixes[1:]], params, use_tqdm=False)  # together
        outs = first + rest
        name = llm.llm_engine.vllm_config.scheduler_config.scheduler_cls
        print("RESULT " + json.dumps({
            "pid": os.getpid(), "scheduler_cls": name if isinstance(name, str) else repr(name),
            "tokens": [len(o.outputs[0].token_ids) for o in outs],
            "prompt_lens": [len(o.prompt_token_ids) for o in outs],
            "finish": [o.outputs[0].finish_reason for o in outs]}), flush=True)

    if __name__ == "__main__":
        main()
    """
) % {"page": PAGE, "budget": BUDGET}


@pytest.fixture(scope="module")
def sparse_ckpt(smollm2_checkpoint, tmp_path_factory):
    return fixed_fit_checkpoint(smollm2_checkpoint, tmp_path_factory.mktemp("aligned") / "ckpt")


def _steps(trace) -> list[dict]:
    assert trace.is_file(), "the engine core wrote no scheduler trace: the aligned scheduler did not run"
    return [json.loads(line) for line in trace.read_text().splitlines()]


def _check_trace(steps: list[dict], engine_pids: set[int]) -> None:
    assert steps and {s["pid"] for s in steps} <= engine_pids, "trace from an unexpected process"
    assert all(s["aligned"] and s["budget"] == BUDGET for s in steps)
    chunks = [tuple(c) for s in steps for c in s["prefill_chunks"]]
    assert chunks
    off = [c for c in chunks if c[1] % ALIGN or (c[1] + c[2] < c[3] and (c[1] + c[2]) % ALIGN)]
    assert not off, f"prefill chunks off the 64 grid (request, start, length, prompt length): {off[:5]}"
    first_chunk = {}
    for req_id, start, _, _ in chunks:
        first_chunk.setdefault(req_id, start)
    hits = [start for start in first_chunk.values() if start > 0]
    assert hits and all(h % ALIGN == 0 for h in hits), f"no aligned prefix-cache hit: first chunks {first_chunk}"
    assert sum(s["trimmed"] for s in steps) > 0, "no chunk was cut back: the budget never bound"
    assert any(c[2] < BUDGET and c[1] + c[2] < c[3] for c in chunks)


def test_offline_engine_schedules_aligned_prefill_chunks(sparse_ckpt, tmp_path):
    trace = tmp_path / "trace.jsonl"
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    res = subprocess.run([sys.executable, str(driver), str(sparse_ckpt), SHARED, json.dumps(SUFFIXES)],
                         env=env(MODELOPT_EXT_SCHEDULER_TRACE=str(trace)), capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    lines = [line for line in res.stdout.splitlines() if line.startswith("RESULT ")]
    assert res.returncode == 0 and lines, res.stderr[-4000:]
    result = json.loads(lines[-1][len("RESULT ") :])
    assert result["scheduler_cls"].endswith("aligned_scheduler.AlignedScheduler"), result["scheduler_cls"]
    assert result["tokens"] == [4] * len(SUFFIXES) and set(result["finish"]) == {"length"}, result
    assert min(result["prompt_lens"]) > 2 * BUDGET
    steps = _steps(trace)
    engine_pids = {s["pid"] for s in steps}
    assert result["pid"] not in engine_pids, "the scheduler ran in the driver, not in vLLM's engine-core process"
    _check_trace(steps, engine_pids)
    assert "aligned prefill chunks: scheduler_cls=" in res.stderr + res.stdout


def test_plain_openai_server_schedules_aligned_prefill_chunks(sparse_ckpt, tmp_path):
    """`vllm serve` of a sparse checkpoint: nothing but the plugin's entry point sets the scheduler."""
    trace, log_path = tmp_path / "trace.jsonl", tmp_path / "server.log"
    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(sparse_ckpt), "--host",
           "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "2048", "--enforce-eager",
           "--served-model-name", "smol", "--block-size", str(PAGE), "--max-num-batched-tokens", str(BUDGET),
           "--enable-chunked-prefill", "--enable-prefix-caching", "--kv-cache-memory-bytes", str(256 * 2**20)]
    with server_process(cmd, port, log_path, extra_env={"MODELOPT_EXT_SCHEDULER_TRACE": str(trace)}) as server:

        def complete(prompt: str) -> dict:
            return http_json(server.base + "/v1/completions", {"model": "smol", "prompt": prompt, "max_tokens": 4,
                                                               "temperature": 0.0, "ignore_eos": True})  # fmt: skip

        first = complete(SHARED + " " + SUFFIXES[0])
        replies: dict[int, dict] = {}
        threads = [threading.Thread(target=lambda k=k: replies.__setitem__(k, complete(SHARED + " " + SUFFIXES[k])))
                   for k in range(1, len(SUFFIXES))]  # fmt: skip
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        answers = [first] + [replies.get(k) for k in range(1, len(SUFFIXES))]
        assert all(a and a["usage"]["completion_tokens"] == 4 for a in answers), answers
        assert min(a["usage"]["prompt_tokens"] for a in answers) > 2 * BUDGET
    steps = _steps(trace)
    _check_trace(steps, {p.pid for p in server.procs})  # one of the server's child processes: vLLM's engine core
    assert server.popen.pid not in {s["pid"] for s in steps}, "the scheduler ran in the API server, not the engine core"
    assert "aligned prefill chunks: scheduler_cls=" in log_path.read_text()
