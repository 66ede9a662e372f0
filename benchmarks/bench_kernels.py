#!/usr/bin/env python
"""Kernel benchmark: paged skip-softmax attention vs dense SDPA and ModelOpt 0.47's Triton kernel.

Never a timed test. Examples:

    python benchmarks/bench_kernels.py --device cpu --quick --out artifacts/bench_cpu
    python benchmarks/bench_kernels.py --device cuda --out gpu_logs/bench --modelopt-wheels .whl

What it does, per shape (prefill: B=1, q_len == kv_len; decode: q_len == 1, equal kv_len per sequence):

1. Builds structured inputs so attention is peaky and skipping is reachable: an attention sink at key 0,
   heavy-tailed per-key salience shared by all queries of a KV head, and a RoPE-like locality term
   (recency). K/V live in a vLLM-style paged cache ``[num_blocks, 2, page, Hkv, D]`` with a shuffled
   block table; SDPA gets the same data as contiguous ``[B, H, L, D]`` tensors.
2. Finds λ for each target sparsity on that data with calibration sweeps (``threshold_trials``, one dense
   pass for many λ; bisection with ``return_skip_counts`` if calibration is unavailable), then measures the
   realized sparsity of a serving call at the chosen λ.
3. Checks outputs before timing: our dense (λ=None) and ModelOpt's dense output against SDPA dense.
4. Times (CUDA events after a GPU sleep so launch latency is hidden; median of many runs; inputs rotated
   over several copies so the working set exceeds L2): SDPA FLASH_ATTENTION / CUDNN_ATTENTION dense, ours
   dense, ours with skipping on but nothing skipped (tiny λ), ours at each λ, and ModelOpt at the same λ.
   Ours is timed through the launch path the vLLM plugin uses (`ours_launch`: arguments normalised once,
   persistent buffers); until 2026-12-04 it was timed through `paged_skip_softmax_attention`, whose per-call
   host work showed in small decode calls on the H200 (B=1 at 128k: 0.15-0.43 ms against 0.13 ms).
5. Prints a table (speedups beside the ideal bound 2/(2-s)) and writes results.json / results.csv /
   summary.csv / table.txt into --out, after every shape, so partial results survive a timeout.

ModelOpt baseline: ``modelopt.torch.kernels.common.attention.triton_fa.attention`` with its paged-cache
arguments (``k_cache``, ``v_cache``, ``block_table``, ``page_size``), one scalar λ per launch (the threshold is
a compile-time constant there, so each λ compiles a new variant; the bench reports the variant counts).
It is imported from the environment, from ``--modelopt-path`` or from a wheel in ``--modelopt-wheels``
(unzipped into a temporary folder; nothing is installed). If the full package cannot be imported (missing
dependencies such as pydantic), only the kernel modules are loaded (they need just torch and triton).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import csv
import importlib
import importlib.util
import json
import math
import platform
import statistics
import sys
import tempfile
import time
import traceback
import types
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

L2_BYTES = 50 * 2**20  # H200 L2 (50 MB); inputs are rotated so the working set is several times larger
TINY_LAMBDA = 1e-20  # skipping on, nothing skipped (ln λ = -46)
# Structure of the synthetic scores (score units, i.e. after softmax_scale): noise ~ N(0, 1) plus
SINK_SCORE = 16.0  # an attention sink at key 0,
SALIENCE_SCALE = 1.0  # per-key salience ~ SALIENCE_SCALE * Exp(1), shared by all queries of a KV head,
LOCALITY_AMP = 4.0  # and a RoPE-like recency term, LOCALITY_AMP at distance 0, decaying with log distance.
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# A dense output matches SDPA dense when |out - ref| <= atol + rtol * |ref| everywhere (outputs are O(1)).
TOLERANCE = {torch.bfloat16: (2e-2, 2e-2), torch.float16: (5e-3, 5e-3), torch.float32: (2e-4, 1e-4)}
# FP8 KV caches (--kv-cache-dtype, vLLM's names): bytes quantized from the model-dtype cache with saturation (as vLLM's
# CUDA cache writer stores them), read with k_scale = v_scale = FP8_SCALE (vLLM's default without checkpoint scales).
FP8_CACHES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
FP8_TAGS = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}
FP8_SCALE = 1.0


# ----------------------------------------------------------------------------------------------------
# Shapes
# ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    phase: str  # "prefill" or "decode"
    batch: int
    kv_len: int
    hq: int
    hkv: int
    head_dim: int
    page_size: int

    @property
    def q_len(self) -> int:
        return self.kv_len if self.phase == "prefill" else 1

    @property
    def label(self) -> str:
        k = f"{self.kv_len // 1024}k" if self.kv_len % 1024 == 0 else str(self.kv_len)
        return f"{self.phase} B={self.batch} L={k} H={self.hq}/{self.hkv} D={self.head_dim} pg={self.page_size}"


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _pairs(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        if item.strip():
            b, l_ = item.split(":")
            out.append((int(b), int(l_)))
    return out


def default_shapes(device: str, quick: bool) -> dict:
    """Prefill lengths and decode (batch, length) pairs, most informative first (the time budget cuts the tail)."""
    if device == "cuda":
        if quick:
            return {"prefill": [16384], "decode": [(16, 32768)], "heads": (32, 8, 128), "pages": [16]}
        return {
            "prefill": [16384, 65536, 131072],
            "decode": [(64, 16384), (1, 131072), (16, 65536), (32, 131072)],
            "heads": (32, 8, 128),
            "pages": [16, 64],
        }
    if quick:
        return {"prefill": [1024], "decode": [(2, 4096)], "heads": (4, 2, 64), "pages": [16]}
    return {"prefill": [1024, 2048], "decode": [(1, 8192), (4, 4096)], "heads": (8, 2, 64), "pages": [16, 64]}


def first_page_size(args) -> int:
    """The page size every shape uses (--page-sizes' first, else the default's)."""
    return (_ints(args.page_sizes) if args.page_sizes else default_shapes(args.device, args.quick)["pages"])[0]


def build_shapes(args) -> list[Shape]:
    d = default_shapes(args.device, args.quick)
    hq, hkv, hd = d["heads"]
    hq = args.heads or hq
    hkv = args.kv_heads or hkv
    hd = args.head_dim or hd
    pages = _ints(args.page_sizes) if args.page_sizes else d["pages"]
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    prefill = _ints(args.prefill_lens) if args.prefill_lens else d["prefill"]
    decode = _pairs(args.decode_shapes) if args.decode_shapes else d["decode"]
    shapes: list[Shape] = []
    # Interleave prefill and decode so a time budget still leaves both phases measured.
    pre = [Shape("prefill", 1, n, hq, hkv, hd, pages[0]) for n in prefill] if "prefill" in phases else []
    dec = [Shape("decode", b, n, hq, hkv, hd, pages[0]) for b, n in decode] if "decode" in phases else []
    for i in range(max(len(pre), len(dec))):
        shapes += pre[i : i + 1] + dec[i : i + 1]
    for p in pages[1:]:  # other page sizes: the first shape of each phase only
        if pre:
            shapes.append(Shape("prefill", 1, prefill[0], hq, hkv, hd, p))
        if dec:
            shapes.append(Shape("decode", decode[0][0], decode[0][1], hq, hkv, hd, p))
    return shapes


# ----------------------------------------------------------------------------------------------------
# Structured inputs
# ----------------------------------------------------------------------------------------------------
class Inputs:
    """One copy of a case's data: paged cache for ours/ModelOpt, contiguous [B, H, L, D] for SDPA."""

    def __init__(self, shape: Shape, dtype: torch.dtype, device: str, seed: int):
        s = shape
        self.shape = s
        self.scale = s.head_dim**-0.5
        gen = torch.Generator(device=device).manual_seed(seed)
        cpu_gen = torch.Generator().manual_seed(seed)
        pages_per_seq = -(-s.kv_len // s.page_size)
        num_blocks = s.batch * pages_per_seq + 1
        perm = torch.randperm(num_blocks, generator=cpu_gen)[: s.batch * pages_per_seq]
        self.block_table = perm.view(s.batch, pages_per_seq).to(torch.int32).to(device)
        # Unused cache slots hold noise, never zeros.
        cache_shape = (num_blocks, 2, s.page_size, s.hkv, s.head_dim)
        self.kv_cache = torch.randn(cache_shape, generator=gen, device=device, dtype=dtype)
        self.k_cache = self.kv_cache[:, 0]  # [num_blocks, page, Hkv, D] views, as the plugin passes them
        self.v_cache = self.kv_cache[:, 1]
        self.k_dense = torch.empty(s.batch, s.hkv, s.kv_len, s.head_dim, dtype=dtype, device=device)
        self.v_dense = torch.empty_like(self.k_dense)
        self.q = torch.empty(s.batch * s.q_len, s.hq, s.head_dim, dtype=dtype, device=device)
        self.cu_seqlens_q = torch.arange(0, s.batch + 1, dtype=torch.int32, device=device) * s.q_len
        self.seq_lens_k = torch.full((s.batch,), s.kv_len, dtype=torch.int32, device=device)
        self.q_lens = self.cu_seqlens_q[1:] - self.cu_seqlens_q[:-1]  # ModelOpt's b_seq_len
        self.k_dummy = torch.empty(0, s.hkv, s.head_dim, device=device, dtype=dtype)  # ModelOpt: GQA ratio only
        self._expanded: tuple[torch.Tensor, torch.Tensor] | None = None
        if REAL_INPUTS is not None:  # captured attention (benchmarks/attention_inputs.py), tiled to this shape
            self._fill_real(REAL_INPUTS)
            return
        self._fill_synthetic(gen, device, dtype)

    def _fill_synthetic(self, gen: torch.Generator, device: str, dtype: torch.dtype) -> None:
        """Structured inputs (sink, salience, recency, noise) drawn from `gen`, into the dense tensors, the paged
        cache and the queries: attention with the skew real models have, without a capture."""
        s = self.shape
        d = s.head_dim
        n_freq = max(1, min(16, d // 8))
        # Locality (RoPE-like): sum_f cos(w_f (p - j)), periods log-spaced from 64 to 8 * L, amplitude LOCALITY_AMP.
        periods = torch.logspace(math.log10(64), math.log10(8 * max(s.kv_len, 64)), n_freq, device=device)
        omega = 2 * math.pi / periods
        pos_amp = math.sqrt(LOCALITY_AMP / (n_freq * self.scale))
        # Salience direction per KV head, orthogonal to the positional dims; q carries sqrt(D) of it so a key's
        # salience h (in score units) adds h to every score of that key.
        u = torch.randn(s.hkv, d, generator=gen, device=device)
        u[:, : 2 * n_freq] = 0
        u = u / u.norm(dim=-1, keepdim=True)
        group = s.hq // s.hkv
        u_q = u.repeat_interleave(group, dim=0)  # [Hq, D]
        q_dir = math.sqrt(d) * u_q

        def pos_feat(pos: torch.Tensor) -> torch.Tensor:  # [n] -> [n, 2F]
            ang = pos.to(torch.float32)[:, None] * omega[None, :]
            return pos_amp * torch.stack([ang.cos(), ang.sin()], dim=-1).reshape(pos.shape[0], 2 * n_freq)

        chunk = 8192
        for b in range(s.batch):
            for j0 in range(0, s.kv_len, chunk):
                j1 = min(s.kv_len, j0 + chunk)
                pos = torch.arange(j0, j1, device=device)
                k = torch.randn(j1 - j0, s.hkv, d, generator=gen, device=device)
                k[:, :, : 2 * n_freq] += pos_feat(pos)[:, None, :]
                sal = torch.empty(j1 - j0, s.hkv, device=device).exponential_(1.0, generator=gen) * SALIENCE_SCALE
                if j0 == 0:
                    sal[0] = SINK_SCORE  # attention sink
                k += sal[..., None] * u[None]
                v = torch.randn(j1 - j0, s.hkv, d, generator=gen, device=device)
                self.k_dense[b, :, j0:j1] = k.permute(1, 0, 2).to(dtype)
                self.v_dense[b, :, j0:j1] = v.permute(1, 0, 2).to(dtype)
            # Scatter the sequence into its pages.
            n_full = s.kv_len // s.page_size
            pages = self.block_table[b].long()
            kd = self.k_dense[b].permute(1, 0, 2)  # [L, Hkv, D]
            vd = self.v_dense[b].permute(1, 0, 2)
            if n_full:
                self.k_cache[pages[:n_full]] = kd[: n_full * s.page_size].reshape(n_full, s.page_size, s.hkv, d)
                self.v_cache[pages[:n_full]] = vd[: n_full * s.page_size].reshape(n_full, s.page_size, s.hkv, d)
            rest = s.kv_len - n_full * s.page_size
            if rest:
                self.k_cache[pages[n_full], :rest] = kd[n_full * s.page_size :]
                self.v_cache[pages[n_full], :rest] = vd[n_full * s.page_size :]
            # Queries: the last q_len positions of the sequence.
            for p0 in range(0, s.q_len, chunk):
                p1 = min(s.q_len, p0 + chunk)
                pos = torch.arange(s.kv_len - s.q_len + p0, s.kv_len - s.q_len + p1, device=device)
                q = torch.randn(p1 - p0, s.hq, d, generator=gen, device=device)
                q -= (q * u_q).sum(-1, keepdim=True) * u_q  # exact salience gain: q . u = sqrt(D)
                q += q_dir[None]
                q[:, :, : 2 * n_freq] += pos_feat(pos)[:, None, :]
                self.q[b * s.q_len + p0 : b * s.q_len + p1] = q.to(dtype)
        # SDPA view of the queries: [B, Hq, q_len, D] (no copy).
        self.q_sdpa = self.q.view(s.batch, s.q_len, s.hq, d).transpose(1, 2)
        _note_program_share(self)

    def _fill_real(self, real) -> None:
        """Every sequence holds the capture tiled to the shape (`attention_inputs.tile_to_shape`: real heads, the
        prefix of the capture or its repetition, head dims zero-padded) and its softmax scale; queries are the
        last q_len positions."""
        s = self.shape
        q, k, v, self.scale = _sibling("attention_inputs").tile_to_shape(real, s.hq, s.hkv, s.head_dim, s.kv_len,
                                                             dtype=self.q.dtype)
        q, k, v = (x.to(self.q.device) for x in (q, k, v))
        n_full, pg = s.kv_len // s.page_size, s.page_size
        for b in range(s.batch):
            self.k_dense[b] = k.permute(1, 0, 2)
            self.v_dense[b] = v.permute(1, 0, 2)
            pages = self.block_table[b].long()
            if n_full:
                self.k_cache[pages[:n_full]] = k[: n_full * pg].reshape(n_full, pg, s.hkv, s.head_dim)
                self.v_cache[pages[:n_full]] = v[: n_full * pg].reshape(n_full, pg, s.hkv, s.head_dim)
            if s.kv_len > n_full * pg:
                self.k_cache[pages[n_full], : s.kv_len - n_full * pg] = k[n_full * pg :]
                self.v_cache[pages[n_full], : s.kv_len - n_full * pg] = v[n_full * pg :]
            self.q[b * s.q_len : (b + 1) * s.q_len] = q[s.kv_len - s.q_len :]
        self.q_sdpa = self.q.view(s.batch, s.q_len, s.hq, s.head_dim).transpose(1, 2)
        _note_program_share(self)

    def expanded_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V repeated to Hq heads, built once (for SDPA backends without native GQA)."""
        if self._expanded is None:
            group = self.shape.hq // self.shape.hkv
            k, v = self.k_dense, self.v_dense
            self._expanded = (k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1))
        return self._expanded

    def sdpa_out_as_ours(self, o: torch.Tensor) -> torch.Tensor:
        return o.transpose(1, 2).reshape(-1, self.shape.hq, self.shape.head_dim)


def case_bytes(shape: Shape, dtype: torch.dtype) -> tuple[int, int]:
    """(bytes of one input copy, bytes of K/V read per call)."""
    elt = torch.finfo(dtype).bits // 8
    kv = 2 * shape.batch * shape.kv_len * shape.hkv * shape.head_dim * elt
    q = shape.batch * shape.q_len * shape.hq * shape.head_dim * elt
    pages = -(-shape.kv_len // shape.page_size) * shape.page_size * shape.batch
    paged = 2 * (pages + shape.page_size) * shape.hkv * shape.head_dim * elt
    return kv + paged + q, kv


# ----------------------------------------------------------------------------------------------------
# Kernels under test
# ----------------------------------------------------------------------------------------------------
# Real inputs: the capture the benchmark runs on (None: --synthetic); set by main.
REAL_INPUTS = None
# Per shape label: the share of (program, tile) pairs its programs can skip, as a function of λ (coherence.py).
PROGRAM_SHARES: dict = {}


def prefill_program_rows(head_dim: int) -> int:
    """Rows of a prefill program: the Triton kernel's default launch (64 rows for D <= 64, 128 above)."""
    return 128 if head_dim > 64 else 64


def _sibling(name: str):
    """A module of this folder (on sys.path when run as a script; loaded from its file when imported by path)."""
    if name in sys.modules:
        return sys.modules[name]
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        return mod


def _note_program_share(inp: Inputs) -> None:
    """Measure, once per shape (its first input copy), which (program, key tile) pairs are skippable at any λ:
    prefill programs are blocks of `prefill_program_rows` rows of one query head, decode programs a KV head's GQA
    group; the bound column uses this share, not the row-tile sparsity."""
    s = inp.shape
    if s.label in PROGRAM_SHARES:
        return
    coherence = _sibling("coherence")
    q = inp.q[: s.q_len]  # sequence 0 (every sequence holds the same kind of data)
    k = inp.k_dense[0].permute(1, 0, 2)
    PROGRAM_SHARES[s.label] = coherence.ProgramShare(q, k, inp.scale, s.phase, prefill_program_rows(s.head_dim),
                                                     rows=False)


_OURS = None


def ours(inp: Inputs, lam, backend: str, **kw):
    global _OURS
    if _OURS is None:
        from modelopt_ext.torch.kernels.sparsity.attention import paged_skip_softmax_attention as _OURS
    return _OURS(
        inp.q,
        inp.k_cache,
        inp.v_cache,
        inp.block_table,
        inp.cu_seqlens_q,
        inp.seq_lens_k,
        softmax_scale=inp.scale,
        skip_threshold=lam,
        backend=backend,
        **kw,
    )


def ours_launch(inp: Inputs, lam_t, backend: str, **launch_kw):
    """Our kernel as the vLLM plugin launches it, for timing: arguments normalised once, persistent output, counts
    and split workspace buffers, int32 metadata; a call is the kernel launch alone. (The public entry,
    `paged_skip_softmax_attention`, also checks its inputs and builds the threshold tensors on every call: host work
    that a small decode call on a GPU does not hide; it is still what the outputs and counts are checked with.)
    `launch_kw` go to the launch (e.g. the Triton kernels' `config`). Returns run(copy) -> (out, counts) for inputs
    of the same shape; both are the persistent buffers, rewritten by the next call."""
    from modelopt_ext.torch.kernels.sparsity.attention.api import kernel_launcher, resolve_backend
    from modelopt_ext.torch.kernels.sparsity.attention.semantics import (
        decode_workspace_numel,
        default_prompt_lens,
        normalize_thresholds,
    )

    s = inp.shape
    device = inp.q.device
    log_sf, gamma, calibrate = normalize_thresholds(
        s.batch, device, skip_threshold=lam_t, return_skip_counts=lam_t is not None
    )
    prompts = default_prompt_lens(inp.cu_seqlens_q, inp.seq_lens_k)
    out = torch.empty_like(inp.q)
    counts = None if log_sf is None else torch.zeros(s.batch, 1, 2, dtype=torch.int64, device=device)
    resolved = resolve_backend(backend, inp.q, inp.k_cache)
    workspace = None
    if resolved == "triton":
        n_acc, n_ml = decode_workspace_numel(s.batch, s.hq, s.head_dim, s.kv_len)
        workspace = (torch.empty(n_acc, dtype=torch.float32, device=device),
                     torch.empty(n_ml, dtype=torch.float32, device=device))  # fmt: skip
    launch = kernel_launcher(resolved)

    def run(c: Inputs):
        launch(
            c.q, c.k_cache, c.v_cache, c.block_table, c.cu_seqlens_q, c.seq_lens_k, softmax_scale=c.scale,
            log_sf=log_sf, gamma=gamma, prompt_lens=prompts, calibrate=calibrate, out=out, max_seqlen_k=s.kv_len,
            counts=counts, workspace=workspace, decode_only=s.phase == "decode", **launch_kw,
        )  # fmt: skip
        return out, counts

    return run


def sdpa_backends(device: str, fallback: bool = False) -> list[tuple[str, object]]:
    from torch.nn.attention import SDPBackend

    if device == "cuda":
        names = [("sdpa_flash", "FLASH_ATTENTION"), ("sdpa_cudnn", "CUDNN_ATTENTION")]
        if fallback:  # only when neither ran (e.g. --dtype fp32, which FlashAttention does not take)
            names = [("sdpa_efficient", "EFFICIENT_ATTENTION"), ("sdpa_math", "MATH")]
    else:
        names = [("sdpa_flash", "FLASH_ATTENTION"), ("sdpa_math", "MATH")]
    return [(label, getattr(SDPBackend, attr)) for label, attr in names if hasattr(SDPBackend, attr)]


def sdpa(inp: Inputs, backend, gqa_mode: str) -> torch.Tensor:
    k, v = (inp.k_dense, inp.v_dense) if gqa_mode == "native" else inp.expanded_kv()
    return sdpa_call(inp.q_sdpa, k, v, inp.scale, inp.shape.phase == "prefill", backend)


def sdpa_call(q, k, v, scale: float, causal: bool, backend) -> torch.Tensor:
    """SDPA on [B, H, L, D] tensors with one backend; K/V with fewer heads than q take native GQA. Causal is used for
    prefill only, where q_len == kv_len, so top-left == bottom-right alignment."""
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel([backend]):
        if k.shape[1] != q.shape[1]:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


class ModelOptBaseline:
    """ModelOpt 0.47's paged Triton flash attention with skip-softmax, or the reason it is unavailable."""

    def __init__(self, fn=None, version: str | None = None, mode: str | None = None, reason: str | None = None):
        self.fn, self.version, self.mode, self.reason = fn, version, mode, reason
        self.module = None

    @property
    def available(self) -> bool:
        return self.fn is not None

    def describe(self) -> str:
        if self.available:
            return f"ModelOpt baseline: nvidia-modelopt {self.version} (import: {self.mode})"
        return f"ModelOpt baseline: unavailable ({self.reason})"

    def __call__(self, inp: Inputs, lam, measure: bool = False) -> torch.Tensor:
        s = inp.shape
        return self.fn(
            inp.q,
            inp.k_dummy,
            inp.k_dummy,
            b_start_loc=inp.cu_seqlens_q[:-1],
            b_seq_len=inp.q_lens,
            max_input_len=s.q_len,
            is_causal=True,
            softmax_scale=inp.scale,
            b_start_loc_k=None,
            b_seq_len_k=inp.seq_lens_k,
            max_input_len_k=s.kv_len,
            k_cache=inp.k_cache,
            v_cache=inp.v_cache,
            block_table=inp.block_table,
            page_size=s.page_size,
            skip_softmax_threshold=lam,
            measure_sparsity=measure,
        )


_KERNEL_PACKAGES = (
    "modelopt",
    "modelopt.torch",
    "modelopt.torch.kernels",
    "modelopt.torch.kernels.common",
    "modelopt.torch.kernels.common.attention",
    "modelopt.torch.kernels.sparsity",
    "modelopt.torch.kernels.sparsity.attention",
    "modelopt.torch.kernels.quantization",
    "modelopt.torch.kernels.quantization.attention",
    "modelopt.torch.kernels.quantization.common",
)
_TRITON_FA = "modelopt.torch.kernels.common.attention.triton_fa"


def _drop_modelopt_modules() -> None:
    for name in [m for m in sys.modules if m == "modelopt" or m.startswith("modelopt.")]:
        del sys.modules[name]


def _modelopt_version(search_dirs: list[str]) -> str:
    from importlib import metadata

    for dist in metadata.distributions(path=search_dirs + sys.path):
        if (dist.metadata["Name"] or "").lower() == "nvidia-modelopt":
            return dist.version
    return "unknown"


def load_modelopt(mode: str, wheels: str | None, path: str | None, device: str) -> ModelOptBaseline:
    """Import ModelOpt's paged Triton attention. mode: auto | full | kernel-only | off."""
    base = _import_modelopt(mode, wheels, path)
    if base.available and device != "cuda":
        base.fn = None
        base.reason = f"imported ({base.version}, {base.mode}), but its Triton kernel needs a CUDA device"
    return base


def _import_modelopt(mode: str, wheels: str | None, path: str | None) -> ModelOptBaseline:
    if mode == "off":
        return ModelOptBaseline(reason="disabled with --modelopt off")
    extra: list[str] = []
    if path:
        extra.append(str(Path(path).resolve()))
    if wheels:
        found = sorted(Path(wheels).glob("nvidia_modelopt-*.whl"))
        if not found:
            return ModelOptBaseline(reason=f"no nvidia_modelopt-*.whl in {wheels}")
        target = tempfile.mkdtemp(prefix="modelopt_whl_")
        with zipfile.ZipFile(found[-1]) as zf:
            zf.extractall(target)
        extra.append(target)
    for p in reversed(extra):
        if p not in sys.path:
            sys.path.insert(0, p)
    importlib.invalidate_caches()
    if importlib.util.find_spec("modelopt") is None:
        return ModelOptBaseline(reason="nvidia-modelopt is not importable (pass --modelopt-wheels DIR with its wheel)")
    version = _modelopt_version(extra)
    errors = []
    if mode in ("auto", "full"):
        try:
            mod = importlib.import_module(_TRITON_FA)
            base = ModelOptBaseline(mod.attention, version, "full package")
            base.module = mod
            return base
        except Exception as exc:  # missing optional deps (pydantic, omegaconf, ...) on bare machines
            errors.append(f"full import: {type(exc).__name__}: {exc}")
            _drop_modelopt_modules()
            if mode == "full":
                return ModelOptBaseline(reason="; ".join(errors))
    try:
        # Load only the kernel modules (torch + triton): parent packages become plain namespaces so their
        # __init__ files (which pull in the whole library) do not run. ModelOpt's code itself is unchanged.
        root = Path(importlib.util.find_spec("modelopt").submodule_search_locations[0])
        for name in _KERNEL_PACKAGES:
            rel = name.split(".")[1:]
            pkg = types.ModuleType(name)
            pkg.__path__ = [str(root.joinpath(*rel))]
            sys.modules[name] = pkg
            if "." in name:
                parent, child = name.rsplit(".", 1)
                setattr(sys.modules[parent], child, pkg)
        mod = importlib.import_module(_TRITON_FA)
        base = ModelOptBaseline(mod.attention, version, "kernel modules only")
        base.module = mod
        return base
    except Exception as exc:
        errors.append(f"kernel-only import: {type(exc).__name__}: {exc}")
        _drop_modelopt_modules()
        return ModelOptBaseline(reason="; ".join(errors))


def count_triton_variants(module) -> int | None:
    """Compiled kernel variants held by the Triton JIT functions of a module (best effort; None if unknown)."""
    if module is None:
        return None
    total, found = 0, False
    for obj in list(vars(module).values()):
        fn = obj
        for _ in range(4):
            if hasattr(fn, "device_caches"):
                break
            fn = getattr(fn, "fn", None)
            if fn is None:
                break
        caches = getattr(fn, "device_caches", None)
        if caches is None:
            continue
        found = True
        for entry in list(caches.values()):
            kernel_cache = entry[0] if isinstance(entry, tuple) else entry
            with contextlib.suppress(TypeError):
                total += len(kernel_cache)
    return total if found else None


def our_triton_module():
    try:
        return importlib.import_module("modelopt_ext.torch.kernels.sparsity.attention.triton_kernel")
    except Exception:
        return None


# ----------------------------------------------------------------------------------------------------
# FP8 KV caches
# ----------------------------------------------------------------------------------------------------
def quantize_fp8(x: torch.Tensor, fp8_dtype: torch.dtype, scale: float = FP8_SCALE) -> torch.Tensor:
    """x / scale saturated to the format's range (±448 e4m3, ±57344 e5m2) and rounded to nearest, as vLLM's CUDA
    cache writer stores FP8 bytes; in chunks of the first dimension, so a large cache needs no float32 copy."""
    fmax = torch.finfo(fp8_dtype).max
    out = torch.empty(x.shape, dtype=fp8_dtype, device=x.device)
    step = max(1, (1 << 27) // max(1, x[0].numel())) if x.dim() else 1
    for i in range(0, x.shape[0], step):
        out[i : i + step] = (x[i : i + step].float() / scale).clamp_(-fmax, fmax).to(fp8_dtype)
    return out


def fp8_inputs(inp: Inputs, fp8_dtype: torch.dtype) -> Inputs:
    """The same case on an FP8 cache: a shallow copy sharing queries, metadata and the dense tensors, with its own
    quantized paged cache (the plugin's [num_blocks, page, Hkv, D] K and V views of it)."""
    c = copy.copy(inp)
    c.kv_cache = quantize_fp8(inp.kv_cache, fp8_dtype)
    c.k_cache, c.v_cache = c.kv_cache[:, 0], c.kv_cache[:, 1]
    c._expanded = None
    return c


def fp8_reference(inp: Inputs, fp8_dtype: torch.dtype, backend, gqa_mode: str) -> torch.Tensor:
    """Dense SDPA (`backend`, GQA native or expanded) on the values an FP8 cache holds (the dense K/V quantized as the
    cache and read back in q's dtype, exactly), one sequence at a time to bound memory; [B * q_len, Hq, D] like our
    output."""
    s = inp.shape
    out = torch.empty_like(inp.q)
    group = 1 if gqa_mode == "native" else s.hq // s.hkv
    for b in range(s.batch):
        k, v = (quantize_fp8(x[b : b + 1], fp8_dtype).to(inp.q.dtype).mul_(FP8_SCALE).repeat_interleave(group, dim=1)
                for x in (inp.k_dense, inp.v_dense))  # fmt: skip
        o = sdpa_call(inp.q_sdpa[b : b + 1], k, v, inp.scale, s.phase == "prefill", backend)
        out[b * s.q_len : (b + 1) * s.q_len] = o.transpose(1, 2).reshape(-1, s.hq, s.head_dim)
    return out


class FlashInferFP8:
    """FlashInfer's paged decode / prefill wrappers reading the same FP8 cache densely (the dense baseline on an FP8
    cache without vLLM), or the reason it is unavailable. Imported from the environment (the GPU check puts pure
    wheels carried in .whl/, such as flashinfer-python, on PYTHONPATH)."""

    def __init__(self, module=None, version: str | None = None, reason: str | None = None):
        self.module, self.version, self.reason = module, version, reason

    @property
    def available(self) -> bool:
        return self.module is not None

    def describe(self) -> str:
        if self.available:
            return f"FP8 dense baseline: FlashInfer {self.version}"
        return f"FP8 dense baseline: none ({self.reason})"

    def prepare(self, inp: Inputs, fp8_dtype: torch.dtype):
        """Plan once for the case (vLLM's NHD layout [num_blocks, 2, page, Hkv, D] is FlashInfer's paged layout);
        returns run(copy) -> out for FP8 copies of the same shape."""
        fi, s = self.module, inp.shape
        dev, i32 = inp.q.device, torch.int32
        workspace = torch.empty(256 << 20, dtype=torch.uint8, device=dev)  # vLLM's FlashInfer workspace size
        pages = -(-s.kv_len // s.page_size)
        indptr = torch.arange(s.batch + 1, dtype=i32, device=dev) * pages
        indices = inp.block_table[:, :pages].reshape(-1).to(i32).contiguous()
        last = torch.full((s.batch,), s.kv_len - (pages - 1) * s.page_size, dtype=i32, device=dev)
        common = dict(q_data_type=inp.q.dtype, kv_data_type=fp8_dtype, sm_scale=inp.scale * FP8_SCALE)
        if s.phase == "decode":  # tensor cores beyond a GQA group of 4, as vLLM's FlashInfer backend decides
            w = fi.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=s.hq // s.hkv > 4)
            w.plan(indptr, indices, last, s.hq, s.hkv, s.head_dim, s.page_size, pos_encoding_mode="NONE", **common)
        else:
            w = fi.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
            w.plan(inp.cu_seqlens_q, indptr, indices, last, s.hq, s.hkv, s.head_dim, s.page_size, causal=True,
                   **common)  # fmt: skip
        out = torch.empty_like(inp.q)

        def run(c: Inputs) -> torch.Tensor:
            return w.run(c.q, c.kv_cache, k_scale=FP8_SCALE, v_scale=FP8_SCALE, out=out)

        return run


def load_flashinfer(mode: str, device: str) -> FlashInferFP8:
    """FlashInfer for the FP8 dense baseline. mode: auto (only with prebuilt kernels, flashinfer-jit-cache: a JIT
    build with nvcc would take minutes of the time budget), flashinfer (JIT builds allowed) or off."""
    if mode == "off":
        return FlashInferFP8(reason="disabled with --fp8-baseline off")
    if device != "cuda":
        return FlashInferFP8(reason="FlashInfer needs a CUDA device")
    if importlib.util.find_spec("flashinfer") is None:
        return FlashInferFP8(reason="flashinfer is not importable (no vLLM here; carry a flashinfer-python wheel "
                                    "with flashinfer-jit-cache in .whl/)")
    if mode == "auto" and importlib.util.find_spec("flashinfer_jit_cache") is None:
        return FlashInferFP8(reason="flashinfer has no prebuilt kernels (flashinfer-jit-cache): it would JIT-build "
                                    "them inside the time budget; --fp8-baseline flashinfer allows that")
    try:
        fi = importlib.import_module("flashinfer")
    except Exception as exc:
        return FlashInferFP8(reason=f"import flashinfer: {type(exc).__name__}: {str(exc)[:200]}")
    return FlashInferFP8(fi, getattr(fi, "__version__", "unknown"))


# ----------------------------------------------------------------------------------------------------
# λ search
# ----------------------------------------------------------------------------------------------------
def _sparsity(counts: torch.Tensor) -> list[float]:
    c = counts.sum(dim=0).double()  # [T, 2]
    return [float(s / v) if v > 0 else 0.0 for v, s in zip(c[:, 0].tolist(), c[:, 1].tolist(), strict=True)]


def find_lambdas(inp: Inputs, targets: list[float], backend: str) -> tuple[dict, str]:
    """λ per target sparsity on this data: {target: (λ, sparsity predicted by the search)} and the method used."""

    def sweep(lams: list[float]) -> list[float]:
        out = []
        for i in range(0, len(lams), 16):  # 16 trials per dense pass (padded: the trial count is compiled in)
            chunk = lams[i : i + 16]
            _, counts = ours(inp, None, backend, threshold_trials=chunk + [chunk[-1]] * (16 - len(chunk)))
            out += _sparsity(counts)[: len(chunk)]
        return out

    method = "calibration sweep"
    try:
        grid = [10 ** (-12 + 12 * i / 24) for i in range(24)] + [0.999]
        sp = sweep(grid)
        refine: list[float] = []
        for t in targets:
            i = next((k for k, v in enumerate(sp) if v >= t), len(sp) - 1)
            lo, hi = grid[max(0, i - 1)], grid[i]
            refine += [math.exp(math.log(lo) + (math.log(hi) - math.log(lo)) * k / 11) for k in range(12)]
        sp2 = sweep(refine)
        lams, sps = grid + refine, sp + sp2
    except Exception as exc:  # calibration mode unavailable: bisect with serving counts
        method = f"bisection (calibration sweep failed: {type(exc).__name__})"
        lams, sps = [], []

        def serve(lam: float) -> float:
            _, counts = ours(inp, lam, backend, return_skip_counts=True)
            return _sparsity(counts)[0]

        for t in targets:
            lo, hi = -20.0, math.log(0.999)  # ln λ
            for _ in range(10):
                mid = 0.5 * (lo + hi)
                s = serve(math.exp(mid))
                lams.append(math.exp(mid))
                sps.append(s)
                lo, hi = (mid, hi) if s < t else (lo, mid)
    chosen = {}
    for t in targets:
        k = min(range(len(lams)), key=lambda i, t=t: (abs(sps[i] - t), lams[i]))
        chosen[t] = (lams[k], sps[k])
    return chosen, method


# ----------------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------------
def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_fn(fn, n_copies: int, device: str, args) -> dict:
    """Median time (ms) of fn(copy_index) over many runs; inputs rotate over the copies."""
    t_warm = time.perf_counter()
    for i in range(args.warmup):  # the first call compiles; slow kernels stop warming up after target_seconds
        fn(i % n_copies)
        _sync(device)
        if i and time.perf_counter() - t_warm > args.target_seconds:
            break
    t0 = time.perf_counter()
    fn(0)
    _sync(device)
    est = max(time.perf_counter() - t0, 1e-6)
    min_iters = args.min_iters if est < 0.1 else min(args.min_iters, 3)
    iters = int(min(args.max_iters, max(min_iters, args.target_seconds / est)))
    times = []
    if device == "cuda":
        sleep = getattr(torch.cuda, "_sleep", None)
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for i, (start, end) in enumerate(ev):
            if sleep is not None:
                sleep(200_000)  # ~0.1 ms of GPU work queued ahead, so the host launch cost is not timed
            start.record()
            fn(i % n_copies)
            end.record()
        torch.cuda.synchronize()
        times = [s.elapsed_time(e) for s, e in ev]
    else:
        for i in range(iters):
            t0 = time.perf_counter()
            fn(i % n_copies)
            times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return {
        "ms": statistics.median(times),
        "ms_min": times[0],
        "ms_p90": times[min(len(times) - 1, int(0.9 * len(times)))],
        "iters": iters,
    }


def compare(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype | None = None) -> tuple[float, bool]:
    """(max |a - b|, whether a matches reference b within TOLERANCE[dtype]), in chunks to bound memory."""
    atol, rtol = TOLERANCE.get(dtype, (0.0, 0.0))
    worst, ok = 0.0, True
    step = max(1, (1 << 26) // max(1, a[0].numel()))
    for i in range(0, a.shape[0], step):
        x, y = a[i : i + step].float(), b[i : i + step].float()
        diff = (x - y).abs()
        d = diff.max().item()
        worst = max(worst, d if d == d else math.inf)
        ok = ok and bool((diff <= atol + rtol * y.abs()).all())
    return worst, ok


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return compare(a, b)[0]


# ----------------------------------------------------------------------------------------------------
# One shape
# ----------------------------------------------------------------------------------------------------
class _ShapeRun:
    """One shape's measurements in progress: its records, input copies, dense reference and time budget."""

    def __init__(self, shape: Shape, args, dtype, deadline: float, log, flush):
        self.shape, self.args, self.dtype, self.device = shape, args, dtype, args.device
        self.deadline, self.log, self.flush = deadline, log, flush
        self.recs: list[dict] = []
        self.base = {"shape": shape.label, **asdict(shape), "dtype": args.dtype, "kv": args.dtype}
        self.n_copies = 1
        self.copies: list[Inputs] = []
        self.ref = None  # the dense SDPA output every check compares with

    def rec(self, variant: str, impl: str, **kw) -> dict:
        """A new record of this shape (appended), every field present."""
        r = {**self.base, "variant": variant, "impl": impl, "lam": None, "target": None, "sparsity": None,
             "ms": None, "ms_min": None, "ms_p90": None, "iters": None, "err_vs_dense": None, "check": "",
             "error": "", **kw}  # fmt: skip
        self.recs.append(r)
        return r

    def in_budget(self) -> bool:
        return time.perf_counter() < self.deadline

    def flush_records(self) -> None:
        if self.flush:
            self.flush(self.recs)


def _make_copies(run: _ShapeRun) -> bool:
    """Build the input copies (on CUDA enough to defeat the L2 cache, as many as memory allows); False, with the
    reason recorded, when not even one fits."""
    shape, args, device = run.shape, run.args, run.device
    copy_bytes, kv_bytes = case_bytes(shape, run.dtype)
    if device == "cuda":
        run.n_copies = max(1, min(args.max_copies, math.ceil(4 * L2_BYTES / kv_bytes)))
        free, _ = torch.cuda.mem_get_info()
        usable = int(0.6 * free) - 4 * copy_bytes // 3  # leave room for outputs and comparisons
        while run.n_copies > 1 and run.n_copies * copy_bytes > usable:
            run.n_copies -= 1
        if copy_bytes > usable:
            run.rec("all", "-", error=f"skipped: needs ~{copy_bytes / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free")
            return False
    t_setup = time.perf_counter()
    run.copies = [Inputs(shape, run.dtype, device, seed=args.seed + 1000 * c) for c in range(run.n_copies)]
    _sync(device)
    run.log(f"  inputs: {run.n_copies} cop{'y' if run.n_copies == 1 else 'ies'} x {copy_bytes / 2**20:.0f} MiB "
            f"({time.perf_counter() - t_setup:.1f} s)")  # fmt: skip
    return True


def _try_sdpa_backend(run: _ShapeRun, label: str, be) -> tuple[str, str | None]:
    """Run one SDPA backend with native GQA, else with expanded K/V (where memory allows): ("", gqa mode) when it
    ran (the first that runs becomes the reference, the others are checked against it), else (why, None)."""
    inp0, err = run.copies[0], ""
    for gqa in ("native", "expand"):
        if gqa == "expand" and run.device == "cuda":
            free, _ = torch.cuda.mem_get_info()
            need = 2 * (run.shape.hq // run.shape.hkv) * inp0.k_dense.numel() * inp0.k_dense.element_size()
            need *= run.n_copies
            if need > 0.3 * free:
                err += f"; expanded K/V would need {need / 2**30:.1f} GiB"
                continue
        try:
            o = inp0.sdpa_out_as_ours(sdpa(inp0, be, gqa))
            _sync(run.device)
        except Exception as exc:
            err = f"{gqa}: {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
            continue
        if run.ref is None:
            run.ref = o
            run.rec(label, "sdpa", check=f"reference (gqa={gqa})")
        else:
            e, ok = compare(o, run.ref, run.dtype)
            run.rec(label, "sdpa", err_vs_dense=e, check=("ok" if ok else "MISMATCH") + f" (gqa={gqa})")
        del o
        return "", gqa
    return err, None


def _sdpa_reference(run: _ShapeRun) -> list[tuple[str, object, str]]:
    """The SDPA backends that run on this shape, as (label, backend, gqa mode); sets `run.ref` from the first. The
    fallback backends are tried only when none of the usual ones ran on CUDA."""
    sdpa_ok: list[tuple[str, object, str]] = []
    candidates = sdpa_backends(run.device)
    fallback_added = run.device != "cuda"
    while candidates:
        label, be = candidates.pop(0)
        err, gqa = _try_sdpa_backend(run, label, be)
        if gqa is not None:
            sdpa_ok.append((label, be, gqa))
        else:
            run.rec(label, "sdpa", error=f"unavailable: {err}")
        if not candidates and run.ref is None and not fallback_added:
            candidates, fallback_added = sdpa_backends(run.device, fallback=True), True
    return sdpa_ok


def _ours_dense_check(run: _ShapeRun) -> tuple[float | None, str]:
    """(error, verdict) of our dense output against the SDPA reference."""
    try:
        o = ours(run.copies[0], None, run.args.backend)
        e_dense, ok = compare(o, run.ref, run.dtype)
        del o
        return e_dense, "ok" if ok else "MISMATCH"
    except Exception as exc:
        run.log(traceback.format_exc())
        return None, f"ERROR {type(exc).__name__}: {str(exc)[:200]}"


def _lambda_cases(run: _ShapeRun) -> tuple[list[tuple], str]:
    """(variant, λ, target) cases: dense, a tiny λ (skipping on, nothing skipped), and one λ per target sparsity
    found by the λ search (with the search's method)."""
    lam_info, method = {}, ""
    if run.args.sparsities:
        try:
            t0 = time.perf_counter()
            lam_info, method = find_lambdas(run.copies[0], run.args.sparsities, run.args.backend)
            run.log(f"  λ search ({method}, {time.perf_counter() - t0:.1f} s): "
                    + ", ".join(f"s={t:.2f}: λ={lam:.3g} (pred {sp:.3f})" for t, (lam, sp) in lam_info.items()))
        except Exception as exc:
            run.log(f"  λ search failed: {type(exc).__name__}: {exc}")
            run.log(traceback.format_exc())
    cases = [("ours_dense", None, None), ("ours_tiny", TINY_LAMBDA, 0.0)]
    cases += [(f"ours_s{round(100 * t)}", lam, t) for t, (lam, _) in lam_info.items()]
    return cases, method


def _time_sdpa(run: _ShapeRun, sdpa_ok: list[tuple[str, object, str]]) -> None:
    """Time each SDPA backend that ran, into its record."""
    copies = run.copies
    for label, be, gqa in sdpa_ok:
        r = next(r for r in run.recs if r["variant"] == label)
        if not run.in_budget():
            r["error"] = "skipped: time budget"
            continue
        try:
            r.update(time_fn(lambda i, be=be, gqa=gqa: sdpa(copies[i], be, gqa), run.n_copies, run.device, run.args))
        except Exception as exc:
            r["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"


def _time_ours(run: _ShapeRun, cases: list[tuple], e_dense, dense_check: str) -> list:
    """Check and time our kernel at each λ case; the compiled-variant counts after each λ case (Triton)."""
    shape, device, backend, copies, inp0 = run.shape, run.device, run.args.backend, run.copies, run.copies[0]
    ours_snaps: list = []  # compiled-variant counts after each λ case
    for variant, lam, target in cases:
        r = run.rec(variant, "ours", lam=lam, target=target)
        if variant == "ours_dense":
            r["err_vs_dense"], r["check"] = e_dense, dense_check
        if not run.in_budget():
            r["error"] = "skipped: time budget"
            continue
        try:
            lam_t = None  # per-sequence λ tensor [B], built once as the plugin's per-step planning would
            if lam is not None:
                lam_t = torch.full((shape.batch,), lam, dtype=torch.float32, device=device)
                o, counts = ours(inp0, lam_t, backend, return_skip_counts=True)
                r["sparsity"] = _sparsity(counts)[0]
                r["err_vs_dense"] = max_abs_diff(o, run.ref)
                del o
            else:
                r["sparsity"] = 0.0
            launch = ours_launch(inp0, lam_t, backend)
            r.update(time_fn(lambda i, launch=launch: launch(copies[i]), run.n_copies, device, run.args))
            if lam is not None and backend == "triton":
                ours_snaps.append(count_triton_variants(our_triton_module()))
        except Exception as exc:
            r["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            run.log(traceback.format_exc())
    return ours_snaps


def _time_modelopt(run: _ShapeRun, mo: ModelOptBaseline, cases: list[tuple]) -> list:
    """Check and time ModelOpt's kernel at the same λ cases; its compiled-variant counts after each λ case."""
    copies, inp0 = run.copies, run.copies[0]
    mo_snaps: list = []
    for variant, lam, target in cases:
        r = run.rec(variant.replace("ours", "modelopt"), "modelopt", lam=lam, target=target)
        if not run.in_budget():
            r["error"] = "skipped: time budget"
            continue
        try:
            mo_lam = None if lam is None else float(lam)
            o = mo(inp0, mo_lam, measure=run.args.modelopt_measure and lam is not None)
            _sync(run.device)
            r["err_vs_dense"], ok = compare(o, run.ref, run.dtype)
            if lam is None:
                r["check"] = "ok" if ok else "MISMATCH"
                r["sparsity"] = 0.0
            elif hasattr(o, "_sparsity_total") and o._sparsity_total:
                # ModelOpt's own count (fixed 128x128 measurement tiles, not the timed config's tiles).
                r["sparsity"] = o._sparsity_skipped / o._sparsity_total
                r["check"] = "sparsity: ModelOpt 128x128 measure tiles"
            del o
            r.update(time_fn(lambda i, mo_lam=mo_lam: mo(copies[i], mo_lam), run.n_copies, run.device, run.args))
            if lam is not None:
                mo_snaps.append(count_triton_variants(mo.module))
        except Exception as exc:
            r["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            run.log(traceback.format_exc())
        run.flush_records()
    return mo_snaps


def fp8_applies(shape: Shape, args) -> bool:
    """Whether the shape gets FP8-cache rows: its phase is in --fp8-phases and its page size is the first one (the
    other page sizes repeat a shape of each phase only for the page size's sake)."""
    return shape.phase in args.fp8_phases and shape.page_size == first_page_size(args)


def _fp8_copies(run: _ShapeRun, fp8_dtype: torch.dtype) -> list[Inputs]:
    """FP8 copies of the input copies, as many as memory allows on CUDA (at least one, or none: [])."""
    n = run.n_copies
    if run.device == "cuda":
        free, _ = torch.cuda.mem_get_info()
        per_copy = run.copies[0].kv_cache.numel() + 2 * run.copies[0].k_dense[0].numel() * run.dtype.itemsize
        n = min(n, int(0.6 * free) // max(1, per_copy))
    return [fp8_inputs(c, fp8_dtype) for c in run.copies[:n]]


def _time_ours_fp8(run: _ShapeRun, copies8: list[Inputs], ref8, tag: str, cases: list[tuple]) -> None:
    """Check and time our kernel on the FP8 copies at each case: the dense output against dense SDPA on the same FP8
    values, the realized sparsity at the model-dtype cache's λ (a checkpoint calibrated on a bf16 cache serves an FP8
    one with the same law)."""
    backend, inp0 = run.args.backend, copies8[0]
    scales = dict(k_scale=FP8_SCALE, v_scale=FP8_SCALE)
    for variant, lam, target in cases:
        r = run.rec(variant.replace("ours_", f"ours_{tag}_"), "ours", lam=lam, target=target, kv=tag)
        if not run.in_budget():
            r["error"] = "skipped: time budget"
            continue
        try:
            lam_t = None if lam is None else torch.full((run.shape.batch,), lam, dtype=torch.float32,
                                                        device=run.device)  # fmt: skip
            if lam is None:
                o, r["sparsity"] = ours(inp0, None, backend, **scales), 0.0
            else:
                o, counts = ours(inp0, lam_t, backend, return_skip_counts=True, **scales)
                r["sparsity"] = _sparsity(counts)[0]
            r["err_vs_dense"], ok = compare(o, ref8, run.dtype)
            if lam is None:
                r["check"] = ("ok" if ok else "MISMATCH") + " (vs SDPA on the FP8 values)"
                r["err_vs_model_dtype_cache"] = max_abs_diff(o, run.ref)
            del o
            launch = ours_launch(inp0, lam_t, backend, **scales)
            r.update(time_fn(lambda i, launch=launch: launch(copies8[i]), len(copies8), run.device, run.args))
        except Exception as exc:
            r["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            run.log(traceback.format_exc())
        run.flush_records()


def _time_fp8_baseline(run: _ShapeRun, fi: FlashInferFP8, copies8: list[Inputs], ref8, tag: str) -> None:
    """The dense baseline on the same FP8 cache (FlashInfer), checked against SDPA on the FP8 values; without one,
    a record saying why (a baseline that differs is named in its check, not failed: it is not ours)."""
    r = run.rec(f"flashinfer_{tag}_dense", "flashinfer", kv=tag, sparsity=0.0)
    if not fi.available:
        r["error"] = f"unavailable: {fi.reason}"
        return
    if not run.in_budget():
        r["error"] = "skipped: time budget"
        return
    try:
        fn = fi.prepare(copies8[0], copies8[0].kv_cache.dtype)
        r["err_vs_dense"], ok = compare(fn(copies8[0]), ref8, run.dtype)
        r["check"] = "ok" if ok else "differs from SDPA on the FP8 values"
        r.update(time_fn(lambda i: fn(copies8[i]), len(copies8), run.device, run.args))
    except Exception as exc:
        r["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        run.log(traceback.format_exc())


def _time_fp8(run: _ShapeRun, fi: FlashInferFP8, cases: list[tuple], sdpa_ok: list[tuple]) -> None:
    """FP8-cache rows of the shape (--kv-cache-dtype): ours dense and at the --fp8-sparsities targets (the λ found on
    the model-dtype cache), then the dense FP8 baseline, per FP8 format; after every model-dtype row."""
    wanted = {round(100 * t) for t in run.args.fp8_sparsities}
    fp8_cases = [c for c in cases if c[0] == "ours_dense" or (c[2] and round(100 * c[2]) in wanted)]
    _, ref_backend, gqa = sdpa_ok[0]  # the backend that made run.ref
    for name in run.args.fp8_caches:
        fp8_dtype = FP8_CACHES[name]
        tag = FP8_TAGS[fp8_dtype]
        if not run.in_budget():
            run.rec(f"ours_{tag}_dense", "ours", kv=tag, error="skipped: time budget")
            continue
        t0 = time.perf_counter()
        copies8 = _fp8_copies(run, fp8_dtype)
        if not copies8:
            run.rec(f"ours_{tag}_dense", "ours", kv=tag, error="skipped: no memory for an FP8 copy")
            continue
        ref8 = fp8_reference(run.copies[0], fp8_dtype, ref_backend, gqa)
        _sync(run.device)
        run.log(f"  {tag} cache: {len(copies8)} cop{'y' if len(copies8) == 1 else 'ies'}, reference "
                f"({time.perf_counter() - t0:.1f} s)")
        _time_ours_fp8(run, copies8, ref8, tag, fp8_cases)
        _time_fp8_baseline(run, fi, copies8, ref8, tag)
        del copies8, ref8
        if run.device == "cuda":
            torch.cuda.empty_cache()


def _annotate(recs: list[dict], method: str, n_copies: int, ours_snaps: list, mo_snaps: list) -> None:
    """What every record of the shape shares: the λ method, the copies, and the compiled Triton variants added
    while λ took new values (after the first λ case has compiled everything)."""
    for r in recs:
        r["lam_method"] = method
        r["copies"] = n_copies

    def added(snaps: list) -> int | None:
        return snaps[-1] - snaps[0] if len(snaps) >= 2 and None not in snaps else None

    note = {
        "lambdas_after_first": max(0, len(ours_snaps) - 1),
        "ours_variants_added": added(ours_snaps),
        "modelopt_variants_added": added(mo_snaps),
    }
    for r in recs:
        r.update(note)


def run_shape(shape: Shape, args, dtype, mo: ModelOptBaseline, deadline: float, log, flush=None,
              fi: FlashInferFP8 | None = None) -> list[dict]:
    """All measurements of one shape; `flush(records)` is called as they come, so a kill keeps them.

    In order: the input copies, the dense SDPA reference (and which SDPA backends run), our dense check, the λ
    search, then timings of SDPA, ours and ModelOpt at each λ case, then the FP8-cache rows (`fp8_applies`: ours
    and the FP8 dense baseline `fi`), until the `deadline` (later ones are recorded as skipped).
    """
    run = _ShapeRun(shape, args, dtype, deadline, log, flush)
    if not _make_copies(run):
        return run.recs
    sdpa_ok = _sdpa_reference(run)
    if run.ref is None:
        for r in run.recs:
            r["error"] = r["error"] or "no SDPA backend ran"
        return run.recs
    e_dense, dense_check = _ours_dense_check(run)
    cases, method = _lambda_cases(run)
    _time_sdpa(run, sdpa_ok)
    run.flush_records()
    ours_snaps = _time_ours(run, cases, e_dense, dense_check)
    run.flush_records()
    mo_snaps = _time_modelopt(run, mo, cases) if mo.available else []
    if getattr(args, "fp8_caches", None) and fp8_applies(shape, args):
        _time_fp8(run, fi or FlashInferFP8(reason="not loaded"), cases, sdpa_ok)
    _annotate(run.recs, method, run.n_copies, ours_snaps, mo_snaps)
    recs = run.recs
    run.copies.clear()
    run.ref = None
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return recs


# ----------------------------------------------------------------------------------------------------
# Summary
# ----------------------------------------------------------------------------------------------------
def _program_share(shape_label: str, lam) -> float | None:
    """Share of (program, key tile) pairs the shape's programs can skip at λ (None when not measured)."""
    share = PROGRAM_SHARES.get(shape_label)
    return None if share is None else share.share(lam)


def _bound(shape_label: str, lam, sparsity) -> float | None:
    """Ideal exp + P·V bound 2/(2 − s) with s the skippable program share (row sparsity if it was not measured)."""
    s = _program_share(shape_label, lam)
    s = sparsity if s is None else s
    return 2.0 / (2.0 - s) if s is not None else None


def summarize(records: list[dict]) -> list[dict]:
    """One row per (shape, cache, λ case): our time vs our dense on the same cache, SDPA dense, ModelOpt at the same
    λ; FP8-cache rows (case "e4m3 s50", ...) also vs ours on the model-dtype cache and the dense FP8 baseline."""
    rows = []
    shapes = list(dict.fromkeys(r["shape"] for r in records))
    for sh in shapes:
        rs = [r for r in records if r["shape"] == sh]
        by = {r["variant"]: r for r in rs}
        sdpa_rs = [r for r in rs if r["impl"] == "sdpa" and r.get("ms")]
        best = min(sdpa_rs, key=lambda r: r["ms"]) if sdpa_rs else None
        if not any(r["impl"] == "ours" for r in rs):  # the whole shape failed, was not reached or was cut short
            errs = "; ".join(dict.fromkeys(str(r.get("error") or "") for r in rs if r.get("error")))
            rows.append({"shape": sh, "dtype": rs[0].get("dtype"), "kv": rs[0].get("kv", rs[0].get("dtype")),
                         "case": "-", "lam": None, "sparsity": None,
                         "ours_ms": None, "ours_dense_ms": None, "sdpa_ms": best["ms"] if best else None,
                         "sdpa_backend": best["variant"] if best else None,
                         "modelopt_ms": None, "modelopt_sparsity": None, "speedup_vs_own_dense": None,
                         "speedup_vs_sdpa": None, "speedup_vs_modelopt": None, "bound": None, "check": "",
                         "error": errs or "incomplete (cut short)"})
            continue
        rows += [_summary_row(sh, r, by, best) for r in rs if r["impl"] == "ours"]
    return rows


def _summary_row(sh: str, r: dict, by: dict, best: dict | None) -> dict:
    """The summary row of one of our records; `by`: the shape's records by variant, `best`: its fastest SDPA."""
    kv = r.get("kv") or r["dtype"]
    fp8 = kv != r["dtype"]
    prefix = f"ours_{kv}_" if fp8 else "ours_"
    case = r["variant"].replace(prefix, "")
    own_dense = by.get(f"{prefix}dense", {}).get("ms")
    mo_r = {} if fp8 else by.get(r["variant"].replace("ours", "modelopt"), {})
    s, ms = r["sparsity"], r["ms"]
    row = {
        "shape": sh,
        "dtype": r["dtype"],
        "kv": kv,
        "case": f"{kv} {case}" if fp8 else case,
        "lam": r["lam"],
        "sparsity": s,
        "ours_ms": ms,
        "ours_dense_ms": own_dense,
        "sdpa_ms": best["ms"] if best else None,
        "sdpa_backend": best["variant"] if best else None,
        "modelopt_ms": mo_r.get("ms"),
        "modelopt_sparsity": mo_r.get("sparsity"),
        "speedup_vs_own_dense": own_dense / ms if ms and own_dense else None,
        "speedup_vs_sdpa": best["ms"] / ms if ms and best else None,
        "speedup_vs_modelopt": mo_r["ms"] / ms if ms and mo_r.get("ms") else None,
        "program_share": _program_share(sh, r["lam"]),
        "bound": _bound(sh, r["lam"], s),
        "check": r["check"],
        "error": r["error"] or mo_r.get("error", ""),
    }
    if fp8:  # vs ours on the model-dtype cache at the same case, and the dense baseline on the same FP8 cache
        model_ms = by.get(f"ours_{case}", {}).get("ms")
        base = by.get(f"flashinfer_{kv}_dense", {})
        row.update(model_cache_ms=model_ms, speedup_vs_model_cache=model_ms / ms if ms and model_ms else None,
                   fp8_base="flashinfer" if base.get("ms") else None, fp8_base_ms=base.get("ms"),
                   speedup_vs_fp8_base=base["ms"] / ms if ms and base.get("ms") else None,
                   fp8_base_note=_fp8_base_note(base))  # fmt: skip
    return row


def _fp8_base_note(base: dict) -> str:
    """What the FP8 rows say about their dense baseline: its check, or why there is none."""
    if not base:
        return "FP8 dense baseline: none (not run)"
    if base.get("error"):
        return f"FP8 dense baseline: none ({base['error']})"
    return f"FP8 dense baseline: FlashInfer ({base.get('check') or 'unchecked'})"


def _f(x, fmt: str) -> str:
    if x is None:
        width = "".join(c for c in fmt.split(".")[0] if c.isdigit())
        return "-".rjust(int(width or 0))
    return format(x, fmt)


def variant_lines(records: list[dict]) -> str:
    """Per shape: Triton variants compiled while λ changed (ours must add none; ModelOpt compiles λ in)."""
    lines = []
    for sh in dict.fromkeys(r["shape"] for r in records):
        r = next((x for x in records if x["shape"] == sh and "ours_variants_added" in x), None)
        if r is None or (r["ours_variants_added"] is None and r["modelopt_variants_added"] is None):
            continue
        lines.append(f"{sh}: compiled variants added over {r['lambdas_after_first']} new λ: "
                     f"ours {_f(r['ours_variants_added'], 'd')}, ModelOpt {_f(r['modelopt_variants_added'], 'd')}")
    return "\n".join(lines)


def format_table(rows: list[dict]) -> str:
    """The benchmark's table: FP8-cache rows ("e4m3 s50") after the model-dtype rows, with x auto (ours on the
    model-dtype cache at the same case / ours on FP8), FP8b ms and x FP8b (the dense baseline on that FP8 cache)."""
    head = (f"{'shape':<44} {'dt':<5} {'case':<10} {'λ':>9} {'s':>6} {'ours ms':>9} {'dense ms':>9} "
            f"{'SDPA ms':>9} {'MO ms':>9} {'MO s':>6} {'x own':>6} {'x SDPA':>6} {'x MO':>6} {'prog s':>6} "
            f"{'2/(2-s)':>7} {'x auto':>6} {'FP8b ms':>9} {'x FP8b':>6}  note")
    lines = [head, "-" * len(head)]
    for r in rows:
        note = "; ".join(x for x in (r["error"] or r["check"], r.get("fp8_base_note")) if x)
        lines.append(
            f"{r['shape']:<44} {r['dtype']:<5} {r['case']:<10} {_f(r['lam'], '9.2e')} {_f(r['sparsity'], '6.3f')} "
            f"{_f(r['ours_ms'], '9.3f')} {_f(r['ours_dense_ms'], '9.3f')} {_f(r['sdpa_ms'], '9.3f')} "
            f"{_f(r['modelopt_ms'], '9.3f')} {_f(r['modelopt_sparsity'], '6.3f')} "
            f"{_f(r['speedup_vs_own_dense'], '6.2f')} {_f(r['speedup_vs_sdpa'], '6.2f')} "
            f"{_f(r['speedup_vs_modelopt'], '6.2f')} {_f(r.get('program_share'), '6.3f')} "
            f"{_f(r['bound'], '7.2f')} {_f(r.get('speedup_vs_model_cache'), '6.2f')} "
            f"{_f(r.get('fp8_base_ms'), '9.3f')} {_f(r.get('speedup_vs_fp8_base'), '6.2f')}  {note}"
        )
    return "\n".join(lines)


def write_outputs(out: Path, meta: dict, records: list[dict], rows: list[dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "results.json.tmp"
    tmp.write_text(json.dumps({"meta": meta, "records": records, "summary": rows}, indent=1, default=str),
                   encoding="utf-8")
    tmp.replace(out / "results.json")
    for name, data in (("results.csv", records), ("summary.csv", rows)):
        if data:
            keys = list(dict.fromkeys(k for d in data for k in d))
            with open(out / name, "w", newline="", encoding="utf-8") as fh:
                w = csv.DictWriter(fh, fieldnames=keys)
                w.writeheader()
                w.writerows(data)
    (out / "table.txt").write_text(format_table(rows) + "\n" + variant_lines(records) + "\n", encoding="utf-8")


def environment(args, mo: ModelOptBaseline) -> dict:
    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": args.device,
        "dtype": args.dtype,
        "backend": args.backend,
        "modelopt": mo.describe(),
        "argv": sys.argv,
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception as exc:
        env["triton"] = f"unavailable ({type(exc).__name__})"
    if args.device == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
        env["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    else:
        env["threads"] = torch.get_num_threads()
    return env


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="a few small shapes only")
    p.add_argument("--out", default=None, help="folder for results.json/csv, summary.csv, table.txt")
    p.add_argument("--dtype", choices=tuple(DTYPES), default=None, help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--backend", choices=("triton", "torch", "auto"), default=None,
                   help="our backend (default: triton on cuda, torch on cpu)")
    p.add_argument("--phases", default="prefill,decode")
    p.add_argument("--prefill-lens", default=None, help="comma list of prefill lengths (B=1), e.g. 16384,131072")
    p.add_argument("--decode-shapes", default=None, help="comma list of batch:kv_len, e.g. 1:131072,64:16384")
    p.add_argument("--heads", type=int, default=None)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--head-dim", type=int, default=None)
    p.add_argument("--page-sizes", default=None, help="comma list; the first is used for all shapes")
    p.add_argument("--sparsities", default="0.5,0.7,0.9", help="target realized sparsities ('' for none)")
    p.add_argument("--modelopt", choices=("auto", "full", "kernel-only", "off"), default="auto")
    p.add_argument("--modelopt-wheels", default=None, help="folder holding nvidia_modelopt-*.whl (not installed)")
    p.add_argument("--modelopt-path", default=None, help="folder to put on sys.path to import modelopt")
    p.add_argument("--no-modelopt-measure", dest="modelopt_measure", action="store_false",
                   help="do not compile ModelOpt's sparsity-counting variant")
    p.add_argument("--time-budget", type=float, default=None, help="seconds; no new case starts after it")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--min-iters", type=int, default=None)
    p.add_argument("--max-iters", type=int, default=None)
    p.add_argument("--target-seconds", type=float, default=None, help="timed seconds per variant (sets iters)")
    p.add_argument("--max-copies", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--inputs", default=None, help="captured attention inputs (benchmarks/attention_inputs.py; "
                   "default: the capture in .cache/attention_inputs/)")
    p.add_argument("--synthetic", action="store_true", help="the synthetic structured inputs instead of a capture")
    _add_fp8_args(p)
    args = p.parse_args(argv)
    _check_fp8_args(p, args)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but torch.cuda.is_available() is False (use --device cpu)")
    args.dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    args.backend = args.backend or ("triton" if args.device == "cuda" else "torch")
    args.sparsities = _floats(args.sparsities)
    if args.device == "cuda":
        args.min_iters = args.min_iters or 5
        args.max_iters = args.max_iters or 100
        args.target_seconds = args.target_seconds or (0.3 if args.quick else 0.6)
    else:
        args.warmup = min(args.warmup, 1)
        args.min_iters = args.min_iters or 2
        args.max_iters = args.max_iters or 10
        args.target_seconds = args.target_seconds or (0.2 if args.quick else 1.0)
    return args


def _add_fp8_args(p: argparse.ArgumentParser) -> None:
    """The FP8-cache rows' options (issues #66, #68)."""
    p.add_argument("--kv-cache-dtype", default="auto,fp8",
                   help="comma list of KV caches (vLLM's names): auto (the model dtype, --dtype: always measured, the "
                        "FP8 rows reuse its λ), fp8 / fp8_e4m3 (e4m3), fp8_e5m2. FP8 bytes are the cache quantized "
                        "with saturation, scales 1.0. Default auto,fp8: e4m3 rows after each --fp8-phases shape's "
                        "model-dtype rows, on the first page size only")
    p.add_argument("--fp8-phases", default="decode",
                   help="phases whose shapes get FP8 rows (default decode). Why not prefill by default: the GPU "
                        "check gives the benchmark what its 540 s leave (2026-12-04 H200: 266 s, and its time budget "
                        "already cut the last case); FP8 decode rows cost ~1-2 s a shape plus ~10 s of FP8 kernel "
                        "compiles, FP8 prefill rows ~40-50 s more (128k alone ~12 s, compiles ~20 s) and would cut "
                        "the page-size-64 shapes at the end. 'prefill,decode' measures both")
    p.add_argument("--fp8-sparsities", default="0.5,0.7",
                   help="targets (of --sparsities) measured on the FP8 cache, at the λ found on the model-dtype cache "
                        "(a checkpoint calibrated on bf16 serves FP8 with the same law); ours dense always")
    p.add_argument("--fp8-baseline", choices=("auto", "flashinfer", "off"), default="auto",
                   help="dense baseline on the same FP8 cache: FlashInfer's paged decode / prefill (no vLLM needed). "
                        "auto: only when importable with prebuilt kernels (flashinfer-jit-cache); flashinfer: also "
                        "when it must JIT-build them (minutes); a row says why there is none")


def _check_fp8_args(p: argparse.ArgumentParser, args) -> None:
    names = [x.strip() for x in args.kv_cache_dtype.split(",") if x.strip()]
    bad = [n for n in names if n != "auto" and n not in FP8_CACHES]
    if bad:
        p.error(f"--kv-cache-dtype: unknown {bad} (auto, {', '.join(FP8_CACHES)})")
    formats = {FP8_CACHES[n] for n in names if n != "auto"}
    args.fp8_caches = [n for n in ("fp8", "fp8_e5m2") if FP8_CACHES[n] in formats]  # one name per format
    args.fp8_phases = [x.strip() for x in args.fp8_phases.split(",") if x.strip()]
    args.fp8_sparsities = _floats(args.fp8_sparsities)


def _load_inputs(args, meta: dict, log) -> bool:
    """Load the captured attention inputs (default) into `REAL_INPUTS`, or note synthetic ones (--synthetic);
    False, with the capture command printed, when there is no capture."""
    if args.synthetic:
        meta["inputs"] = "synthetic"
        log("inputs: synthetic (sink, salience, recency, noise)")
        return True
    attention_inputs = _sibling("attention_inputs")
    path = args.inputs or attention_inputs.default_inputs_path()
    if path is None or not Path(path).is_file():
        print(attention_inputs.missing_message(path=args.inputs), file=sys.stderr)
        return False
    global REAL_INPUTS
    REAL_INPUTS = attention_inputs.load_inputs(path)
    m = REAL_INPUTS.meta
    meta["inputs"] = {k: v for k, v in m.items()}
    log(f"inputs: {path} ({m['source']}, layer {m['layer']}, {m['tokens']} tokens, {m['heads']}/{m['kv_heads']} "
        f"heads, D={m['head_dim']}), tiled to each shape")
    return True


def _run_shapes(shapes: list[Shape], args, dtype, baselines: tuple, deadline: float, meta: dict, out, log):
    """(records, exit status) of every shape in turn, writing the outputs after each (and as records come); a
    shape that raises, or a MISMATCH / ERROR check, makes the status 1; past the deadline shapes are skipped.
    `baselines`: (ModelOptBaseline, FlashInferFP8)."""
    mo, fi = baselines
    records: list[dict] = []
    status = 0
    for n, shape in enumerate(shapes):
        if time.perf_counter() > deadline:
            records.append({"shape": shape.label, **asdict(shape), "dtype": args.dtype, "variant": "all",
                            "impl": "-", "error": "skipped: time budget"})
            log(f"[{n + 1}/{len(shapes)}] {shape.label}: skipped (time budget)")
            continue
        log(f"[{n + 1}/{len(shapes)}] {shape.label}")
        t0 = time.perf_counter()
        try:
            def flush(partial: list[dict], done: list[dict] = records) -> None:
                if out:
                    write_outputs(out, meta, done + partial, summarize(done + partial))

            recs = run_shape(shape, args, dtype, mo, deadline, log, flush, fi=fi)
        except Exception as exc:
            status = 1
            recs = [{"shape": shape.label, **asdict(shape), "dtype": args.dtype, "variant": "all", "impl": "-",
                     "error": f"{type(exc).__name__}: {str(exc)[:300]}"}]
            log(traceback.format_exc())
            if args.device == "cuda":
                torch.cuda.empty_cache()
        records += recs
        for r in recs:
            if str(r.get("check", "")).startswith(("MISMATCH", "ERROR")):
                status = 1
        log(f"  done in {time.perf_counter() - t0:.1f} s")
        if out:
            write_outputs(out, meta, records, summarize(records))
    return records, status


def main(argv=None) -> int:
    args = parse_args(argv)
    with contextlib.suppress(Exception):  # never die on a non-UTF-8 console (λ, ·)
        sys.stdout.reconfigure(encoding="utf-8", errors="replace")
    t_start = time.perf_counter()
    deadline = t_start + args.time_budget if args.time_budget else math.inf
    out = Path(args.out) if args.out else None
    dtype = DTYPES[args.dtype]
    torch.manual_seed(args.seed)

    def log(msg: str) -> None:
        print(msg, flush=True)

    mo = load_modelopt(args.modelopt, args.modelopt_wheels, args.modelopt_path, args.device)
    fi = load_flashinfer(args.fp8_baseline, args.device) if args.fp8_caches else FlashInferFP8(reason="no FP8 rows")
    meta = environment(args, mo)
    meta["kv_cache_dtypes"] = ["auto", *args.fp8_caches]
    meta["fp8_baseline"] = fi.describe()
    log(f"bench_kernels: {meta.get('gpu', 'cpu')} torch {meta['torch']} triton {meta['triton']} "
        f"dtype {args.dtype} ours backend={args.backend}")
    log(mo.describe())
    if args.fp8_caches:
        log(f"FP8 caches: {', '.join(args.fp8_caches)} on {'/'.join(args.fp8_phases)} shapes (page "
            f"{first_page_size(args)}), targets {args.fp8_sparsities}; {fi.describe()}")
    if args.device == "cuda" and mo.available:
        log("  (ModelOpt: one scalar λ per launch, compiled in as a constant; decode uses the same kernel, "
            "no split-K with skipping)")
    if not _load_inputs(args, meta, log):
        return 2
    shapes = build_shapes(args)
    log(f"shapes: {len(shapes)}; targets: {args.sparsities}; budget: {args.time_budget or 'none'} s")
    records, status = _run_shapes(shapes, args, dtype, (mo, fi), deadline, meta, out, log)
    rows = summarize(records)
    meta["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    table = format_table(rows)
    log("")
    log(table)
    log(variant_lines(records))
    log("")
    log("x own: vs our dense (λ=None); x SDPA: vs the fastest dense SDPA backend; x MO: vs ModelOpt 0.47 at the "
        "same λ; 2/(2-s): ideal bound for skipping exp + P·V with s the share of (program, key tile) pairs the "
        "programs can skip (prefill: blocks of 64 rows, 128 for D > 64, of one head; decode: a GQA group), "
        "measured on the inputs (benchmarks/coherence.py), not the realized row-tile sparsity. FP8 rows (case "
        "'e4m3 ...': the cache quantized with saturation, scales 1.0, the model-dtype cache's λ): x own vs our dense "
        "on the same FP8 cache; x auto: ours on the model-dtype cache at the same case / ours on FP8; FP8b: the dense "
        "baseline on the same FP8 cache (FlashInfer), x FP8b its time / ours.")
    if out:
        write_outputs(out, meta, records, rows)
        log(f"results: {out / 'results.json'}")
    return status


if __name__ == "__main__":
    sys.exit(main())
