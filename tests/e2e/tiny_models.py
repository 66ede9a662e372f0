"""Tiny random-weight checkpoints of the architectures people serve, for the model table (tests/e2e/test_models.py).

Each keeps what decides how its attention layers are served (sliding windows and their pattern, logit soft-capping,
sinks, chunk-local layers, qk-norm, head size, GQA) and shrinks the rest: 4 query and 2 KV heads of 64, 256 hidden
units (the models' own ratio: vLLM's Qwen 2 derives the head size from it), 2-4 layers, 2-4 experts, and
SmolLM2's tokenizer (the vocabulary sized to it). Weights are drawn with a larger spread than the models'
initializers, and qk-norm weights set to 4, so attention is peaked as in trained models and skip-softmax has tiles
to skip (at the default spread every score is near zero and every tile is needed). Sliding windows and chunks are
shorter than the test prompts, so they are exercised.

Each model also gets an attention sink at its BOS token (`SINK_TOKEN`, which its tokenizer puts first in every
prompt), as trained models have at their first token: every token's embedding carries a shared component that every
query head reads into its lowest-frequency rotary dimension, and the sink token's embedding a component that every key
head reads into the same dimension. Contract version 4 drops a tile only when a whole unit agrees (a 64-row prompt
block of a head, a decode row's GQA group): on random peaked attention each row peaks somewhere else and no prompt
block ever agrees (measured: prefill sparsity 0 at every λ on 1k-token prompts), while under a sink shared by every
row the units drop what it outweighs, λ by λ. The strength (`TinyModel.sink`: the shared component in the hidden units
the layers see, after the model's own embedding scale, and the weight of the q / k rows) was chosen per model so that,
on a 1k-token prompt, prefill and decode sparsity of the sparse layers both grow over the calibration trials
(informative points for both fits) and Gemma's windows still change its output well beyond the test's tolerance.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
WINDOW = 128  # tokens; the prompts are longer
CHUNK = 128  # Llama 4's chunk-local attention
QK_NORM_SCALE = 4.0
SINK_TOKEN = 1  # SmolLM2's BOS, <|im_start|>: the driver puts it first in every prompt


@dataclass(frozen=True)
class TinyModel:
    name: str  # the model table of docs/models.md
    config_class: str  # transformers class
    model_class: str
    kwargs: dict
    layers: int
    sink: tuple[float, float] = (30.0, 1.0)  # (shared embedding component, q / k row weight): see the docstring


def _common(layers: int, vocab: int, **extra) -> dict:
    base = dict(vocab_size=vocab, hidden_size=256, intermediate_size=256, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                tie_word_embeddings=False)  # fmt: skip
    return {**base, **extra}


def models(vocab: int) -> list[TinyModel]:
    sliding_global = ["sliding_attention", "full_attention"] * 2
    return [
        TinyModel("Llama 3", "LlamaConfig", "LlamaForCausalLM", _common(2, vocab), 2),
        TinyModel("Qwen 2", "Qwen2Config", "Qwen2ForCausalLM", _common(2, vocab), 2),
        TinyModel("Qwen 3", "Qwen3Config", "Qwen3ForCausalLM", _common(2, vocab), 2),
        TinyModel("Mistral", "MistralConfig", "MistralForCausalLM", _common(2, vocab, sliding_window=None), 2),
        TinyModel("Phi-3", "Phi3Config", "Phi3ForCausalLM",
                  {k: v for k, v in _common(2, vocab).items() if k != "head_dim"}, 2),
        TinyModel("Gemma 2", "Gemma2Config", "Gemma2ForCausalLM",
                  _common(4, vocab, sliding_window=WINDOW, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                          query_pre_attn_scalar=64, tie_word_embeddings=True), 4, sink=(48.0, 2.0)),
        TinyModel("Gemma 3", "Gemma3TextConfig", "Gemma3ForCausalLM",
                  _common(4, vocab, sliding_window=WINDOW, layer_types=sliding_global, query_pre_attn_scalar=64,
                          tie_word_embeddings=True), 4, sink=(64.0, 2.0)),
        TinyModel("gpt-oss", "GptOssConfig", "GptOssForCausalLM",
                  _common(4, vocab, sliding_window=WINDOW, layer_types=sliding_global, num_local_experts=4,
                          num_experts_per_tok=2), 4),
        TinyModel("Llama 4", "Llama4TextConfig", "Llama4ForCausalLM",
                  _common(4, vocab, attention_chunk_size=CHUNK, no_rope_layer_interval=2, num_local_experts=2,
                          num_experts_per_tok=1, interleave_moe_layer_step=2, intermediate_size_mlp=256,
                          use_qk_norm=False), 4),
    ]


def build(model: TinyModel, tokenizer_dir: Path, out: Path, seed: int = 0, spread: float = 0.25) -> Path:
    """Write `model` as a float32 HF checkpoint into `out` (config, safetensors, SmolLM2's tokenizer)."""
    import torch
    import transformers

    config = getattr(transformers, model.config_class)(**model.kwargs, initializer_range=spread)
    config.architectures = [model.model_class]
    torch.manual_seed(seed)
    net = getattr(transformers, model.model_class)(config).to(torch.float32).eval()
    with torch.no_grad():  # trained Qwen 3 / Gemma 3 models scale the normed q and k up; at 1 no tile is skippable
        for name, param in net.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.fill_(QK_NORM_SCALE - 1.0 if model.model_class.startswith("Gemma") else QK_NORM_SCALE)
        _add_attention_sink(net, *model.sink)
    out.mkdir(parents=True, exist_ok=True)
    net.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)
    _tokenizer_adds_the_sink_token(out / "tokenizer.json")
    return out


def _tokenizer_adds_the_sink_token(path: Path) -> None:
    """SmolLM2's tokenizer adds no special token; the tiny models' puts `SINK_TOKEN` (its BOS) before every text, as
    Llama-style tokenizers put their BOS, so vLLM and transformers both start every prompt at the sink."""
    import json

    tokenizer = json.loads(path.read_text())
    vocab = {t["id"]: t["content"] for t in tokenizer["added_tokens"]}
    bos = {"SpecialToken": {"id": vocab[SINK_TOKEN], "type_id": 0}}
    tokenizer["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {vocab[SINK_TOKEN]: {"id": vocab[SINK_TOKEN], "ids": [SINK_TOKEN],
                                               "tokens": [vocab[SINK_TOKEN]]}},
    }
    path.write_text(json.dumps(tokenizer))


def _add_attention_sink(net, shared: float, weight: float) -> None:
    """An attention sink at `SINK_TOKEN` (see the module docstring), in place.

    Hidden unit 0 of every token's embedding is `shared` (hidden unit 1 of the sink token's, all else zero there);
    in every attention layer, each query head's rotary dimension head_dim/2 - 1 (the lowest frequency of the
    half-split rotary layout, so the sink stays in phase over the prompt; Llama 4's global layers have no rotary
    embedding) reads only hidden unit 0, each key head's only hidden unit 1, with `weight` (their biases zero).
    Gemma scales its embeddings by sqrt(hidden): `shared` is divided by it. A tied LM head sees the shared unit as
    the same logit offset for every token (no change to any log-probability).
    """
    text = net.config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    hq, hkv, r = text.num_attention_heads, text.num_key_value_heads, head_dim // 2 - 1
    if text.model_type.startswith("gemma"):
        shared = shared / text.hidden_size**0.5
    emb = net.get_input_embeddings().weight
    emb[:, 0] = shared
    emb[SINK_TOKEN].zero_()
    emb[SINK_TOKEN, 1] = shared

    def read(proj, rows, unit):
        for row in rows:
            proj.weight[row].zero_()
            proj.weight[row, unit] = weight
            if getattr(proj, "bias", None) is not None:
                proj.bias[row] = 0.0

    q_rows = [h * head_dim + r for h in range(hq)]
    k_rows = [g * head_dim + r for g in range(hkv)]
    for module in net.modules():
        children = dict(module.named_children())
        if "q_proj" in children and "k_proj" in children:
            read(children["q_proj"], q_rows, 0)
            read(children["k_proj"], k_rows, 1)
        elif "qkv_proj" in children:  # Phi-3: [q | k | v] rows
            read(children["qkv_proj"], q_rows, 0)
            read(children["qkv_proj"], [hq * head_dim + row for row in k_rows], 1)
