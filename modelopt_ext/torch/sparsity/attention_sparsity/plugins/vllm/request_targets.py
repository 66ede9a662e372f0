"""Per-request targets: a request chooses its own sparsity per phase, through vLLM's per-request channel.

A request sets flat keys in `SamplingParams.extra_args` (on vLLM's OpenAI server: the request's `vllm_xargs`, which
carries strings and numbers):

    sparse_attn_target            both phases
    sparse_attn_prefill_target    prefill only (wins over sparse_attn_target)
    sparse_attn_decode_target     decode only (wins over sparse_attn_target)
    sparse_attn_decode_feedback   true / false: hold the decode target by feedback (below; default false)

A value is a target sparsity (a number, or a string holding one) or "dense"; 0 also means dense. A target must lie
inside what the checkpoint's calibration observed for that phase (`observed_sparsity_range`; (0, 1) when the
checkpoint does not carry it, e.g. one exported by ModelOpt), and the phase must be calibrated. The request's rows
are then served with the checkpoint's law at that target (`PhaseCalibration.at_target`: ln a + b·target and the
target's γ); the other requests of the batch keep the checkpoint's targets, and since every row's law depends only
on its own request, their outputs do not change.

Decode feedback (`sparse_attn_decode_feedback`): the request's decode rows hold its decode target by an offset
updated on the device from its own counts; plugins/vllm/feedback.py says how.

Where it is checked: at admission (plugins/vllm/admission.py, an HTTP 400 on the server, a ValueError from
`LLM.generate`), before the request reaches the engine. The worker parses again when a request enters the batch
(`RequestLaws`); a value that fails there (an engine without the admission check) is logged as a warning with the
request id and the request is served at the checkpoint's targets.
"""

from __future__ import annotations

import difflib
import logging
import math
from collections.abc import Mapping
from typing import Any

from ...checkpoint.config_io import SparseAttentionSettings
from ...checkpoint.law import DENSE as DENSE_PHASE
from ...checkpoint.law import PHASES, Law, PhaseLaw
from ...request_keys import DENSE, KEY_PREFIX, KEYS, PHASE_TARGET_KEYS, TARGET_KEY, RequestTargetError
from .feedback import decode_feedback
from .law_rows import RequestLaw
from .request_rows import request_rows

__all__ = ["RequestLaws", "RequestTargetError", "request_law", "request_law_of", "request_laws_source",
           "requested_targets", "validate_request"]

logger = logging.getLogger(__name__)


def _value(key: str, raw: Any) -> float | None:
    """A target from one key's value: None for dense, else a float in (0, 1)."""
    if isinstance(raw, str):
        text = raw.strip().lower()
        if text == DENSE:
            return None
        try:
            raw = float(text)
        except ValueError:
            raise RequestTargetError(f"{key}={raw!r}: expected a target sparsity in [0, 1) or 'dense'") from None
    if isinstance(raw, bool) or not isinstance(raw, (int, float)):
        raise RequestTargetError(f"{key}={raw!r}: expected a target sparsity in [0, 1) or 'dense'")
    value = float(raw)
    if not math.isfinite(value) or not 0.0 <= value < 1.0:
        raise RequestTargetError(f"{key}={raw!r}: a target sparsity lies in [0, 1) (0 or 'dense': dense attention)")
    return None if value == 0.0 else value


def requested_targets(extra_args: Mapping[str, Any] | None) -> dict[str, tuple[float | None, str]] | None:
    """The phases a request sets, phase -> (target (None: dense), the key that set it); None when it sets none of
    our keys.

    A key with our prefix that is not one of ours is an error (a typo must not be served at the default).
    """
    if not extra_args:
        return None
    ours = {k: v for k, v in extra_args.items() if isinstance(k, str) and k.startswith(KEY_PREFIX)}
    if not ours:
        return None
    for key in ours:
        if key not in KEYS:
            near = difflib.get_close_matches(key, KEYS, n=1)
            hint = f" (did you mean {near[0]}?)" if near else f" (known: {', '.join(KEYS)})"
            raise RequestTargetError(f"unknown per-request sparse-attention key {key!r}{hint}")
    targets: dict[str, tuple[float | None, str]] = {}  # empty when only the feedback switch is set
    if TARGET_KEY in ours:
        both = _value(TARGET_KEY, ours[TARGET_KEY])
        targets = {phase: (both, TARGET_KEY) for phase in PHASES}
    for phase, key in PHASE_TARGET_KEYS.items():
        if key in ours:
            targets[phase] = (_value(key, ours[key]), key)
    return targets


def request_law(targets: Mapping[str, tuple[float | None, str]], settings: SparseAttentionSettings | None) -> Law:
    """The law a request's rows are served with: its own targets where it sets them, the checkpoint's elsewhere."""
    law = Law.of(settings)
    for phase, (target, key) in targets.items():
        if target is None:
            law = law.replace(phase, DENSE_PHASE)
            continue
        calib = settings.phase(phase) if settings is not None else None
        if calib is None or calib.a == 0.0:
            raise RequestTargetError(f"{key}: this checkpoint calibrates no {phase} law, so {phase} is served dense; "
                                     f"ask for 'dense' or recalibrate {phase}")
        if calib.is_static:
            raise RequestTargetError(f"{key}: this checkpoint's {phase} threshold is static (not calibrated against "
                                     "sparsity), so no target can be chosen; recalibrate")
        lo, hi = calib.observed_sparsity_range or (0.0, 1.0)
        if not lo <= target <= hi:
            raise RequestTargetError(f"{key}={target:g}: outside what this checkpoint's {phase} calibration covers "
                                     f"[{lo:g}, {hi:g}]; choose a target inside it, or 'dense'")
        law = law.replace(phase, PhaseLaw.of(calib.at_target(target)))
    return law


def validate_request(extra_args: Mapping[str, Any] | None, settings: SparseAttentionSettings | None) -> Law | None:
    """A request's own law, or None when it sets no key; RequestTargetError (a ValueError) when it is invalid."""
    targets = requested_targets(extra_args)
    return None if targets is None else request_law(targets, settings)


def request_law_of(extra_args: Mapping[str, Any] | None, settings: SparseAttentionSettings | None) -> RequestLaw | None:
    """What a request's rows are served with: its law and its decode feedback; None when it sets no key.
    RequestTargetError when invalid (feedback needs a calibrated, non-dense decode target)."""
    targets = requested_targets(extra_args)
    if targets is None:
        return None
    law = request_law(targets, settings)
    decode_target = targets["decode"][0] if "decode" in targets else None
    return RequestLaw(law, decode_feedback(extra_args, decode_target, law, settings))


class RequestLaws:
    """Each row's `RequestLaw` for this step, from its request's `extra_args` (rows tied to requests by a
    `V1Rows` / `V2Rows` view, plugins/vllm/request_rows.py).

    Called once per step by the planner (not per layer). The per-request parse is cached by request id, and the
    whole tuple by the batch's request ids, so a step whose batch did not change costs one list comparison and
    returns the same tuple (the planner then writes nothing). Returns None when no request of the step sets its own
    target (the checkpoint's law then fills the buffers).
    """

    def __init__(self, runner, rows=None) -> None:
        self._rows = rows if rows is not None else request_rows(runner)[0]
        self.name = self._rows.name
        self._parsed: dict[str, RequestLaw | None] = {}
        self._last_ids: list | None = None
        self._last_key = None
        self._last_rows: tuple[RequestLaw, ...] | None = None

    def _law_of(self, req_id: str, settings) -> RequestLaw | None:
        if req_id in self._parsed:
            return self._parsed[req_id]
        law = None
        try:
            law = request_law_of(self._rows.extra_args(req_id), settings)
        except RequestTargetError as exc:
            logger.warning("request %s: %s; served at the checkpoint's targets", req_id, exc)
        self._parsed[req_id] = law
        return law

    def __call__(self, num_reqs: int, context, common_attn_metadata=None) -> tuple[RequestLaw, ...] | None:
        ids = self._rows.row_ids(num_reqs, common_attn_metadata)
        key = (context.version, id(context.settings), int(num_reqs))
        if key == self._last_key and ids == self._last_ids:
            return self._last_rows
        if key[:2] != (self._last_key or (None, None))[:2]:
            self._parsed.clear()  # the engine was reconfigured: the checkpoint's law (and its ranges) changed
        else:  # forget requests that left the batch (a preempted one is parsed again when it returns)
            self._parsed = {rid: self._parsed[rid] for rid in ids if rid in self._parsed}
        laws = [self._law_of(rid, context.settings) if rid is not None else None for rid in ids]
        rows = None
        if any(law is not None for law in laws):
            default = RequestLaw(Law.of(context.settings))  # rows of requests without keys, and padding rows
            laws += [None] * (int(num_reqs) - len(laws))
            rows = tuple(default if law is None else law for law in laws)
        self._last_ids, self._last_key, self._last_rows = ids, key, rows
        return rows


def request_laws_source(runner):
    """`(source, reason)`: the per-request law source of this runner, or None and why there is none."""
    rows, reason = request_rows(runner)
    return (RequestLaws(runner, rows), None) if rows is not None else (None, reason)
