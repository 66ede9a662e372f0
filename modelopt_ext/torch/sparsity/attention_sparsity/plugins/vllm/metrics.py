"""Realized sparsity on vLLM's Prometheus `/metrics`, read-only (issue #28): no RPC, no dev mode.

The counters live in the worker processes; `/metrics` is served by the API server process from prometheus_client's
default registry. So:

- when vLLM creates an engine config for a checkpoint with a block (the API server process, plugins/vllm/entry.py),
  `export_to_prometheus` makes a private directory for this server, names it in `ENV_METRICS_DIR` (the engine core
  and its workers, started later, inherit it) and registers one collector in that process's default registry;
- each worker writes its per-phase totals and how each of its attention layers is served there (one small JSON
  file per worker, replaced atomically) once at install and then when it already reads its counters for the
  periodic log line (`MODELOPT_EXT_SPARSE_ATTN_LOG_EVERY`, default every 256 steps; every 256 when that log is
  off), so serving gains no host sync for it;
- at each scrape the collector sums the files' counts, and counts distinct layer names (a tensor-parallel rank
  holds the same layers as its peers; pipeline stages hold different ones).

Exported (label `phase` = prefill / decode):

    modelopt_sparse_attn_tiles_visited_total    row-tiles the sparse kernels visited (all sparse layers and ranks)
    modelopt_sparse_attn_tiles_skipped_total    of those, dropped
    modelopt_sparse_attn_realized_sparsity      skipped / visited

and, per kind of layer (labels `served` = sparse / dense and `reason`, why a dense layer is kept dense: sliding
window, chunk-local attention, the ignore list, ...; empty for sparse layers), so an operator sees what share of a
hybrid model the counters above cover:

    modelopt_sparse_attn_layers                 attention layers served that way

The counters restart at 0 after `sparse_attn_reset_stats` or an engine restart (Prometheus' `rate()` handles that).
With `--api-server-count > 1` vLLM exports only its multiprocess registry: the metrics are not there, and the
start-up log says so.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path

from .env import ENV_METRICS_DIR

logger = logging.getLogger(__name__)

PREFIX = "modelopt_sparse_attn"
PHASES = ("prefill", "decode")
_STATE: dict = {}


class SparseAttentionCollector:
    """A prometheus_client collector summing the workers' files of one directory at each scrape."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)

    def _files(self) -> list[dict]:
        out = []
        for path in self.directory.glob("worker-*.json"):
            try:
                out.append(json.loads(path.read_text()))
            except (OSError, ValueError):  # a file being replaced: the next scrape reads it
                continue
        return out

    @staticmethod
    def totals(files: list[dict]) -> dict[str, list[int]]:
        """phase -> [visited, skipped] summed over the workers' files."""
        sums = {phase: [0, 0] for phase in PHASES}
        for data in files:
            for phase in PHASES:
                counts = data.get(phase, {})
                sums[phase][0] += int(counts.get("visited", 0))
                sums[phase][1] += int(counts.get("skipped", 0))
        return sums

    @staticmethod
    def layers(files: list[dict]) -> dict[tuple[str, str], int]:
        """(served, reason) -> number of distinct attention layers over the workers' files."""
        reason_of: dict[str, str] = {}
        for data in files:
            reason_of.update(data.get("layers", {}))
        counts: dict[tuple[str, str], int] = {}
        for reason in reason_of.values():
            key = ("dense", reason) if reason else ("sparse", "")
            counts[key] = counts.get(key, 0) + 1
        return counts

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        files = self._files()  # read once per scrape
        sums = self.totals(files)
        visited = CounterMetricFamily(f"{PREFIX}_tiles_visited", "Row-tiles the sparse attention kernels visited",
                                      labels=["phase"])  # fmt: skip
        skipped = CounterMetricFamily(f"{PREFIX}_tiles_skipped", "Row-tiles the sparse attention kernels dropped",
                                      labels=["phase"])  # fmt: skip
        ratio = GaugeMetricFamily(f"{PREFIX}_realized_sparsity", "Dropped / visited row-tiles", labels=["phase"])
        for phase, (v, s) in sums.items():
            visited.add_metric([phase], v)
            skipped.add_metric([phase], s)
            ratio.add_metric([phase], s / v if v else 0.0)
        layers = GaugeMetricFamily(f"{PREFIX}_layers", "Attention layers served sparse, or kept dense and why",
                                   labels=["served", "reason"])  # fmt: skip
        for (served, reason), count in sorted(self.layers(files).items()):
            layers.add_metric([served, reason], count)
        yield from (visited, skipped, ratio, layers)


def export_to_prometheus() -> Path | None:
    """Frontend side, once per process: the directory the workers write to, and the collector (None: not exported,
    and why is logged)."""
    if "dir" in _STATE:
        return _STATE["dir"]
    try:
        from prometheus_client import REGISTRY
    except ImportError:  # pragma: no cover - prometheus_client ships with vLLM
        logger.info("prometheus_client is not installed: realized sparsity is not exported to /metrics")
        _STATE["dir"] = None
        return None
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        logger.warning("vLLM exports only its multiprocess metrics here (--api-server-count > 1): realized "
                       "sparsity is not on /metrics; read it with the sparse_attn_status RPC")  # fmt: skip
        _STATE["dir"] = None
        return None
    directory = os.environ.get(ENV_METRICS_DIR)
    if not directory:
        _STATE["tmp"] = tempfile.TemporaryDirectory(prefix="modelopt_ext_metrics_")  # removed at exit
        directory = os.environ[ENV_METRICS_DIR] = _STATE["tmp"].name
    collector = SparseAttentionCollector(Path(directory))
    REGISTRY.register(collector)
    _STATE["dir"], _STATE["collector"] = Path(directory), collector
    return Path(directory)


def stop_exporting() -> None:
    """Undo `export_to_prometheus` in this process (tests; `entry.unregister`)."""
    collector = _STATE.pop("collector", None)
    if collector is not None:
        from prometheus_client import REGISTRY

        REGISTRY.unregister(collector)
    tmp = _STATE.pop("tmp", None)
    if tmp is not None:
        if os.environ.get(ENV_METRICS_DIR) == tmp.name:
            del os.environ[ENV_METRICS_DIR]
        tmp.cleanup()
    _STATE.pop("dir", None)


def exporting() -> bool:
    """Worker side: whether a server collects this worker's totals (its directory exists)."""
    directory = os.environ.get(ENV_METRICS_DIR)
    return bool(directory) and os.path.isdir(directory)


def write_worker_totals(totals: dict, rank_key: str | None = None, layers: dict[str, str] | None = None) -> None:
    """Worker side: replace this worker's file with its per-phase totals ({phase: {"visited", "skipped"}}) and how
    its attention layers are served ({layer name: "" when sparse, else why it is kept dense})."""
    if not exporting():
        return
    path = Path(os.environ[ENV_METRICS_DIR]) / f"worker-{rank_key or os.getpid()}.json"
    data = {phase: {k: int(totals[phase][k]) for k in ("visited", "skipped")} for phase in PHASES}
    if layers is not None:
        data["layers"] = dict(layers)
    tmp = path.with_suffix(".tmp")
    try:
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)
    except OSError as exc:  # the server's directory went away (it stopped): nothing to export to
        logger.debug("sparse attention metrics not written (%s)", exc)
