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


def test_layers_by_how_they_are_served_count_each_layer_once(monkeypatch, make_layer):
    """`modelopt_sparse_attn_layers{served, reason}` from real layers (`served_layers` after an install that keeps
    one layer dense by the ignore list): two tensor-parallel ranks hold the same layers, a second pipeline stage
    others; each layer counts once."""
    from modelopt_ext.torch.sparsity.attention_sparsity.checkpoint.config_io import (
        PhaseCalibration,
        SparseAttentionSettings,
    )
    from modelopt_ext.torch.sparsity.attention_sparsity.plugins import vllm as plug
    from modelopt_ext.torch.sparsity.attention_sparsity.plugins.vllm.worker import served_layers

    names = [f"metrics_lm.layers.{i}.self_attn.attn" for i in range(4)]  # unique in the tests' shared vLLM config
    layers = [make_layer("flash_attn", head_size=64, prefix=name) for name in names]
    settings = SparseAttentionSettings(prefill=PhaseCalibration(4.0, 8.0, 0.5), decode=None,
                                       disabled_layers=("metrics_lm.layers.1.self_attn",))  # fmt: skip
    plug.install_sparse_attention(layers[:2], settings)  # stage 0
    plug.install_sparse_attention(layers[2:], settings)  # stage 1
    stage0, stage1 = served_layers(layers[:2]), served_layers(layers[2:])
    assert stage0[names[0]] == "" and stage0[names[1]] and set(stage1.values()) == {""}
    monkeypatch.delenv(metrics.ENV_METRICS_DIR, raising=False)
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    directory = metrics.export_to_prometheus()
    zero = {phase: {"visited": 0, "skipped": 0} for phase in ("prefill", "decode")}
    try:
        for rank, served in (("tp0-pp0", stage0), ("tp1-pp0", stage0), ("tp0-pp1", stage1)):
            metrics.write_worker_totals(zero, rank, layers=served)
        got = {}
        for family in text_string_to_metric_families(generate_latest(REGISTRY).decode()):
            for s in family.samples:
                if s.name == f"{metrics.PREFIX}_layers":
                    got[(s.labels["served"], s.labels["reason"])] = s.value
        assert got == {("sparse", ""): 3, ("dense", stage0[names[1]]): 1}
    finally:
        metrics.stop_exporting()
    assert directory is not None and not directory.exists()
