"""One model of the model table (tests/e2e/test_models.py), in its own process: calibrate and serve it through a
vLLM engine (vLLM's default multi-process engine, the plugin's worker RPCs), and measure it against transformers.

    python model_driver.py CKPT OUT.json

1. The reference: transformers' eager attention, float32, log-probabilities of every prompt token of a probe
   prompt; and the same model with every layer global (windows and chunks removed), to show the comparison can tell.
2. One engine: which layers were prepared sparse and which kept dense (and why); calibration mode (dense output,
   tile counts for every threshold trial) on three prompts of 1024 tokens with 8 decode steps; the probe's
   prompt log-probabilities in that mode; the length law fitted per phase from the counts; then serving that
   calibration at target 0.5 (`sparse_attn_serve`): the probe's log-probabilities, a 16-token greedy decode and
   the realized sparsity per phase.
Prompts of 1k tokens: contract version 4 drops only tiles before a row's 128 most recent keys, so shorter prompts
give the fit few informative points; one length, so the fit is ModelOpt's law (γ = 1: a length exponent fitted over
these random models' few lengths came out ill-conditioned, up to b <= 0 or every length dense). The tiny models'
tokenizer starts each prompt with their sink token (tiny_models.SINK_TOKEN), as vLLM and transformers tokenize it.
Writes everything as JSON; the test asserts on it.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from tiny_models import SINK_TOKEN

TARGET = 0.5
DECODE_TOKENS = 8


def prompt_logprobs_hf(ckpt: Path, ids, all_global: bool = False) -> list[float]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(ckpt)
    text = config.get_text_config()
    if all_global:  # windows and chunks longer than any prompt
        for name in ("sliding_window", "attention_chunk_size"):
            if getattr(text, name, None) is not None:
                setattr(text, name, 1 << 20)
    model = AutoModelForCausalLM.from_pretrained(ckpt, config=config, dtype=torch.float32,
                                                 attn_implementation="eager").eval()  # fmt: skip
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    lp = torch.log_softmax(logits, dim=-1)[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    return lp.tolist()


def prompt_logprobs_vllm(llm, ids) -> list[float]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
    return [entry[tok].logprob for entry, tok in zip(out.prompt_logprobs[1:], ids[1:], strict=True)]


def main() -> int:
    ckpt, out_path = Path(sys.argv[1]), Path(sys.argv[2])
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from modelopt_ext.torch.sparsity.attention_sparsity.calibration.data import build_calibration_prompts
    from modelopt_ext.torch.sparsity.attention_sparsity.calibration.fit import (
        default_threshold_trials,
        fit_phases,
        points_from_merged_record,
    )
    from modelopt_ext.torch.sparsity.attention_sparsity.checkpoint.calibration_records import (
        merge_calibration_records,
    )
    from modelopt_ext.torch.sparsity.attention_sparsity.checkpoint.config_io import build_sparse_attention_config
    from modelopt_ext.torch.sparsity.attention_sparsity.plugins.vllm.worker import worker_extension_cls

    start = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    samples = build_calibration_prompts(tokenizer, num_samples=3, max_seqlen=1024, min_seqlen=1024)
    probe = tokenizer(max(samples, key=lambda s: s.num_tokens).prompt).input_ids
    assert probe[0] == SINK_TOKEN, "the tiny model's tokenizer puts its sink token first"
    result = {"probe_tokens": len(probe), "hf": prompt_logprobs_hf(ckpt, probe),
              "hf_all_global": prompt_logprobs_hf(ckpt, probe, all_global=True)}  # fmt: skip

    llm = LLM(model=str(ckpt), dtype="float32", max_model_len=2048, enforce_eager=True, seed=0,
              kv_cache_memory_bytes=64 * 2**20, enable_prefix_caching=False,
              worker_extension_cls=worker_extension_cls())  # fmt: skip
    try:
        result["prepared"] = llm.collective_rpc("sparse_attn_status")[0]
        calibration = llm.collective_rpc("sparse_attn_enable_calibration", args=(default_threshold_trials(), None))
        result["calibrated_layers"] = calibration[0]["layers"]
        params = SamplingParams(max_tokens=DECODE_TOKENS, temperature=0.0, ignore_eos=True)
        for sample in samples:
            llm.generate([sample.prompt], params, use_tqdm=False)
        ranks = llm.collective_rpc("sparse_attn_collect_counts")
        result["calibration_mode"] = prompt_logprobs_vllm(llm, probe)
        if result["calibrated_layers"]:
            fits = fit_phases(points_from_merged_record(merge_calibration_records(ranks)))
            result["fits"] = {p: {"a": f.a, "b": f.b, "r2": f.r2} for p, f in fits.items()}
            block = build_sparse_attention_config(fits, target_sparsity=TARGET)
            llm.collective_rpc("sparse_attn_serve", args=(block,))
        llm.collective_rpc("sparse_attn_reset_stats")
        result["served"] = prompt_logprobs_vllm(llm, probe)
        greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        decode = llm.generate([{"prompt_token_ids": probe}], greedy, use_tqdm=False)
        result["decoded_tokens"] = len(decode[0].outputs[0].token_ids)
        result["status"] = llm.collective_rpc("sparse_attn_status")[0]
    finally:
        llm.llm_engine.engine_core.shutdown()
    result["seconds"] = time.monotonic() - start
    out_path.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
