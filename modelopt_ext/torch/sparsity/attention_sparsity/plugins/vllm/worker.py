"""Worker side of the vLLM plugin: install after the model loads, the RPCs, the periodic sparsity log.

- `SparseAttnWorkerExtension` carries the RPCs (`LLM.collective_rpc("sparse_attn_...")`). It reaches vLLM's worker
  through vLLM's own `worker_extension_cls` (`ParallelConfig`), set by the example scripts and, for a checkpoint
  that carries `sparse_attention_config`, by the general plugin (plugins/vllm/entry.py); `worker_extension_cls()`
  composes it with an extension class the user passes. A worker that has the extension is prepared for calibration:
  every layer gets the sparse backend even when the checkpoint has no block (its layers then run dense).
- `install_for_serving` is what the general plugin's wrap of `Worker.load_model` runs right after the weights load,
  before vLLM allocates the KV cache (vLLM has no post-load hook for workers: docs/design.md, process-wide patches).
"""

from __future__ import annotations

import binascii
import importlib
import logging

from ...checkpoint.calibration_records import encode_record
from ...checkpoint.config_io import SparseAttentionSettings, parse_sparse_attention_config
from .checks import checkpoint_settings
from .env import DEFAULT_LOG_EVERY, kernel_backend_choice, log_every, sparse_attention_enabled
from .install import DENSE_REASONS_ATTR, install_sparse_attention
from .layers import attention_layers
from .metrics import exporting, write_worker_totals
from .stats import (
    collect_calibration_records,
    get_request_stats,
    get_sparsity_stats,
    is_sparse_layer,
    reset_sparsity_stats,
)

logger = logging.getLogger(__name__)

_COMPOSED_PREFIX = "SparseAttnWorkerExtensionWith_"


def worker_model(worker):
    """The nn.Module a vLLM worker runs (GPU and CPU runners, model runner V1 and V2)."""
    runner = worker.model_runner
    get_model = getattr(runner, "get_model", None)
    return get_model() if callable(get_model) else runner.model


def summarize_stats(stats: dict) -> dict:
    """Sum per-layer (visited, skipped) tile counts into per-phase totals and realized sparsity."""
    totals = {}
    for phase in ("prefill", "decode"):
        visited = sum(layer[phase]["visited"] for layer in stats.values())
        skipped = sum(layer[phase]["skipped"] for layer in stats.values())
        totals[phase] = {
            "visited": visited,
            "skipped": skipped,
            "sparsity": (skipped / visited) if visited else None,
        }
    return totals


def export_worker_metrics(model, totals: dict) -> None:
    """This worker's file for /metrics (plugins/vllm/metrics.py): its per-phase totals and its layers."""
    if exporting():
        write_worker_totals(totals, layers=served_layers(model))


def served_layers(model) -> dict[str, str]:
    """{attention layer name: "" when it runs sparse, else the first reason it is kept dense} (for /metrics)."""
    out = {}
    for name, layer in attention_layers(model):
        reasons = list(getattr(layer, DENSE_REASONS_ATTR, ()))
        out[name] = "" if is_sparse_layer(layer) else (reasons[0] if reasons else "no sparse impl")
    return out


def install_for_serving(worker, settings: SparseAttentionSettings | None = None, *, prepare_dense: bool = False):
    """Install serve-mode sparse attention from `settings` or the checkpoint; None when there is nothing to do.

    `prepare_dense`: also install when the checkpoint carries no config (every layer then runs its native forward
    on the sparse backend, so a later calibration or serve RPC on this engine can switch it on).
    """
    if settings is None:
        settings = checkpoint_settings(worker)
    if settings is None and not prepare_dense:
        logger.info("checkpoint has no sparse_attention_config: serving dense attention")
        return None
    report = install_sparse_attention(
        worker_model(worker),
        settings,
        mode="serve",
        backend=kernel_backend_choice(),
        vllm_config=worker.vllm_config,
        model_runner=getattr(worker, "model_runner", None),
    )
    if settings is None:
        logger.info("checkpoint has no sparse_attention_config: serving dense attention (%d layer(s) prepared for "
                    "calibration)", len(report.sparse))
        return report
    if exporting():  # /metrics shows the layers from the start, not only after the first counter read
        model = worker_model(worker)
        export_worker_metrics(model, summarize_stats(get_sparsity_stats(model)))
    backends = sorted(set(report.native_impls.values()))
    logger.info(
        "sparse attention serving on %d layer(s) (native impls: %s; %d kept dense); prefill %s, decode %s; "
        "prompt lengths: %s",
        len(report.sparse),
        ", ".join(backends) or "-",
        len(report.disabled) + len(report.kept_dense),
        _describe_phase(settings.prefill),
        _describe_phase(settings.decode),
        report.prompt_lens,
    )
    return report


def _describe_phase(calib) -> str:
    if calib is None:
        return "dense"
    return f"target {calib.target_sparsity:.2f} (scale factor {calib.scale_factor:.4g})"


class SparseAttnWorkerExtension:
    """The plugin's worker RPCs, added to vLLM's worker class through `worker_extension_cls`.

    Every attribute here must be new to vLLM's worker classes (vLLM asserts it); arguments and results are plain
    data, so they cross every RPC transport (in-process, multiprocess pickles, msgpack, Ray, HTTP JSON).
    """

    # ---- RPCs (LLM.collective_rpc("<name>", args=...)); arguments and results are plain data ----

    def sparse_attn_enable_calibration(self, scale_factors, backend: str | None = None, laws=None) -> dict:
        """Switch every attention layer to calibration mode (dense output, counts per scale-factor trial, or with
        `laws` = [(c_prefill, c_decode, γ_prefill, γ_decode), ...] and `scale_factors` None, per served law).

        Takes and returns plain data (it crosses vLLM's RPC transports): the layer count and the native impls.
        """
        trials = None if scale_factors is None else [float(s) for s in scale_factors]
        settings = checkpoint_settings(self)
        report = install_sparse_attention(
            worker_model(self),
            settings,
            mode="calibrate",
            backend=backend or kernel_backend_choice(),
            calibration_scale_factors=trials,
            calibration_laws=None if laws is None else [list(law) for law in laws],
            vllm_config=self.vllm_config,
        )
        collect_calibration_records(worker_model(self), reset=True)
        return {"layers": len(report.native_impls), "native_impls": sorted(set(report.native_impls.values()))}

    def sparse_attn_collect_counts(self, reset: bool = True) -> list[dict]:
        """This rank's calibration records, one per layer, in their wire form: plain Python lists and numbers
        (`encode_record`), so they cross every vLLM process boundary (msgpack, pickle, Ray, JSON) unchanged;
        `merge_calibration_records` decodes them (checkpoint/calibration_records.py)."""
        return [encode_record(r) for r in collect_calibration_records(worker_model(self), reset=reset)]

    def sparse_attn_serve(self, config_block: dict | None = None) -> dict:
        """(Re)install serve mode from a `sparse_attention_config` block, or from the checkpoint when None."""
        settings = parse_sparse_attention_config(config_block) if config_block is not None else None
        report = install_for_serving(self, settings)
        return {"layers": 0 if report is None else len(report.native_impls)}

    def sparse_attn_status(self) -> dict:
        """Which layers run sparse, on which native backend, in which mode, and the realized sparsity per phase."""
        model = worker_model(self)
        layers = {}
        kept_dense: dict[str, int] = {}
        for name, layer in attention_layers(model):
            reasons = list(getattr(layer, DENSE_REASONS_ATTR, ()))
            layers[name] = {"impl": type(layer.impl).__name__, "sparse": is_sparse_layer(layer),
                            "dense_reasons": reasons}  # fmt: skip
            for reason in reasons:
                kept_dense[reason] = kept_dense.get(reason, 0) + 1
        stats = get_sparsity_stats(model)
        return {
            "enabled": sparse_attention_enabled(),
            "layers": layers,
            "sparse_layers": sum(1 for v in layers.values() if v["sparse"]),
            "kept_dense": kept_dense,  # reason -> number of layers it keeps dense
            "realized": summarize_stats(stats),
        }

    def sparse_attn_request_stats(self, request_ids=None) -> dict:
        """Realized sparsity per request (running, and the last finished ones), per phase, on this rank:
        {engine request id: {"user_request_id", "finished", "prefill", "decode"}}; `request_ids` filters by the
        engine's id or the user's (vLLM's `RequestOutput.request_id`). Model runner V1 or V2."""
        return get_request_stats(worker_model(self), request_ids)

    def sparse_attn_reset_stats(self) -> None:
        reset_sparsity_stats(worker_model(self))


def maybe_log_sparsity(worker) -> None:
    """Every MODELOPT_EXT_SPARSE_ATTN_LOG_EVERY steps: the realized-sparsity log line and this worker's totals for
    Prometheus (plugins/vllm/metrics.py; every 256 steps when the log is off). One read of the counters."""
    every = log_every()
    worker._sparse_attn_steps = getattr(worker, "_sparse_attn_steps", 0) + 1
    if worker._sparse_attn_steps % (every or DEFAULT_LOG_EVERY) or not (every or exporting()):
        return  # nothing to log or export: no read of the counters (it syncs with the device)
    model = worker_model(worker)
    totals = summarize_stats(get_sparsity_stats(model))
    export_worker_metrics(model, totals)
    if every and any(t["visited"] for t in totals.values()):
        logger.info(
            "sparse attention after %d steps: realized sparsity prefill %s, decode %s",
            worker._sparse_attn_steps,
            _fmt(totals["prefill"]["sparsity"]),
            _fmt(totals["decode"]["sparsity"]),
        )


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def worker_extension_cls(user: str | None = None) -> str:
    """The `worker_extension_cls` qualified name that gives vLLM's worker the plugin's RPCs, composed with the
    extension class `user` names (if any): vLLM takes one class, so ours and the user's become one subclass of both,
    built by name in every worker process (this module's `__getattr__`)."""
    ours = f"{__name__}.{SparseAttnWorkerExtension.__name__}"
    if not user or user == ours or user.startswith(f"{__name__}.{_COMPOSED_PREFIX}"):
        return user or ours
    return f"{__name__}.{_COMPOSED_PREFIX}{user.encode().hex()}"


def __getattr__(name: str):
    """Composed extension classes, by the names `worker_extension_cls` gives them (created once per process)."""
    if not name.startswith(_COMPOSED_PREFIX):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        user = bytes.fromhex(name[len(_COMPOSED_PREFIX):]).decode()
    except (ValueError, binascii.Error, UnicodeDecodeError):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    module, _, attr = user.rpartition(".")
    user_cls = getattr(importlib.import_module(module), attr)
    composed = type(name, (user_cls, SparseAttnWorkerExtension), {
        "__module__": __name__,
        "__doc__": f"{user} with the sparse-attention worker RPCs (SparseAttnWorkerExtension).",
    })
    globals()[name] = composed
    return composed
