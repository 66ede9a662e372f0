"""Zero-copy `[num_blocks, page, Hkv, D]` K/V views of vLLM's paged KV caches, and the K/V cache write.

vLLM has changed the cache tensor an attention impl receives several times (see DESIGN.md §4). Every sparse path
(serving, calibration and the cache write) reads and writes the cache through these views, so one helper per
backend decides the layout. The views never copy: they are `as_strided`/slice views of the cache's storage.
This module needs only torch, so it is importable (and testable) without vLLM.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

FLASHINFER_LAYOUTS = (
    "legacy 5D [num_blocks, 2, page, Hkv, D] (vLLM <= 0.25; NHD, or HND through strides)",
    "packed 4D [num_blocks, Hkv, page, 2*D] logical view (vLLM >= 0.26; any KVCacheLayout physical order)",
)
FLASH_ATTN_LAYOUTS = (
    "kv-first 5D [2, num_blocks, page, Hkv, D] (vLLM <= 0.22)",
    "blocks-first 5D [num_blocks, 2, page, Hkv, D] (vLLM 0.23 - 0.25)",
    "packed 4D [num_blocks, Hkv, page, 2*D] (vLLM >= 0.26)",
)
CPU_ATTN_LAYOUTS = ("CPU_ATTN [num_blocks, Hkv, page, 2*D]: per block and head K as [D, page] then V as [page, D]",)
CPU_KNOWN_ISAS = ("vec", "vec16")
"""CPU-attention ISAs whose cache layout the views read (measured: K transposed, V row-major)."""
CPU_ISA_FOR_SPARSE = {"amx": "vec"}
"""CPU-attention ISAs the sparse builder replaces for its layers, with the readable ISA it uses instead.

vLLM picks `amx` for bf16 on CPUs with AMX tiles when the page size is a multiple of 32 (`_get_attn_isa`); its
cache stores K and V in VNNI pairs that no `[blocks, page, Hkv, D]` view can express (../shared/reference/
cpu_amx_layout.md). `vec` runs on every x86 CPU under the same page-size rule, so the sparse builder sets `vec` on
its group (`layer.isa`): vLLM's own cache writer, scheduler metadata and dense forward then all use `vec`'s layout,
which the kernels read in place. Layers outside a sparse group keep vLLM's choice."""
CPU_ISA_COST = {
    "amx": "; vLLM's own amx attention is faster than the sparse kernel on this CPU even with AMX tiles in bf16 "
    "prefill (measured on a 2-core Xeon: sparse serving at target 0.5 took 1.45-1.5x the time of dense in bf16, "
    "parity in fp32; docs/benchmarks.md), so serve dense (MODELOPT_EXT_SPARSE_ATTN=0) where bf16 speed matters",
}
"""What serving sparse on a replaced ISA costs, as measured, appended to the start-up line that says it."""


def cpu_isa_problem(isa: str | None) -> str | None:
    """Why the sparse kernels cannot serve a CPU-attention layer on this ISA (None when they can, or unknown)."""
    if isa is None or isa in CPU_KNOWN_ISAS or isa in CPU_ISA_FOR_SPARSE:
        return None
    return (f"CPU attention ISA {isa!r}: the kernels do not read its KV-cache layout (they read {CPU_KNOWN_ISAS}, "
            f"and serve {tuple(CPU_ISA_FOR_SPARSE)} layers on 'vec'); serve on an x86 CPU")


def _layout_error(kind: str, kv_cache: torch.Tensor, head_size: int, layouts, extra: str = "") -> ValueError:
    listed = "; ".join(layouts)
    return ValueError(
        f"unsupported {kind} KV cache: shape {tuple(kv_cache.shape)}, strides {tuple(kv_cache.stride())}, "
        f"head_size {head_size}{extra}. Supported layouts: {listed}"
    )


def _packed_views(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, H, N, 2D] logical view (any physical order) -> K, V [B, N, H, D] views, as vLLM splits it."""
    k_and_v = kv_cache.transpose(1, 2)
    return k_and_v[..., :head_size], k_and_v[..., head_size:]


def _flashinfer_kv_cache_views(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V `[num_blocks, page, Hkv, D]` views of a FlashInfer KV cache, zero-copy.

    Accepts the legacy 5D cache `[B, 2, N, H, D]` (HND is the same logical shape with permuted strides) and the
    packed 4D logical cache `[B, H, N, 2D]` whatever its physical order (LBNHC, LBHNC, BLNHC, ...): the logical
    view's strides carry the order, so slicing it is always right. Anything else raises ValueError.
    """
    if not isinstance(kv_cache, torch.Tensor):
        raise TypeError(f"kv_cache must be a tensor, got {type(kv_cache).__name__}")
    if kv_cache.dim() == 5 and kv_cache.shape[1] == 2 and kv_cache.shape[4] == head_size:
        return kv_cache[:, 0], kv_cache[:, 1]
    if kv_cache.dim() == 4 and kv_cache.shape[3] == 2 * head_size:
        return _packed_views(kv_cache, head_size)
    raise _layout_error("FlashInfer", kv_cache, head_size, FLASHINFER_LAYOUTS)


def _flash_attn_kv_cache_views(
    kv_cache: torch.Tensor, head_size: int, kv_first: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V `[num_blocks, page, Hkv, D]` views of a FlashAttention KV cache, zero-copy.

    5D caches put the K/V axis first (vLLM <= 0.22) or second (0.23 - 0.25). `kv_first` says which (install
    detects it from the backend's `get_kv_cache_shape` where that exists); None infers it from the shape when that
    is unambiguous and raises when it is not (num_blocks == 2).
    """
    if kv_cache.dim() == 4 and kv_cache.shape[3] == 2 * head_size:
        return _packed_views(kv_cache, head_size)
    if kv_cache.dim() == 5 and kv_cache.shape[4] == head_size:
        first, second = kv_cache.shape[0] == 2, kv_cache.shape[1] == 2
        if kv_first is None:
            if first and second:
                raise _layout_error(
                    "FlashAttention",
                    kv_cache,
                    head_size,
                    FLASH_ATTN_LAYOUTS,
                    " (ambiguous: pass kv_first= from the backend's get_kv_cache_shape)",
                )
            kv_first = first
        if kv_first and first:
            return kv_cache[0], kv_cache[1]
        if not kv_first and second:
            return kv_cache[:, 0], kv_cache[:, 1]
    raise _layout_error("FlashAttention", kv_cache, head_size, FLASH_ATTN_LAYOUTS)


def _cpu_attn_kv_cache_views(kv_cache: torch.Tensor, head_size: int, isa: str) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V `[num_blocks, page, Hkv, D]` views of vLLM's CPU-attention cache, zero-copy.

    The cache is `[B, H, N, 2D]` but CPU_ATTN views it as `[B, H, 2N, D]`: per block and head a K region then a
    V region. `cpu_attn_reshape_and_cache` (ISAs vec/vec16) stores K transposed, element (t, d) at d*N + t, and
    V as [N, D] rows (measured, DESIGN.md §4). So the K view has last-dim stride N. Decided by backend and ISA,
    never by shape: the shape equals the packed FlashInfer/FlashAttention one.
    """
    if isa not in CPU_KNOWN_ISAS:
        raise ValueError(
            f"CPU attention ISA {isa!r}: no [blocks, page, Hkv, D] view reads its KV-cache layout (views exist for "
            f"{CPU_KNOWN_ISAS}; the sparse CPU builder serves {tuple(CPU_ISA_FOR_SPARSE)} groups on 'vec')"
        )
    if kv_cache.dim() != 4 or kv_cache.shape[3] != 2 * head_size:
        raise _layout_error("CPU_ATTN", kv_cache, head_size, CPU_ATTN_LAYOUTS)
    num_blocks, heads, page, _ = kv_cache.shape
    s_block, s_head, s_tok, s_dim = kv_cache.stride()
    # vLLM reinterprets each block-head region with .view(), so it must be contiguous inside.
    if s_dim != 1 or s_tok != 2 * head_size or (heads > 1 and s_head != page * 2 * head_size):
        raise _layout_error(
            "CPU_ATTN", kv_cache, head_size, CPU_ATTN_LAYOUTS, " (each block-head region must be contiguous)"
        )
    s_head = page * 2 * head_size if heads == 1 else s_head
    base = kv_cache.storage_offset()
    size = (num_blocks, page, heads, head_size)
    k = torch.as_strided(kv_cache, size, (s_block, 1, s_head, page), base)
    v = torch.as_strided(kv_cache, size, (s_block, head_size, s_head, 1), base + page * head_size)
    return k, v


def native_flash_cache_write_op():
    """vLLM's `reshape_and_cache_flash` custom op when this process has it (CUDA builds), else None."""
    ns = getattr(torch.ops, "_C_cache_ops", None)
    try:
        return getattr(ns, "reshape_and_cache_flash", None) if ns is not None else None
    except (AttributeError, RuntimeError):
        return None


def write_kv_through_views(
    key: torch.Tensor,
    value: torch.Tensor,
    k_view: torch.Tensor,
    v_view: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Torch equivalent of `reshape_and_cache_flash` on `[B, N, H, D]` views (no FP8 scaling).

    Writes token i's K/V rows at slot `slot_mapping[i]` (block = slot // N, offset = slot % N); slots < 0 are
    padding and skipped, and keys past `len(slot_mapping)` (CUDA-graph padding) are ignored, like vLLM's op.
    The padding mask makes this a host sync on CUDA; CUDA builds normally use the custom op instead.
    """
    n = slot_mapping.shape[0]
    if n == 0:
        return
    page = k_view.shape[1]
    slots = slot_mapping.to(torch.int64)
    valid = slots >= 0
    rows = torch.nonzero(valid).squeeze(1)
    slots = slots[rows]
    blocks, offsets = slots // page, slots % page
    k_view[blocks, offsets] = key[:n][rows].to(k_view.dtype)
    v_view[blocks, offsets] = value[:n][rows].to(v_view.dtype)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_view: torch.Tensor,
    v_view: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> None:
    """One K/V cache write through the views: vLLM's custom op when present, else the torch equivalent."""
    op = native_flash_cache_write_op()
    if op is not None:
        op(key, value, k_view, v_view, slot_mapping, kv_cache_dtype, k_scale, v_scale)
        return
    write_kv_through_views(key, value, k_view, v_view, slot_mapping)

