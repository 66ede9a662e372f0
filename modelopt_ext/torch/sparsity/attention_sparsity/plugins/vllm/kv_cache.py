"""Zero-copy `[num_blocks, page, Hkv, D]` K/V views of vLLM's paged KV caches, and the K/V cache write.

vLLM's CPU `amx` layout has no such view; it gets the 6-D split views of `semantics.cache_geometry`, which every
kernel path and the writer here read as the same logical `[num_blocks, page, Hkv, D]`.

vLLM has changed the cache tensor an attention impl receives several times (docs/vllm_releases.md §2, §7). Every
sparse path (serving, calibration and the cache write) reads and writes the cache through these views, so one helper
per backend decides the layout. The views never copy: they are `as_strided`/slice views of the cache's storage.
This module needs only torch (and the kernels' semantics), so it is importable (and testable) without vLLM.
"""

from __future__ import annotations

import logging

import torch

from modelopt_ext.torch.kernels.sparsity.attention.semantics import is_fp8_cache

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
CPU_ATTN_LAYOUTS = (
    "CPU_ATTN [num_blocks, Hkv, page, 2*D]: per block and head a K region then a V region; ISAs vec/vec16: K as "
    "[D, page], V as [page, D]; ISA amx (bf16): K as [page/16, D/2, 16, 2], V as [D/16, page/2, 16, 2]",
)
CPU_KNOWN_ISAS = ("vec", "vec16", "amx")
"""CPU-attention ISAs whose cache layout the views read (measured, docs/cpu_amx_layout.md): vec and
vec16 store K transposed and V row-major; amx (bf16 on CPUs with AMX tiles, page % 32 == 0) stores both as AMX
B tiles (VNNI pairs), read through 6-D views. Every layer keeps the ISA vLLM chose, so vLLM's own cache writer,
scheduler metadata and dense forward (dense steps, layers kept dense) are untouched."""


FP8_VIEW_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
"""The torch dtype of each FP8 cache dtype vLLM offers and the kernels read (vLLM's `fp8` is e4m3 on NVIDIA GPUs and
on the CPU). vLLM allocates FP8 caches as uint8 storage and views them as this dtype where it reads them."""


def fp8_view_dtype(kv_cache_dtype: str | None) -> torch.dtype | None:
    """The FP8 dtype of a vLLM cache dtype string (None: the cache holds the model's own values)."""
    return FP8_VIEW_DTYPES.get(kv_cache_dtype) if isinstance(kv_cache_dtype, str) else None


def as_cache_dtype(views: tuple[torch.Tensor, torch.Tensor], kv_cache_dtype: str | None):
    """K/V views as the kernels read them: an FP8 cache's byte views reinterpreted as its FP8 dtype (zero-copy)."""
    fp8 = fp8_view_dtype(kv_cache_dtype)
    if fp8 is None or views[0].dtype == fp8:
        return views
    if views[0].element_size() != 1:
        raise ValueError(f"an {kv_cache_dtype!r} KV cache must be a 1-byte tensor, got {views[0].dtype}")
    return views[0].view(fp8), views[1].view(fp8)


def cpu_isa_problem(isa: str | None, kv_cache_dtype: str | None = None) -> str | None:
    """Why the sparse kernels cannot serve a CPU-attention layer on this ISA and cache dtype (None when they can, or
    unknown). FP8 caches are read on `vec` only (measured: vLLM stores e4m3 / e5m2 bytes there in the `vec` layout,
    K transposed); vLLM's FP8 path on `amx` (bf16 models on AMX CPUs) has a layout of its own, not read."""
    if fp8_view_dtype(kv_cache_dtype) is not None and isa == "amx":
        return (f"an FP8 KV cache ({kv_cache_dtype!r}) on CPU attention ISA 'amx': the kernels do not read that layout "
                "(they read FP8 caches on 'vec'); serve a float32 model, or --kv-cache-dtype auto")
    if isa is None or isa in CPU_KNOWN_ISAS:
        return None
    return (f"CPU attention ISA {isa!r}: the kernels do not read its KV-cache layout (they read {CPU_KNOWN_ISAS}); "
            "serve on an x86 CPU")


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


def flashinfer_kv_cache_views(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
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


_flashinfer_kv_cache_views = flashinfer_kv_cache_views
"""The published name of `flashinfer_kv_cache_views`: outside checks import it (from here and from the package)."""


def flash_attn_kv_cache_views(
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


def cpu_attn_kv_cache_views(kv_cache: torch.Tensor, head_size: int, isa: str) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V `[num_blocks, page, Hkv, D]` views of vLLM's CPU-attention cache, zero-copy.

    The cache is `[B, H, N, 2D]` but CPU_ATTN views it as `[B, H, 2N, D]`: per block and head a K region then a
    V region. `cpu_attn_reshape_and_cache` (ISAs vec/vec16) stores K transposed, element (t, d) at d*N + t, and
    V as [N, D] rows (measured, docs/vllm_releases.md §7). So the K view has last-dim stride N. Decided by backend and
    ISA, never by shape: the shape equals the packed FlashInfer/FlashAttention one.
    """
    if isa not in CPU_KNOWN_ISAS:
        raise ValueError(f"CPU attention ISA {isa!r}: no view reads its KV-cache layout (views exist for "
                         f"{CPU_KNOWN_ISAS})")
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
    if isa == "amx":
        return _cpu_amx_views(kv_cache, head_size, s_block, s_head)
    size = (num_blocks, page, heads, head_size)
    k = torch.as_strided(kv_cache, size, (s_block, 1, s_head, page), base)
    v = torch.as_strided(kv_cache, size, (s_block, head_size, s_head, 1), base + page * head_size)
    return k, v


def _cpu_amx_views(kv_cache: torch.Tensor, head_size: int, s_block: int, s_head: int):
    """The 6-D split views (`semantics.cache_geometry`) of the `amx` layout: K [B, N/16, 16, H, D/2, 2] with (b, t, h,
    d) at K(b, h) + (t//16)·16·D + (d//2)·32 + (t%16)·2 + d%2, V [B, N/2, 2, H, D/16, 16] at V(b, h) +
    (d//16)·16·N + (t//2)·32 + (d%16)·2 + t%2 (docs/cpu_amx_layout.md §3)."""
    num_blocks, heads, page, _ = kv_cache.shape
    d = head_size
    if kv_cache.dtype != torch.bfloat16 or page % 32 or d % 16:
        raise _layout_error("CPU_ATTN", kv_cache, head_size, CPU_ATTN_LAYOUTS,
                            f" (ISA amx: bf16, page % 32 == 0 and head size % 16 == 0; got {kv_cache.dtype})")
    base = kv_cache.storage_offset()
    k = torch.as_strided(kv_cache, (num_blocks, page // 16, 16, heads, d // 2, 2),
                         (s_block, 16 * d, 2, s_head, 32, 1), base)
    v = torch.as_strided(kv_cache, (num_blocks, page // 2, 2, heads, d // 16, 16),
                         (s_block, 32, 1, s_head, 16 * page, 2), base + page * d)
    return k, v


def native_flash_cache_write_op():
    """vLLM's `reshape_and_cache_flash` custom op when this process has it (CUDA builds), else None."""
    ns = getattr(torch.ops, "_C_cache_ops", None)
    try:
        return getattr(ns, "reshape_and_cache_flash", None) if ns is not None else None
    except (AttributeError, RuntimeError):
        return None


def _stored(src: torch.Tensor, view: torch.Tensor, scale: float) -> torch.Tensor:
    """Rows as the cache stores them: the model's values, or for an FP8 view `src / scale` rounded to nearest and
    saturated to the format's finite range (vLLM's quantizing write)."""
    if not is_fp8_cache(view):
        return src.to(view.dtype)
    limit = torch.finfo(view.dtype).max
    return (src.to(torch.float32) / scale).clamp_(-limit, limit).to(view.dtype)


def write_kv_through_views(
    key: torch.Tensor,
    value: torch.Tensor,
    k_view: torch.Tensor,
    v_view: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Torch equivalent of `reshape_and_cache_flash` on `[B, N, H, D]` views (FP8 views: quantized with the scales),
    and of vLLM's CPU cache write on the 6-D split views of the `amx` layout.

    Writes token i's K/V rows at slot `slot_mapping[i]` (block = slot // N, offset = slot % N); slots < 0 are
    padding and skipped, and keys past `len(slot_mapping)` (CUDA-graph padding) are ignored, like vLLM's op.
    The padding mask makes this a host sync on CUDA; CUDA builds normally use the custom op instead.
    """
    n = slot_mapping.shape[0]
    if n == 0:
        return
    slots = slot_mapping.to(torch.int64)
    valid = slots >= 0
    rows = torch.nonzero(valid).squeeze(1)
    slots = slots[rows]
    for view, src, scale in ((k_view, key, k_scale), (v_view, value, v_scale)):
        rows_src = _stored(src[:n][rows], view, scale)
        if view.dim() == 6:  # [B, N/p2, p2, H, D/d2, d2]
            p2, heads, d1, d2 = view.shape[2], view.shape[3], view.shape[4], view.shape[5]
            page = view.shape[1] * p2
            blocks, offsets = slots // page, slots % page
            view[blocks, offsets // p2, offsets % p2] = rows_src.reshape(-1, heads, d1, d2)
        else:
            page = view.shape[1]
            view[slots // page, slots % page] = rows_src


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
    k_view, v_view = as_cache_dtype((k_view, v_view), kv_cache_dtype)
    write_kv_through_views(key, value, k_view, v_view, slot_mapping, _host_scale(k_scale), _host_scale(v_scale))


def _host_scale(scale) -> float:
    """A cache scale as a host float (vLLM's layers hold a 1-element tensor; None: 1.0)."""
    return 1.0 if scale is None else float(scale)

