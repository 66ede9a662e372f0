"""Tiny random-weight checkpoints of the architectures people serve, for the model table (tests/e2e/test_models.py).

Each keeps what decides how its attention layers are served (sliding windows and their pattern, logit soft-capping,
sinks, chunk-local layers, qk-norm, head size, GQA) and shrinks the rest: 4 query and 2 KV heads of 64, 256 hidden
units (the models' own ratio: vLLM's Qwen 2 derives the head size from it), 2-4 layers, 2-4 experts, and
SmolLM2's tokenizer (the vocabulary sized to it). Weights are drawn with a larger spread than the models'
initializers, and qk-norm weights set to 4, so attention is peaked as in trained models and skip-softmax has tiles
to skip (at the default spread every score is near zero and every tile is needed). Sliding windows and chunks are
shorter than the test prompts, so they are exercised.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
WINDOW = 128  # tokens; the prompts are longer
CHUNK = 128  # Llama 4's chunk-local attention
QK_NORM_SCALE = 4.0


@dataclass(frozen=True)
class TinyModel:
    name: str  # the model table of docs/models.md
    config_class: str  # transformers class
    model_class: str
    kwargs: dict
    layers: int


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
                          query_pre_attn_scalar=64, tie_word_embeddings=True), 4),
        TinyModel("Gemma 3", "Gemma3TextConfig", "Gemma3ForCausalLM",
                  _common(4, vocab, sliding_window=WINDOW, layer_types=sliding_global, query_pre_attn_scalar=64,
                          tie_word_embeddings=True), 4),
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
    out.mkdir(parents=True, exist_ok=True)
    net.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)
    return out
