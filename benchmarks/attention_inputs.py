#!/usr/bin/env python
"""Real attention inputs for the kernel benchmarks and the coherence report: Q, K, V as a model's attention sees them.

    python benchmarks/attention_inputs.py capture                     # SmolLM2, held-out prose and code, 8k tokens
    python benchmarks/attention_inputs.py capture --model DIR --length 4096 --layers 2,10 --sources code
    python benchmarks/attention_inputs.py show                        # what the default folder holds

**Capture.** The model (any local Hugging Face causal LM whose attention dispatches through transformers'
`AttentionInterface`) runs one forward pass in float32 on a held-out prompt (`calibration.natural_text.heldout_prompt`:
prose or source code that calibration never sees) with its attention routed through a recording function registered
in `AttentionInterface` (as the package's own plugin registers its kernel): for the chosen layers it keeps the
`query`, `key` and `value` arguments — after RoPE, K/V at KV-head resolution — and the module's `scaling`, then runs
transformers' own sdpa attention, so the forward is unchanged. Each (source, layer) becomes one file
`<model>_<source>_L<layer>_<tokens>.npz` in `--out` (default `.cache/attention_inputs/`, ignored by git): float16
`q` [N, Hq, D], `k` and `v` [N, Hkv, D] and a JSON `meta` (model, source, layer, heads, KV heads, head dim, tokens,
softmax scale, capture date). SmolLM2 at 8k: 15.7 MB per file. The default is 4 layers over depth (SmolLM2:
3, 11, 18, 26) for prose and code: 8 files, 126 MB; the benchmarks read one of them (`default_inputs_path`).

**Benchmark shapes** (`tile_to_shape`): query head h of a benchmark with G = Hq / Hkv heads per KV head reads KV head
kv = h // G; benchmark KV head kv is captured KV head kv mod Hkv_c, and its g-th query head the captured query head
(kv mod Hkv_c)·G_c + (g mod G_c) of that KV head's group. Each benchmark head is therefore a real head, with its own
real KV head; with more heads than the capture, heads repeat (a repeated query head in a GQA group decides exactly
as its original, so a group larger than the captured one drops tiles together as often as the captured group did,
not less, as G distinct real heads would). A head size larger than the captured one is zero-padded in q, k and v:
q·k is exact, and `softmax_scale` stays the captured one (returned with the tensors; benchmarks pass it to every
kernel), so every scaled score — and every skip decision — is that of the real head. Smaller head sizes are refused
(dropping dims changes the scores). Lengths up to the capture take its prefix, which is exactly the attention of the
prompt's prefix (causal model). Longer lengths repeat the capture with period N: position p holds captured position
p mod N for q, k and v. Rows then see earlier copies of the text, whose keys meet the query at the RoPE phase of a
different distance; the scores are real q·k products, but the long-range structure beyond N is a repeat, not a
longer document: capture a longer prompt (`--length`, on a model that takes it) for real attention at that length.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = REPO / ".cache/models/SmolLM2-135M-Instruct"
DEFAULT_DIR = REPO / ".cache/attention_inputs"
DEFAULT_SOURCES = ("prose", "code")
DEFAULT_LENGTH = 8192
DEFAULT_BENCH_SOURCE = "code"  # the file the benchmarks read by default: held-out code, the mid-depth layer
CAPTURE_IMPLEMENTATION = "modelopt_ext_capture"
CAPTURE_COMMAND = "python benchmarks/attention_inputs.py capture"

logger = logging.getLogger("attention_inputs")


@dataclass
class AttentionInputs:
    """One captured layer: q [N, Hq, D], k / v [N, Hkv, D] (float16 as stored) and the capture's metadata."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    meta: dict

    @property
    def softmax_scale(self) -> float:
        return float(self.meta["softmax_scale"])

    @property
    def length(self) -> int:
        return self.q.shape[0]


# ---------------------------------------------------------------------------------------------------- storage


def save_inputs(path: Path, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: dict) -> Path:
    """Write one capture: float16 arrays and the JSON metadata (refuses values float16 cannot hold)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays = {}
    for name, x in (("q", q), ("k", k), ("v", v)):
        big = float(x.abs().max())
        if not big < 60000.0:
            raise ValueError(f"{name} holds {big:g}, beyond float16; cannot store this capture compactly")
        arrays[name] = x.detach().to(torch.float16).cpu().numpy()
    with open(path, "wb") as fh:
        np.savez(fh, meta=np.array(json.dumps(meta, sort_keys=True)), **arrays)
    return path


def load_inputs(path: str | Path) -> AttentionInputs:
    """Read a capture written by `save_inputs` (float16 tensors, metadata dict)."""
    with np.load(Path(path), allow_pickle=False) as data:
        meta = json.loads(str(data["meta"]))
        q, k, v = (torch.from_numpy(np.array(data[n])) for n in ("q", "k", "v"))
    meta["path"] = str(path)
    return AttentionInputs(q, k, v, meta)


def capture_files(folder: str | Path = DEFAULT_DIR) -> list[Path]:
    return sorted(Path(folder).glob("*.npz"))


def default_inputs_path(folder: str | Path = DEFAULT_DIR) -> Path | None:
    """The capture the benchmarks use by default: the held-out code file of the middle captured layer (the longest
    capture when several lengths exist), or None when the folder holds none."""
    files = capture_files(folder)
    if not files:
        return None
    metas = []
    for f in files:
        with np.load(f, allow_pickle=False) as data:
            metas.append((f, json.loads(str(data["meta"]))))
    longest = max(m["tokens"] for _, m in metas)
    metas = [(f, m) for f, m in metas if m["tokens"] == longest]
    code = [(f, m) for f, m in metas if m["source"] == DEFAULT_BENCH_SOURCE] or metas
    layers = sorted({m["layer"] for _, m in code})
    mid = layers[(len(layers) - 1) // 2]
    return next(f for f, m in code if m["layer"] == mid)


def missing_message(folder: str | Path = DEFAULT_DIR, path: str | Path | None = None) -> str:
    where = f"{path}: no such capture file" if path else f"no captured attention inputs in {folder}"
    return (f"{where}: make them with `{CAPTURE_COMMAND}` (a few minutes on 2 cores), pass --inputs FILE, or run "
            "on --synthetic inputs")


# ---------------------------------------------------------------------------------------------- benchmark shapes


def _periodic(x: torch.Tensor, length: int) -> torch.Tensor:
    n = x.shape[0]
    if length <= n:
        return x[:length]
    return x[torch.arange(length) % n]


def tile_to_shape(inputs: AttentionInputs, num_heads: int, num_kv_heads: int, head_size: int, length: int,
                  dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """Benchmark-shaped (q [length, num_heads, head_size], k, v [length, num_kv_heads, head_size], softmax_scale)
    from a capture, each head a real captured head (see the module docstring for the method):

    - KV head kv ← captured KV head kv mod Hkv_c; its g-th query head ← captured query head
      (kv mod Hkv_c)·G_c + (g mod G_c) (G_c = Hq_c / Hkv_c): a query always meets the keys it was trained with;
    - head_size ≥ the captured D: q, k and v zero-padded, so q·k is exact; softmax_scale is the captured one
      (pass it to the kernels: the scaled scores, hence the skip decisions, are the real head's);
    - length ≤ the capture: its prefix (exact: the model is causal); longer: periodic repetition (position p ←
      p mod N), stated by a warning because the structure beyond N is a repeat.
    """
    q, k, v = inputs.q, inputs.k, inputs.v
    n, hq_c, d_c = q.shape
    hkv_c = k.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if head_size < d_c:
        raise ValueError(f"head_size {head_size} is smaller than the captured head ({d_c}): dropping dims would "
                         "change every score; capture from a model with that head size instead")
    if length > n:
        logger.warning("length %d > the capture's %d tokens: the capture is repeated (position p <- p mod %d)",
                       length, n, n)
    g, g_c = num_heads // num_kv_heads, hq_c // hkv_c
    kv_src = torch.arange(num_kv_heads) % hkv_c
    q_src = (kv_src[:, None] * g_c + torch.arange(g)[None, :] % g_c).reshape(-1)
    dtype = dtype or q.dtype

    def build(x: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
        x = _periodic(x, length)[:, heads].to(dtype)
        if head_size > d_c:
            x = torch.nn.functional.pad(x, (0, head_size - d_c))
        return x.contiguous()

    return build(q, q_src), build(k, kv_src), build(v, kv_src), inputs.softmax_scale


# ------------------------------------------------------------------------------------------------------ capture


def default_layers(num_layers: int, count: int = 4) -> list[int]:
    """`count` layers spread over depth: the middles of `count` equal slices (SmolLM2's 30: 3, 11, 18, 26)."""
    return sorted({int((i + 0.5) * num_layers / count) for i in range(count)})


class _Recorder:
    """The attention function registered for the capture: records the chosen layers' q/k/v, then runs sdpa."""

    def __init__(self, layers: set[int]):
        self.layers = layers
        self.records: dict[int, dict] = {}

    def __call__(self, module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                 **kwargs):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        layer = getattr(module, "layer_idx", None)
        if layer in self.layers:
            scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
            extra = {k_: kwargs[k_] for k_ in ("softcap", "sliding_window") if kwargs.get(k_)}
            self.records[layer] = dict(q=query[0].transpose(0, 1).detach().clone(),  # [N, Hq, D]
                                       k=key[0].transpose(0, 1).detach().clone(),
                                       v=value[0].transpose(0, 1).detach().clone(),
                                       scale=scale, extra=extra)
        out = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                     is_causal=is_causal, **kwargs)
        if layer in self.layers:
            self.records[layer]["out"] = out[0][0].detach().clone()  # [N, Hq, D]
        return out


def capture_model(model, input_ids: torch.Tensor, layers: list[int], keep_outputs: bool = False) -> dict[int, dict]:
    """Run `model` on `input_ids` [1, N] with its attention recorded at `layers`: {layer: {q, k, v, scale, extra,
    (out)}} with q [N, Hq, D], k / v [N, Hkv, D] exactly as the attention function received them (after RoPE) and
    out [N, Hq, D] what transformers' sdpa returned. The model's attention implementation is restored after."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    recorder = _Recorder(set(layers))
    AttentionInterface.register(CAPTURE_IMPLEMENTATION, recorder)
    AttentionMaskInterface.register(CAPTURE_IMPLEMENTATION, sdpa_mask)
    previous = model.config._attn_implementation
    model.set_attn_implementation(CAPTURE_IMPLEMENTATION)
    try:
        with torch.no_grad():
            model(input_ids=input_ids, use_cache=False)
    finally:
        model.set_attn_implementation(previous or "sdpa")
    missing = set(layers) - set(recorder.records)
    if missing:
        raise RuntimeError(f"layers {sorted(missing)} were not recorded (the model has "
                           f"{model.config.num_hidden_layers} layers)")
    if not keep_outputs:
        for r in recorder.records.values():
            r.pop("out", None)
    return recorder.records


def capture(model_dir: Path, length: int, layers: list[int] | None, sources: list[str], out: Path,
            seed: int = 0) -> list[Path]:
    """Capture `layers` of the model at `model_dir` on held-out `sources` prompts of up to `length` tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from modelopt_ext.torch.sparsity.attention_sparsity.calibration import natural_text

    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model.eval()
    cfg = model.config
    layers = layers or default_layers(cfg.num_hidden_layers)
    logger.info("model %s: %d layers, %d heads, %d KV heads; capturing layers %s (%.1f s)", model_dir,
                cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, layers,
                time.perf_counter() - t0)
    written = []
    for source in sources:
        text, _ = natural_text.heldout_prompt(tokenizer, source, length, seed=seed)
        ids = tokenizer(text, return_tensors="pt").input_ids[:, :length]
        n = ids.shape[1]
        logger.info("%s: held-out prompt of %d tokens (seed %d); forward pass ...", source, n, seed)
        t1 = time.perf_counter()
        records = capture_model(model, ids, layers)
        logger.info("%s: forward done in %.1f s", source, time.perf_counter() - t1)
        for layer in layers:
            r = records[layer]
            hq, d = r["q"].shape[1:]
            hkv = r["k"].shape[1]
            meta = dict(model=str(getattr(cfg, "_name_or_path", "") or model_dir), model_dir=Path(model_dir).name,
                        model_type=cfg.model_type, source=source, split="heldout", seed=seed, layer=layer,
                        num_layers=cfg.num_hidden_layers, heads=hq, kv_heads=hkv, head_dim=d, tokens=n,
                        softmax_scale=r["scale"], dtype="float16", captured_dtype="float32",
                        captured=datetime.date.today().isoformat(), **r["extra"])
            path = out / f"{Path(model_dir).name}_{source}_L{layer}_{n}.npz"
            save_inputs(path, r["q"], r["k"], r["v"], meta)
            written.append(path)
            logger.info("  %s (%.1f MB)", path, path.stat().st_size / 1e6)
        del records
    logger.info("captured %d files in %.1f s", len(written), time.perf_counter() - t0)
    return written


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("capture", help="capture Q/K/V of a few layers on held-out prose and code")
    c.add_argument("--model", type=Path, default=DEFAULT_MODEL,
                   help="local Hugging Face checkpoint (default: %(default)s)")
    c.add_argument("--length", type=int, default=DEFAULT_LENGTH, help="prompt tokens (default: %(default)s)")
    c.add_argument("--layers", type=_ints, default=None, help="comma list (default: 4 spread over depth)")
    c.add_argument("--sources", default=",".join(DEFAULT_SOURCES), help="held-out text: prose, code or both")
    c.add_argument("--seed", type=int, default=0, help="held-out document order")
    c.add_argument("--out", type=Path, default=DEFAULT_DIR, help="folder (default: %(default)s)")
    s = sub.add_parser("show", help="list the captures of a folder")
    s.add_argument("--out", type=Path, default=DEFAULT_DIR)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if args.cmd == "capture":
        torch.set_grad_enabled(False)
        capture(args.model, args.length, args.layers, [x for x in args.sources.split(",") if x], args.out, args.seed)
        return 0
    files = capture_files(args.out)
    if not files:
        print(missing_message(args.out))
        return 1
    default = default_inputs_path(args.out)
    for f in files:
        m = load_inputs(f).meta
        print(f"{f.name}: {m['source']} layer {m['layer']}, {m['tokens']} tokens, {m['heads']}/{m['kv_heads']} heads, "
              f"D={m['head_dim']}, scale {m['softmax_scale']:.4g}, {f.stat().st_size / 1e6:.1f} MB"
              + ("  (benchmarks' default)" if f == default else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
