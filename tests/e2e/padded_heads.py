"""A tensor-parallel-2 twin of SmolLM2-135M: the same function, with attention heads padded by zero heads.

SmolLM2-135M has 9 query heads and 3 KV heads, so vLLM refuses `tensor_parallel_size=2` for it ("Total number of
attention heads (9) must be divisible by tensor parallel size (2)"). This twin appends one zero KV head and three
zero query heads (a fourth GQA group of 3): 12 query heads, 4 KV heads, both even. A zero query head scores every key
0, its zero V gives a zero output, and its o_proj columns are zero, so the logits are SmolLM2's (up to float
rounding); only the attention layers' tile counts include the padded heads (which never drop a tile: every score
equals the running max).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

PAD_GROUPS = 1  # one extra GQA group: +1 KV head, +group-size query heads


def build_padded_checkpoint(src: Path, dst: Path) -> Path:
    """Write the padded twin of the checkpoint at `src` into `dst` (created); tokenizer files are copied."""
    import torch
    from safetensors.torch import load_file, save_file

    config = json.loads((src / "config.json").read_text())
    heads, kv_heads, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    group = heads // kv_heads
    new_heads, new_kv = heads + PAD_GROUPS * group, kv_heads + PAD_GROUPS
    tensors = load_file(src / "model.safetensors")
    for name in list(tensors):
        w = tensors[name]
        if name.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")):
            rows = (new_heads if ".q_proj." in name else new_kv) * head_dim
            tensors[name] = torch.cat([w, w.new_zeros(rows - w.shape[0], w.shape[1])]).contiguous()
        elif name.endswith("self_attn.o_proj.weight"):
            tensors[name] = torch.cat([w, w.new_zeros(w.shape[0], new_heads * head_dim - w.shape[1])], 1).contiguous()
    dst.mkdir(parents=True)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config.update(num_attention_heads=new_heads, num_key_value_heads=new_kv)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for f in src.iterdir():
        if f.is_file() and not f.name.startswith(".") and f.name not in ("config.json", "model.safetensors"):
            shutil.copy2(f, dst / f.name)
    return dst
