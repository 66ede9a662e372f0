"""Tiny random Llama models and a byte tokenizer built in code (no hub) for the mtsa tests."""

from __future__ import annotations

import math

import torch

SINK_TOKEN = 0


def make_tiny_llama(seed: int = 0, *, layers: int = 2, peaky: float = 1.5, sink: float = 2.8, dtype=torch.float64):
    """A random LlamaForCausalLM (hidden 64, 4 query heads, 2 KV heads, head 16) with real-model attention shape.

    Default init (std 0.02) gives near-uniform scores where no tile is ever skippable, so: `peaky` rescales the q/k
    projections (score std about peaky**2), and `sink` plants an attention sink on token SINK_TOKEN (as trained LLMs
    have on their first token): one RoPE-stable head dim (the lowest frequency) where every query has bias `sink`
    and only the sink token's key is `sink * sqrt(hidden)`, i.e. a sink score of about 2 * sink**2. With the
    defaults, realized sparsity grows smoothly from ~0 at λ=1e-4 to ~0.5 at λ=0.2 on 512 tokens.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        attention_bias=True,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    hidden, d = cfg.hidden_size, cfg.hidden_size // cfg.num_attention_heads
    dim = d // 2 - 1  # the lowest RoPE frequency: ~0.3 rad over 1k positions
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        if sink:
            emb[:, 0] = 0.0
            emb[SINK_TOKEN] = 0.0
            emb[SINK_TOKEN, 0] = emb.norm(dim=1).mean()
        for layer in model.model.layers:
            attn = layer.self_attn
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
                if proj.bias is not None:
                    proj.bias.zero_()
            if peaky:
                for proj in (attn.q_proj, attn.k_proj):
                    proj.weight.normal_(0.0, peaky / math.sqrt(hidden))
            if sink:
                for h in range(cfg.num_key_value_heads):
                    attn.k_proj.weight[h * d + dim] = 0.0
                    attn.k_proj.weight[h * d + dim, 0] = sink
                    attn.k_proj.weight[h * d + dim + d // 2] = 0.0
                for h in range(cfg.num_attention_heads):
                    attn.q_proj.weight[h * d + dim] = 0.0
                    attn.q_proj.weight[h * d + dim + d // 2] = 0.0
                    attn.q_proj.bias[h * d + dim] = sink
    return model.to(dtype)


def random_ids(n: int, batch: int = 1, seed: int = 0) -> torch.Tensor:
    """Random token ids with the sink token first (like a BOS)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 256, (batch, n), generator=g)
    ids[:, 0] = SINK_TOKEN
    return ids


def make_byte_tokenizer():
    """A real fast tokenizer built in code: one token per byte (ids 1..255) and `<bos>` = SINK_TOKEN prepended.

    Its 256 ids match the tiny Llama's vocabulary, so the shared calibration data builder runs end to end.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):  # GPT-2's byte -> printable character map
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    vocab = {"<bos>": SINK_TOKEN, **{chars[b]: b for b in range(1, 256)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", SINK_TOKEN)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>")
