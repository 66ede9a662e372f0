"""HF-side calibration: run prompts (chunked prefill + decode) dense, count tiles per trial, fit each phase.

Every enabled attention module gets a shared `CountCollector`; the kernel then returns, for each threshold trial
(a scale factor sf, tested at λ = sf / kv_len), the tiles serving would visit and skip. Counts are summed over
layers per model forward (a forward hook closes a step), turned into per-sequence records, and handed to the shared
`calibration.fit` (one implementation for HF and vLLM): raw counts are merged, each phase is fitted as
`scale_factor = a * exp(b * sparsity)`, and the fit plus the target is stored on every enabled module.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from ..config import PHASES, SkipSoftmaxCalibrationConfig
from ..plugins.huggingface import SparseAttentionState, prompt_length
from .fit import (
    CalibrationFitError,
    CalibrationRecord,
    PhaseFit,
    aggregate_counts,
    default_threshold_trials,
    fit_phase,
    log_unreachable,
)

logger = logging.getLogger(__name__)


class CountCollector:
    """Sums [B, T, 2] trial counts over layers within one model forward, then emits one record per sequence.

    Prefill chunks of one request (`prompt_length`) share a sample id, so a chunked prompt is one sample, as if
    it had run whole; each decode step is a sample of its own length.
    """

    def __init__(self, scale_factors: list[float] | None = None, *, law=None):
        """Trials are scale factors (ModelOpt's law, γ = 1) or, with `law = [((c_prefill, c_decode), (γ_prefill,
        γ_decode)), ...]`, any per-row laws (e.g. one per target and law of a fitted calibration, to measure exactly
        what serving each would drop)."""
        if (scale_factors is None) == (law is None):
            raise ValueError("give exactly one of scale_factors and law")
        self.scale_factors = None if scale_factors is None else list(scale_factors)
        self.law = law
        self.records: list[CalibrationRecord] = []
        self._step: dict[tuple[str, int], torch.Tensor] = {}
        self._step_id = 0

    def add(self, phase: str, kv_len: int, counts: torch.Tensor, request: int | None = None) -> None:
        key = (phase, kv_len, request if phase == "prefill" else None)
        prev = self._step.get(key)
        self._step[key] = counts if prev is None else prev + counts

    def end_step(self) -> None:
        for (phase, kv_len, request), counts in self._step.items():
            sample = ("step", self._step_id) if request is None else ("request", request)
            for b, per_seq in enumerate(counts.cpu()):
                self.records.append(CalibrationRecord(phase, kv_len, per_seq, seq_id=(*sample, b)))
        self._step.clear()
        self._step_id += 1

    def phase_counts(self) -> dict[str, int]:
        return {p: sum(1 for r in self.records if r.phase == p) for p in PHASES}


@torch.no_grad()
def run_sample(model: nn.Module, input_ids: torch.Tensor, *, chunk_size: int, decode_tokens: int) -> torch.Tensor:
    """Prefill `input_ids` [1, L] in chunks through a DynamicCache, then greedy-generate `decode_tokens` tokens
    (the first from the prefill, then `decode_tokens - 1` decode steps: what vLLM runs for `max_tokens`).

    Chunking bounds memory for long prompts and measures prefill at kv_len > q_len as chunked serving runs it.
    Returns the generated token ids [1, decode_tokens].
    """
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    length = input_ids.shape[1]
    out = None
    generated = []
    with prompt_length(length):  # chunks get the prompt's λ, as vLLM serves them
        for start in range(0, length, chunk_size):
            chunk = input_ids[:, start : start + chunk_size]
            out = model(chunk, past_key_values=cache, use_cache=True, logits_to_keep=1)
        next_token = out.logits[:, -1].argmax(-1, keepdim=True)
        for step in range(decode_tokens):
            generated.append(next_token)
            if step == decode_tokens - 1:
                break  # as vLLM's max_tokens: the first token comes from the prefill, so N tokens = N-1 decode steps
            out = model(next_token, past_key_values=cache, use_cache=True, logits_to_keep=1)
            next_token = out.logits[:, -1].argmax(-1, keepdim=True)
    return torch.cat(generated, dim=1) if generated else input_ids.new_zeros(1, 0)


def make_forward_loop(tokenizer: Any, cfg: SkipSoftmaxCalibrationConfig) -> Callable[[nn.Module], None]:
    """Forward loop over the shared RULER-style prompts (calibration.data), one unpadded sequence at a time."""
    from .data import build_calibration_prompts

    samples = build_calibration_prompts(
        tokenizer,
        num_samples=cfg.samples,
        max_seqlen=cfg.max_seqlen,
        min_seqlen=min(cfg.min_seqlen, cfg.max_seqlen),
        seed=cfg.seed,
        data_dir=cfg.data_dir,
        cache_dir=cfg.cache_dir,
    )

    def forward_loop(model: nn.Module) -> None:
        device = next(model.parameters()).device
        for i, sample in enumerate(samples):
            ids = tokenizer(sample.prompt, return_tensors="pt").input_ids[:, : cfg.max_seqlen].to(device)
            logger.info("calibration sample %d/%d: %s, %d tokens", i + 1, len(samples), sample.task, ids.shape[1])
            run_sample(model, ids, chunk_size=cfg.chunk_size, decode_tokens=cfg.decode_tokens)

    return forward_loop


def collect_counts(
    model: nn.Module,
    states: Iterable[SparseAttentionState],
    forward_loop: Callable,
    scale_factors: list[float] | None = None,
    *,
    law=None,
) -> CountCollector:
    """Run `forward_loop(model)` with every state in calibration mode (dense output, counts per trial)."""
    states = list(states)
    collector = CountCollector(scale_factors, law=law)
    hook = model.register_forward_hook(lambda *_: collector.end_step())
    try:
        for state in states:
            state.collector = collector
        with torch.no_grad():
            forward_loop(model)
        collector.end_step()  # a loop that called submodules directly leaves counts pending
    finally:
        hook.remove()
        for state in states:
            state.collector = None
    return collector


def calibrate_sparse_attention(
    model: nn.Module,
    states: dict[str, SparseAttentionState],
    cfg: SkipSoftmaxCalibrationConfig,
    forward_loop: Callable[[nn.Module], None],
) -> dict[str, PhaseFit]:
    """Measure, fit each phase with a positive target, and store the calibration on every enabled module."""
    if not states:
        raise ValueError("no enabled sparse attention module to calibrate; check the sparse_cfg patterns")
    trials = cfg.threshold_trials or default_threshold_trials()
    was_training = model.training
    model.eval()
    try:
        collector = collect_counts(model, states.values(), forward_loop, trials)
    finally:
        model.train(was_training)
    points = aggregate_counts(collector.records, trials)
    fits: dict[str, PhaseFit] = {}
    for phase in PHASES:
        target = cfg.target_sparse_ratio[phase]
        if target <= 0:
            continue
        try:
            fits[phase] = fit_phase(points[phase], phase=phase)
        except CalibrationFitError as exc:
            raise CalibrationFitError(
                f"{exc}. Settings: sparse_cfg['calibration'] threshold_trials ({len(trials)} trials, "
                f"{trials[0]:g}..{trials[-1]:g}), samples, max_seqlen, decode_tokens; or set "
                f"target_sparse_ratio.{phase}=0 to leave {phase} dense"
            ) from None
    for state in states.values():
        for phase in PHASES:
            fit = fits.get(phase)
            state.calibration[phase] = None if fit is None else fit.to_phase_calibration(cfg.target_sparse_ratio[phase])
    for phase, fit in fits.items():
        log_unreachable(fit, cfg.target_sparse_ratio[phase], "calibration: ")
        logger.info(
            "calibrated %s: a=%.6g b=%.4f (R²=%.3f, %d points) target %.2f -> scale factor %.4g",
            phase, fit.a, fit.b, fit.r2, fit.n_points, cfg.target_sparse_ratio[phase],
            fit.scale_factor(cfg.target_sparse_ratio[phase]),
        )  # fmt: skip
    return fits
