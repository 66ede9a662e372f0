"""Which page sizes (vLLM kernel block sizes) the skip-softmax kernels cover, asked by the builders and the checks.

The Triton kernel reads pages of a power-of-two size >= its `MIN_PAGE_SIZE`; the other kernel backends read any
page size. Three places need this fact: the sparse backends restrict the kernel block sizes they offer vLLM to the
covered ones (so vLLM's block-size selection plans a covered page size), the builders and install-time checks
refuse an uncovered one, and the CUDA-graph self-test (plugins/vllm/cudagraphs.py) runs at a covered page size.
It lives here, below all three, so that none of them imports another for it.
"""

from __future__ import annotations

import torch

from .compat import native_kernel_block_sizes

TRITON_PAGE_SIZES = (16, 32, 64, 128, 256, 512, 1024)
"""Kernel block sizes the Triton skip-softmax kernel covers (powers of two >= its MIN_PAGE_SIZE)."""


def kernel_page_problem(kernel_backend: str, page_size: int, head_size: int, dtype) -> str | None:
    """Why the chosen kernel backend cannot run this page size / head size / dtype (None when it can)."""
    if kernel_backend != "triton":
        return None
    from modelopt_ext.torch.kernels.sparsity.attention.triton_kernel import unsupported_reason

    q = torch.empty(0, 1, head_size, dtype=dtype, device="meta")
    k = torch.empty(0, page_size, 1, head_size, dtype=dtype, device="meta")
    return unsupported_reason(q, k)


def covered_kernel_block_sizes(native_backend, kv_cache_spec=None) -> list:
    """The native backend's kernel block sizes restricted to what the Triton kernel covers (where CUDA runs it)."""
    native = native_kernel_block_sizes(native_backend, kv_cache_spec)
    if not torch.cuda.is_available():
        return native
    covered = []
    for size in native:
        if isinstance(size, int):
            covered += [size] if size in TRITON_PAGE_SIZES else []
        else:  # vLLM's MultipleOf(n)
            base = int(getattr(size, "base", 1))
            covered += [p for p in TRITON_PAGE_SIZES if p % base == 0]
    return sorted(set(covered)) or native  # nothing covered: the builder refuses at start-up with the reason
