"""Per-request targets (issue #28): parsed from vLLM's `SamplingParams.extra_args`, refused at admission through
vLLM's own validation hook, and served per row by the real layers and builders.

The model runner is the one piece that cannot be built here: `V1Runner` holds what the plugin reads of vLLM's model
runner V1 (`input_batch.req_ids`, `input_batch.num_prompt_tokens`, `requests[id].sampling_params`), with vLLM's
real `SamplingParams`. Numerics: float32 layers; a row served in a mixed batch against the same row served alone,
and against the checkpoint served at that target, at atol 1e-6 (same kernel, same law); dense rows against the
float64 reference at 2e-5.
"""

from __future__ import annotations

import inspect
import math
import types
import zlib

import numpy as np
import pytest
import torch

pytest.importorskip("vllm.v1.attention.backends.flash_attn")  # the helpers build FlashAttention layers

from vllm import SamplingParams  # noqa: E402
from vllm_plugin_testlib import (  # noqa: E402
    Batch,
    admit_v2,
    attach_kv_cache,
    backend_metadata,
    cache_kind_for,
    dense_reference,
    engine_config,
    fill_prefix,
    finish_v2,
    make_batch,
    make_cache,
    run_layer,
    v1_runner,
    v2_runner,
)

from modelopt_ext.torch.sparsity.attention_sparsity.checkpoint.config_io import (  # noqa: E402
    PhaseCalibration,
    SparseAttentionSettings,
)
from modelopt_ext.torch.sparsity.attention_sparsity.checkpoint.law import Law  # noqa: E402
from modelopt_ext.torch.sparsity.attention_sparsity.plugins import vllm as plug  # noqa: E402
from modelopt_ext.torch.sparsity.attention_sparsity.plugins.vllm import admission  # noqa: E402
from modelopt_ext.torch.sparsity.attention_sparsity.plugins.vllm.feedback import FEEDBACK_RATE  # noqa: E402
from modelopt_ext.torch.sparsity.attention_sparsity.plugins.vllm.prompt_lens import prompt_lens_source  # noqa: E402
from modelopt_ext.torch.sparsity.attention_sparsity.plugins.vllm.request_stats import (  # noqa: E402
    RequestCounters,
    request_counters_source,
    user_request_id,
)
from modelopt_ext.torch.sparsity.attention_sparsity.plugins.vllm.request_targets import (  # noqa: E402
    RequestLaws,
    RequestTargetError,
    request_law_of,
    request_laws_source,
    requested_targets,
    validate_request,
)

PAGE, NB, D = 16, 128, 32
RANGE = (0.1, 0.9)
A_PRE, B_PRE, A_DEC, B_DEC = 2.0, 6.0, 0.5, 6.0  # λ < 1 at the tested lengths and targets


def _phase(a=A_PRE, b=B_PRE, target=0.5, **extra):
    return PhaseCalibration(a=a, b=b, target_sparsity=target, observed_sparsity_range=RANGE, **extra)


def _settings(prefill=True, decode=True, target=0.5, a_pre=A_PRE, a_dec=A_DEC):
    return SparseAttentionSettings(prefill=_phase(a=a_pre, target=target) if prefill else None,
                                   decode=_phase(a=a_dec, b=B_DEC, target=target) if decode else None)


V1Runner = v1_runner  # what the plugin reads of vLLM's model runner V1 (vllm_plugin_testlib)


# ------------------------------------------------------------------------------------------------------------------
# Parsing and the law of a request


def test_keys_parse_to_phase_targets():
    assert requested_targets(None) is None and requested_targets({"other": 1}) is None
    assert requested_targets({"sparse_attn_target": 0.7}) == {"prefill": (0.7, "sparse_attn_target"),
                                                              "decode": (0.7, "sparse_attn_target")}
    both_then_decode = requested_targets({"sparse_attn_target": "0.3", "sparse_attn_decode_target": "dense"})
    assert both_then_decode == {"prefill": (0.3, "sparse_attn_target"), "decode": (None, "sparse_attn_decode_target")}
    assert requested_targets({"sparse_attn_prefill_target": 0}) == {"prefill": (None, "sparse_attn_prefill_target")}


@pytest.mark.parametrize("extra, needle", [
    ({"sparse_attn_targt": 0.5}, "did you mean sparse_attn_target"),
    ({"sparse_attn_target": 1.0}, "lies in [0, 1)"),
    ({"sparse_attn_target": -0.1}, "lies in [0, 1)"),
    ({"sparse_attn_target": float("nan")}, "lies in [0, 1)"),
    ({"sparse_attn_target": True}, "expected a target sparsity"),
    ({"sparse_attn_decode_target": "fast"}, "expected a target sparsity"),
    ({"sparse_attn_decode_target": [0.5]}, "expected a target sparsity"),
])
def test_malformed_keys_are_refused_by_name(extra, needle):
    with pytest.raises(RequestTargetError) as err:
        validate_request(extra, _settings())
    assert needle in str(err.value) and next(iter(extra)) in str(err.value)


def test_law_is_the_checkpoint_law_at_the_requested_target():
    settings = _settings()
    law = validate_request({"sparse_attn_prefill_target": 0.8}, settings)
    assert law.prefill.c == pytest.approx(math.log(A_PRE) + B_PRE * 0.8)  # ln a + b·target
    assert law.decode.c == pytest.approx(settings.decode.log_scale_factor)  # decode keeps the checkpoint's target
    assert law.gamma == (1.0, 1.0)
    assert validate_request({"sparse_attn_target": "dense"}, settings).c == (-math.inf, -math.inf)
    # γ moves with the target along the checkpoint's slope, as a checkpoint served at that target would
    sloped = SparseAttentionSettings(prefill=_phase(length_exponent=1.2, length_exponent_slope=0.5), decode=None)
    law = validate_request({"sparse_attn_prefill_target": 0.8}, sloped)
    at = sloped.prefill.at_target(0.8)
    assert law.prefill.c == pytest.approx(at.log_scale_factor)
    assert law.prefill.gamma == pytest.approx(at.length_exponent) != pytest.approx(1.2)


def test_targets_outside_the_calibration_are_refused():
    with pytest.raises(RequestTargetError, match=r"decode calibration covers \[0.1, 0.9\]"):
        validate_request({"sparse_attn_decode_target": 0.95}, _settings())
    with pytest.raises(RequestTargetError, match="calibrates no decode law"):
        validate_request({"sparse_attn_target": 0.5}, _settings(decode=False))
    # dense is always possible, even for a phase the checkpoint serves dense
    assert validate_request({"sparse_attn_decode_target": "dense"}, _settings(decode=False)).decode.is_dense
    static = SparseAttentionSettings(prefill=PhaseCalibration(a=0.01, b=0.0, target_sparsity=0.5, length_exponent=0.0),
                                     decode=None)
    with pytest.raises(RequestTargetError, match="static"):
        validate_request({"sparse_attn_prefill_target": 0.5}, static)


# ------------------------------------------------------------------------------------------------------------------
# Admission: vLLM's own per-request validation of custom logits processors


def test_admission_through_vllm_validation_hook(monkeypatch):
    """Model runner V1 (the CPU engine's; VLLM_USE_V2_MODEL_RUNNER=0 on the GPU). The processor refuses with a
    ValueError (an HTTP 400 on the OpenAI server); where vLLM's hook converts a processor's ValueError, the caller
    gets vLLM's VLLMValidationError, elsewhere the plugin's RequestTargetError (a ValueError) itself."""
    from vllm.exceptions import VLLMValidationError

    if admission.SparseAttentionTargets is None:
        pytest.skip("this vLLM has no model runner V1 logits-processor interface (0.34: model runner V1 is gone)")
    from vllm.v1.sample.logits_processor import validate_logits_processors_parameters

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    config = engine_config()
    # VllmConfig.use_v2_model_runner is absent where model runner V2 is opt-in by that environment variable only
    assert not getattr(config, "use_v2_model_runner", False)
    hook_converts = "VLLMValidationError" in inspect.getsource(validate_logits_processors_parameters)
    refused = VLLMValidationError if hook_converts else RequestTargetError
    saved = config.model_config.logits_processors
    try:
        assert admission.enable_admission_checks(config, _settings())
        assert admission.enable_admission_checks(config, _settings())  # idempotent: one entry
        processors = config.model_config.logits_processors
        assert processors.count(admission._fqcn(admission.SparseAttentionTargets)) == 1

        def validate(extra):
            validate_logits_processors_parameters(processors, SamplingParams(extra_args=extra))

        validate({"sparse_attn_target": 0.5})
        validate(None)
        validate({"unrelated": "x"})
        with pytest.raises(refused, match="sparse_attn_decode_target=0.95: outside"):
            validate({"sparse_attn_decode_target": 0.95})
        with pytest.raises(refused, match="did you mean"):
            validate({"sparse_attn_tagret": 0.5})
        admission.disable_admission_checks()
        admission.enable_admission_checks(config, None)  # the plugin switched off: any target is refused
        with pytest.raises(refused, match="MODELOPT_EXT_SPARSE_ATTN=0"):
            validate({"sparse_attn_target": 0.5})
    finally:
        admission.disable_admission_checks()
        config.model_config.logits_processors = saved


def test_model_runner_v2_checks_targets_at_admission_and_refuses_them_with_pipeline_stages(monkeypatch):
    """Model runner V2 takes its own processor interface: the same admission checks; with pipeline parallelism V2
    hands request params only to the last stage, so a target is refused there, naming the switch to model runner V1
    where this vLLM has one (up to 0.33; 0.34 has only V2, and no `use_v2_model_runner`)."""
    from vllm.exceptions import VLLMValidationError

    if admission.SparseAttentionTargetsV2 is None:
        pytest.skip("this vLLM has no model runner V2 logits-processor interface")
    from vllm.v1.worker.gpu.sample.logits_processor import build_custom_logits_processors_params_validator

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    config = engine_config()
    saved = config.model_config.logits_processors
    try:
        v2_only = admission.SparseAttentionTargets is None  # no model runner V1 (0.34)
        assert (v2_only or config.use_v2_model_runner) and admission.enable_admission_checks(config, _settings())
        (fqcn,) = config.model_config.logits_processors
        assert fqcn.endswith(":SparseAttentionTargetsV2")
        validate = build_custom_logits_processors_params_validator([fqcn])  # loads it by name, as the server does
        validate(SamplingParams())
        validate(SamplingParams(extra_args={"sparse_attn_target": 0.5, "sparse_attn_decode_feedback": True}))
        with pytest.raises(VLLMValidationError, match="sparse_attn_decode_target=0.95: outside"):
            validate(SamplingParams(extra_args={"sparse_attn_decode_target": 0.95}))
        admission.disable_admission_checks()
        config.model_config.logits_processors = saved
        config.parallel_config.pipeline_parallel_size = 2
        assert admission.enable_admission_checks(config, _settings())
        (fqcn,) = config.model_config.logits_processors
        assert fqcn.endswith(":SparseAttentionTargetsV2Staged")
        validate = build_custom_logits_processors_params_validator([fqcn])
        validate(SamplingParams(extra_args={"unrelated": 1}))
        switch = "no model runner V1" if v2_only else "VLLM_USE_V2_MODEL_RUNNER=0"
        with pytest.raises(VLLMValidationError, match=switch):
            validate(SamplingParams(extra_args={"sparse_attn_target": 0.5}))
    finally:
        admission.disable_admission_checks()
        config.model_config.logits_processors = saved
        config.parallel_config.pipeline_parallel_size = 1


def _v2_runner_and_processors(monkeypatch):
    """A V2 runner stand-in and the custom logits processors vLLM's V2 loader builds for it from the engine config
    the plugin's config hook edited (`build_custom_logits_processors`, as the V2 sampler does)."""
    if admission.SparseAttentionTargetsV2 is None or "req_idx" not in plug.vllm_facts().common_metadata_fields:
        pytest.skip("this vLLM has no model runner V2 with req_idx in its attention metadata")
    from vllm.v1.worker.gpu.sample.logits_processor.loader import build_custom_logits_processors

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    config = engine_config()
    try:
        admission.enable_admission_checks(config, _settings())
        runner = v2_runner()
        processors = build_custom_logits_processors(config, runner.req_states, False,
                                                     config.model_config.logits_processors)  # fmt: skip
    finally:
        admission.disable_admission_checks()
    assert [type(p).__name__ for p in processors] == ["SparseAttentionTargetsV2"]
    return runner, processors


# ------------------------------------------------------------------------------------------------------------------
# The plan and the forward


def test_plan_rows_follow_each_request_and_fall_back_to_the_checkpoint(make_layer, vllm_config):
    layer = make_layer("flash_attn", head_size=D)
    settings = _settings()
    runner = V1Runner([("a", 40, {"sparse_attn_target": 0.8}), ("b", 200, None),
                       ("c", 30, {"sparse_attn_decode_target": "dense"})])
    plug.install_sparse_attention([layer], settings, model_runner=runner)
    batch = make_batch([1, 64, 1], [41, 64, 31], dim=D, page=PAGE, num_blocks=NB)
    plan = getattr(backend_metadata(layer, batch), plug.PLAN_ATTR)
    c_pre, c_dec = settings.prefill.log_scale_factor, settings.decode.log_scale_factor
    expected = torch.tensor([[math.log(A_PRE) + B_PRE * 0.8, math.log(A_DEC) + B_DEC * 0.8], [c_pre, c_dec],
                             [c_pre, -math.inf]], dtype=torch.float32)
    assert torch.equal(plan.log_scale_factors, expected)
    # the next step has no request with its own target: every row gets the checkpoint's law back
    runner.requests["a"].sampling_params = SamplingParams()
    runner.input_batch.req_ids = ["d", "b", "e"]
    runner.requests.update({"d": runner.requests["a"], "e": runner.requests["a"]})
    plan = getattr(backend_metadata(layer, batch), plug.PLAN_ATTR)
    assert torch.equal(plan.log_scale_factors, torch.tensor([[c_pre, c_dec]] * 3, dtype=torch.float32))


def test_request_law_cache_follows_the_batch():
    runner = V1Runner([("a", 10, {"sparse_attn_target": 0.3}), ("b", 10, None)])
    source, reason = request_laws_source(runner)
    assert isinstance(source, RequestLaws) and reason is None
    context = types.SimpleNamespace(version=0, settings=_settings())
    first = source(2, context)
    assert source(2, context) is first  # same batch, same engine settings: nothing recomputed
    runner.input_batch.req_ids = ["b", "a"]  # vLLM condensed the batch: rows moved
    moved = source(2, context)
    assert moved == first[::-1]
    runner.input_batch.req_ids, runner.input_batch.num_reqs = ["b"], 1
    assert source(1, context) is None  # no request of this step sets a target
    assert request_laws_source(None)[0] is None
    assert "model runner V1" in request_laws_source(types.SimpleNamespace(req_states=object()))[1]


def test_a_bad_value_reaching_the_worker_is_logged_and_served_at_the_checkpoint(caplog):
    runner = V1Runner([("bad", 10, {"sparse_attn_target": 5})])
    context = types.SimpleNamespace(version=0, settings=_settings())
    with caplog.at_level("WARNING", logger="modelopt_ext"):
        assert RequestLaws(runner)(1, context) is None
    assert "request bad: sparse_attn_target=5" in caplog.text and "checkpoint's targets" in caplog.text


def _one(batch: Batch, i: int) -> Batch:
    """Sequence i of a batch, alone."""
    s, e = int(batch.query_start_loc[i]), int(batch.query_start_loc[i + 1])
    return Batch([batch.q_lens[i]], [batch.kv_lens[i]], batch.q[s:e], batch.k_new[s:e], batch.v_new[s:e],
                 [batch.k_seq[i]], [batch.v_seq[i]], batch.block_table[i : i + 1], batch.slot_mapping[s:e],
                 torch.tensor([0, e - s], dtype=torch.int32), batch.seq_lens[i : i + 1])


def _peaked_batch(gen):
    """A prompt chunk of 128 rows from position 320 (two whole 64-row blocks) of a 448-token prompt, decode rows at
    700 and 420 keys; a strong first tile for every query (contract v4: whole blocks and GQA groups drop tiles)."""
    return make_batch([128, 1, 1], [448, 700, 420], dim=D, page=PAGE, num_blocks=NB, gen=gen, anchor=10.0)


def _mixed_settings(target=0.5):
    """The mixed step's checkpoint: λ = 55·e^(6·target) / n (prefill), 1·e^(6·target) / n (decode). At these
    lengths the prompt chunk drops tiles at target 0.2 and none at 0.5 (λ >= 1); the 700-key decode row drops more
    at 0.8 (λ = 0.17) than at 0.5 (λ = 0.029)."""
    return _settings(target=target, a_pre=55.0, a_dec=1.0)


def _use_runner(layer, runner) -> None:
    """What installing with `model_runner=runner` gives the engine's context: its law, prompt-length and counter
    sources."""
    context = layer.impl._modelopt_sparse.context
    context.request_laws, context.prompt_lens = request_laws_source(runner)[0], prompt_lens_source(runner)[0]
    context.request_counters = request_counters_source(runner)


def _serve(layer, vllm_config, batch, runner, **metadata):
    """One step of `batch` with `runner`'s requests: (output, this layer's counts, per-request counts). `metadata`:
    more CommonAttentionMetadata fields (model runner V2's `req_idx`)."""
    _use_runner(layer, runner)
    plug.reset_sparsity_stats([layer])
    out = run_layer(layer, vllm_config, batch, backend_metadata(layer, batch, **metadata))
    return out, plug.get_sparsity_stats([layer])[layer.layer_name], plug.get_request_stats([layer])


def _mixed_step(make_layer, backend):
    """A sparse layer with a filled cache, a peaked batch (a prefill chunk and two decodes; fixed per backend: the
    drops the tests need hold on it, see `_mixed_settings`) and its three requests: targets 0.2, 0.8 and dense."""
    batch = _peaked_batch(torch.Generator().manual_seed(zlib.crc32(f"mixed-step-{backend}".encode())))
    requests = [("lo", 448, {"sparse_attn_target": 0.2}), ("hi", 200, {"sparse_attn_target": 0.8}),
                ("dense", 100, {"sparse_attn_target": "dense"})]
    layer = make_layer(backend, head_size=D)
    plug.install_sparse_attention([layer], _mixed_settings())
    cache = make_cache(cache_kind_for(backend), NB, PAGE, 2, D)
    fill_prefix(cache, batch, PAGE)
    attach_kv_cache(layer, cache.kv_cache)
    return layer, batch, requests


@pytest.mark.parametrize("backend", ["flash_attn", "cpu_attn"])
def test_each_row_is_served_at_its_own_target_whatever_the_batch(backend, make_layer, vllm_config):
    """Three requests at 0.2, 0.8 and dense in one step: each row equals the row served alone, and equals the
    checkpoint served at that target (not at its own); the dense request equals the float64 reference; skipped tiles
    add up."""
    layer, batch, requests = _mixed_step(make_layer, backend)
    mixed, mixed_counts, per_request = _serve(layer, vllm_config, batch, V1Runner(requests))
    rows = batch.query_start_loc.tolist()
    alone_counts = []
    for i, request in enumerate(requests[:2]):  # the dense request alone takes vLLM's native path: not counted
        alone, counts, _ = _serve(layer, vllm_config, _one(batch, i), V1Runner([request]))
        alone_counts.append(counts)
        torch.testing.assert_close(mixed[rows[i] : rows[i + 1]], alone, atol=1e-6, rtol=0)
        # realized per request in the mixed step = the request's own counts
        for phase in ("prefill", "decode"):
            assert {k: per_request[request[0]][phase][k] for k in ("visited", "skipped")} == counts[phase]
    assert per_request["dense"]["decode"]["skipped"] == 0 and per_request["dense"]["decode"]["visited"] > 0
    for phase in ("prefill", "decode"):  # the dense request's rows are visited in the mixed step, never skipped
        assert mixed_counts[phase]["skipped"] == sum(c[phase]["skipped"] for c in alone_counts)
    assert alone_counts[0]["prefill"]["skipped"] > 0 and alone_counts[1]["decode"]["skipped"] > 0
    dense = dense_reference(batch, layer.impl.scale).reshape(batch.num_tokens, -1).float()
    torch.testing.assert_close(mixed[rows[2] : rows[3]], dense[rows[2] : rows[3]], atol=2e-5, rtol=0)
    # the same rows from a checkpoint whose own target is the request's; not those of the checkpoint's target (0.5)
    for i, target in ((0, 0.2), (1, 0.8)):
        alone_request = V1Runner([(requests[i][0], requests[i][1], None)])
        plug.install_sparse_attention([layer], _mixed_settings(target=target))
        served, _, _ = _serve(layer, vllm_config, _one(batch, i), alone_request)
        torch.testing.assert_close(mixed[rows[i] : rows[i + 1]], served, atol=1e-6, rtol=0)
        plug.install_sparse_attention([layer], _mixed_settings())
        at_checkpoint_target, _, _ = _serve(layer, vllm_config, _one(batch, i), alone_request)
        assert (mixed[rows[i] : rows[i + 1]] - at_checkpoint_target).abs().max() > 1e-4


@pytest.mark.parametrize("backend", ["flash_attn", "cpu_attn"])
def test_model_runner_v2_serves_each_row_at_its_requests_target(backend, make_layer, vllm_config, monkeypatch):
    """Model runner V2 (vLLM's GPU default from 0.33): the mixed step of the V1 test, with rows tied to requests by
    the metadata's `req_idx` and the slots the admission processor recorded. Outputs, layer counts and per-request
    counts equal the V1 step's; a finished request's slot, reused by a request without a target, carries no stale
    target."""
    runner, processors = _v2_runner_and_processors(monkeypatch)
    layer, batch, requests = _mixed_step(make_layer, backend)
    v1 = _serve(layer, vllm_config, batch, V1Runner(requests))
    slots = [6, 1, 3]  # V2 gives requests table slots from a free list; rows map to them through req_idx
    admit_v2(runner, processors, [(rid, slot, n, extra) for (rid, n, extra), slot in zip(requests, slots, strict=True)])
    v2 = _serve(layer, vllm_config, batch, runner, req_idx=np.array(slots))
    torch.testing.assert_close(v2[0], v1[0], atol=0, rtol=0)
    assert v2[1] == v1[1] and v2[2] == v1[2] and v1[1]["decode"]["skipped"] > 0
    finish_v2(runner, "hi")
    admit_v2(runner, processors, [("plain", 1, 200, None)])
    plan = getattr(backend_metadata(layer, batch, req_idx=np.array(slots)), plug.PLAN_ATTR)
    checkpoint = torch.tensor([_mixed_settings().prefill.log_scale_factor, _mixed_settings().decode.log_scale_factor])
    torch.testing.assert_close(plan.log_scale_factors[1], checkpoint, atol=1e-6, rtol=0)
    assert plug.get_request_stats([layer], ["hi"])["hi"]["finished"]


def test_request_counters_keep_finished_requests_and_free_their_slots():
    """Rows add into their request's slot across steps; a preempted request keeps its counts; a finished one is
    kept after its slot is zeroed and reused."""
    runner = V1Runner([("a-0123abcd", 10, None), ("b", 10, None)])
    counters = RequestCounters(runner)
    phases = torch.tensor([0, 1])

    def step(ids, counts):
        runner.input_batch.req_ids, runner.input_batch.num_reqs = ids, len(ids)
        index = counters.step(len(ids), 4, phases[: len(ids)], "cpu")
        counters.flat_table.index_add_(0, index, torch.tensor(counts, dtype=torch.int64))

    step(["a-0123abcd", "b"], [[10, 4], [7, 1]])
    step(["b", "a-0123abcd"], [[5, 2], [3, 3]])  # rows swapped, phases by row: b prefill, a decode
    step(["b"], [[1, 1]])  # a preempted: not in this step, still in the runner
    snap = counters.snapshot()
    assert snap["a-0123abcd"]["prefill"] == {"visited": 10, "skipped": 4, "sparsity": 0.4}
    assert snap["a-0123abcd"]["decode"]["skipped"] == 3 and not snap["a-0123abcd"]["finished"]
    assert snap["a-0123abcd"]["user_request_id"] == "a" == user_request_id("a-0123abcd")
    assert snap["b"]["prefill"]["visited"] == 6 and snap["b"]["decode"]["visited"] == 7
    del runner.requests["a-0123abcd"]  # finished: vLLM dropped its state
    runner.requests["c"] = runner.requests["b"]
    step(["b", "c"], [[0, 0], [2, 1]])
    snap = counters.snapshot()
    assert snap["a-0123abcd"]["finished"] and snap["a-0123abcd"]["decode"]["visited"] == 3
    assert snap["c"]["decode"] == {"visited": 2, "skipped": 1, "sparsity": 0.5}  # the freed slot starts at zero
    counters.reset()
    assert "a-0123abcd" not in counters.snapshot() and counters.snapshot()["b"]["prefill"]["visited"] == 0


def test_request_counters_on_model_runner_v2_keep_a_preempted_requests_counts(monkeypatch):
    """Model runner V2 treats a preempted request as finished (its slot is freed) and re-adds it when it resumes,
    maybe in another slot: its counts continue from what it had."""
    runner, processors = _v2_runner_and_processors(monkeypatch)
    counters = RequestCounters(runner)
    phases = torch.tensor([0, 1])

    def step(slots, counts):
        meta = types.SimpleNamespace(req_idx=np.array(slots))
        index = counters.step(len(slots), 4, phases[: len(slots)], "cpu", meta)
        counters.flat_table.index_add_(0, index, torch.tensor(counts, dtype=torch.int64))

    admit_v2(runner, processors, [("a", 2, 10, None), ("b", 5, 10, None)])
    step([2, 5], [[10, 4], [7, 1]])
    finish_v2(runner, "a")  # preempted: V2 frees its state
    step([5], [[3, 1]])
    assert counters.snapshot()["a"]["finished"]
    admit_v2(runner, processors, [("a", 0, 10, None)])  # resumed in another slot
    step([5, 0], [[1, 1], [2, 2]])
    snap = counters.snapshot()
    assert not snap["a"]["finished"] and snap["a"]["prefill"] == {"visited": 10, "skipped": 4, "sparsity": 0.4}
    assert snap["a"]["decode"] == {"visited": 2, "skipped": 2, "sparsity": 1.0}
    assert snap["b"]["decode"]["visited"] == 7 and snap["b"]["prefill"]["visited"] == 3 + 1  # phases by row


# ------------------------------------------------------------------------------------------------------------------
# Decode feedback


def test_feedback_key_parses_and_needs_a_decode_target():
    row = request_law_of({"sparse_attn_decode_feedback": True}, _settings())
    assert row.law == Law.of(_settings())  # the checkpoint's law, holding the checkpoint's decode target
    assert (row.feedback.target, row.feedback.gain) == (0.5, B_DEC)
    row = request_law_of({"sparse_attn_decode_target": 0.7, "sparse_attn_decode_feedback": "on"}, _settings())
    assert (row.feedback.target, row.feedback.gain) == (pytest.approx(0.7), B_DEC)
    assert request_law_of({"sparse_attn_decode_feedback": "false"}, _settings()).feedback is None
    with pytest.raises(RequestTargetError, match="expected true or false"):
        request_law_of({"sparse_attn_decode_feedback": "maybe"}, _settings())
    with pytest.raises(RequestTargetError, match="feedback holds a decode target"):
        request_law_of({"sparse_attn_decode_target": "dense", "sparse_attn_decode_feedback": 1}, _settings())


def _plant(target, offset, shift, slope):
    """A decode 'model' for one kind of text: the share of tiles a step drops when the request's law is the
    checkpoint's at `target` (c = c(0.5) + b·(target - 0.5)) moved by δ. Linear in ln λ, as the fit assumes, but
    with the slope and intercept this text has, not those the calibration fitted (b, and 0.5 at target 0.5)."""
    return min(max(0.5 + (B_DEC * (target - 0.5) + offset - shift) / slope, 0.0), 1.0)


@pytest.mark.parametrize("shift, slope", [(-0.8, 8.0), (1.0, 4.0)], ids=["realizes-too-much", "realizes-too-little"])
def test_feedback_drives_a_request_to_its_decode_target(shift, slope):
    """Two requests with feedback, one without, through RequestCounters' device ops: each step's decode counts are
    what the plant drops at the request's current δ; the feedback requests reach their targets within 0.02 in 30
    steps, δ stays within its bound, and the request without feedback keeps δ = 0."""
    runner = V1Runner([("a", 10, None), ("b", 10, None), ("c", 10, None)])
    counters = RequestCounters(runner)
    phases = torch.ones(3, dtype=torch.int64)
    gain = torch.tensor([B_DEC, B_DEC, 0.0])
    target = torch.tensor([0.5, 0.3, 0.5])
    visited = 10_000
    offsets = torch.zeros(3)
    realized = []
    for _ in range(30):
        index = counters.step(3, 4, phases, "cpu")
        offsets = counters.decode_offsets(3, gain, target)
        drops = [_plant(float(t), float(d), shift, slope) for t, d in zip(target, offsets, strict=True)]
        realized.append(drops)
        counts = torch.tensor([[visited, round(visited * s)] for s in drops], dtype=torch.int64)
        counters.flat_table.index_add_(0, index, counts)
    last = realized[-1]
    assert abs(last[0] - 0.5) < 0.02 and abs(last[1] - 0.3) < 0.02, realized[-5:]
    assert float(offsets[2]) == 0.0 and abs(realized[0][2] - realized[-1][2]) == 0.0
    assert bool((offsets.abs() <= 0.3 * B_DEC + 1e-6).all())


def test_feedback_moves_the_planned_law_of_its_request_only(make_layer, vllm_config):
    """Through the real builder: after a step whose decode rows dropped nothing, the next plan raises c_decode of the
    feedback request by η·b·target and leaves the other request's law as it was."""
    layer = make_layer("flash_attn", head_size=D)
    settings = _settings()
    runner = V1Runner([("fb", 40, {"sparse_attn_decode_feedback": True}), ("plain", 30, {"sparse_attn_target": 0.5})])
    plug.install_sparse_attention([layer], settings, model_runner=runner)
    batch = make_batch([1, 1], [41, 31], dim=D, page=PAGE, num_blocks=NB)
    plan = getattr(backend_metadata(layer, batch), plug.PLAN_ATTR)
    base = settings.decode.log_scale_factor
    assert plan.log_scale_factors[:, 1].tolist() == pytest.approx([base, base])
    assert not plan.dense  # these lengths can drop tiles
    plan.request_table.index_add_(0, plan.request_index, torch.tensor([[500, 0], [500, 0]]))  # a step, no drops
    plan = getattr(backend_metadata(layer, batch), plug.PLAN_ATTR)
    step = FEEDBACK_RATE * B_DEC * 0.5
    assert plan.log_scale_factors[:, 1].tolist() == pytest.approx([base + step, base], abs=1e-5)
    plan = getattr(backend_metadata(layer, batch), plug.PLAN_ATTR)  # no new counts: δ holds
    assert plan.log_scale_factors[:, 1].tolist() == pytest.approx([base + step, base], abs=1e-5)


@pytest.mark.parametrize("kv_len, feedback, dense", [(6, True, True), (12, False, True), (12, True, False)],
                         ids=["feedback-short", "law-longer", "feedback-longer"])
def test_the_host_takes_the_dense_path_for_feedback_rows_only_where_no_offset_can_drop_a_tile(
        make_layer, vllm_config, kv_len, feedback, dense):  # fmt: skip
    """Feedback moves a row's c_decode on the device within ±0.3·b, so the host's dense shortcut (no row of the step
    can drop a tile) takes the lowest c it may reach: at decode target 0.8, c = ln 0.5 + 6·0.8 = 4.11, whose law
    alone is dense up to n = e^4.11 = 61 and with feedback (c - 1.8) up to n = 10. The prefill law is dense there
    too (c = ln 2 + 3 = 3.69: n <= 40)."""
    layer = make_layer("flash_attn", head_size=D)
    extra = {"sparse_attn_decode_target": 0.8, **({"sparse_attn_decode_feedback": True} if feedback else {})}
    plug.install_sparse_attention([layer], _settings(), model_runner=V1Runner([("r", kv_len - 1, extra)]))
    batch = make_batch([1], [kv_len], dim=D, page=PAGE, num_blocks=NB)
    plan = getattr(backend_metadata(layer, batch), plug.PLAN_ATTR)
    assert plan.dense is dense
