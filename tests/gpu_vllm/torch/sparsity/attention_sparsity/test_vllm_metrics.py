"""Realized sparsity on Prometheus (plugins/vllm/metrics.py): workers' files summed by the collector registered in
prometheus_client's default registry, which vLLM's single API server exposes on /metrics (end to end:
tests/e2e/test_sparse_flow.py scrapes a real server)."""

from __future__ import annotations

import pytest

pytest.importorskip("prometheus_client")

from prometheus_client import REGISTRY, generate_latest  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from modelopt_ext.torch.sparsity.attention_sparsity.plugins.vllm import metrics  # noqa: E402


def _scrape() -> dict:
    samples = {}
    for family in text_string_to_metric_families(generate_latest(REGISTRY).decode()):
        for s in family.samples:
            if s.name.startswith(metrics.PREFIX):
                samples[(s.name, s.labels.get("phase"))] = s.value
    return samples


def test_worker_totals_reach_the_default_registry(monkeypatch, tmp_path):
    monkeypatch.delenv(metrics.ENV_METRICS_DIR, raising=False)
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    directory = metrics.export_to_prometheus()
    try:
        assert directory is not None and directory.is_dir() and metrics.export_to_prometheus() == directory
        assert _scrape()[("modelopt_sparse_attn_tiles_visited_total", "prefill")] == 0
        # two workers (e.g. two tensor-parallel ranks), each replacing its own file
        metrics.write_worker_totals({"prefill": {"visited": 100, "skipped": 30}, "decode": {"visited": 10,
                                                                                           "skipped": 5}}, "r0")
        metrics.write_worker_totals({"prefill": {"visited": 100, "skipped": 50}, "decode": {"visited": 10,
                                                                                           "skipped": 1}}, "r1")
        metrics.write_worker_totals({"prefill": {"visited": 300, "skipped": 90}, "decode": {"visited": 30,
                                                                                           "skipped": 15}}, "r0")
        got = _scrape()
        assert got[("modelopt_sparse_attn_tiles_visited_total", "prefill")] == 400
        assert got[("modelopt_sparse_attn_tiles_skipped_total", "prefill")] == 140
        assert got[("modelopt_sparse_attn_realized_sparsity", "decode")] == pytest.approx(16 / 40)
        (directory / "worker-broken.json").write_text("{not json")  # a file mid-write is skipped, not an error
        assert _scrape()[("modelopt_sparse_attn_tiles_visited_total", "decode")] == 40
    finally:
        metrics.stop_exporting()
    assert not _scrape() and not directory.exists()


def test_not_exported_where_vllm_exports_only_its_multiprocess_registry(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    try:
        with caplog.at_level("WARNING", logger="modelopt_ext"):
            assert metrics.export_to_prometheus() is None
        assert "--api-server-count > 1" in caplog.text and not _scrape()
    finally:
        metrics.stop_exporting()


def test_workers_without_a_server_directory_write_nothing(monkeypatch, tmp_path):
    monkeypatch.setenv(metrics.ENV_METRICS_DIR, str(tmp_path / "gone"))
    metrics.write_worker_totals({"prefill": {"visited": 1, "skipped": 0}, "decode": {"visited": 0, "skipped": 0}})
    assert not (tmp_path / "gone").exists()
