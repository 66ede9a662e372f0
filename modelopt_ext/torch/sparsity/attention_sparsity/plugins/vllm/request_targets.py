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

Decode feedback. With `sparse_attn_decode_feedback` on, the request's decode rows get an offset δ on c (ln λ = c + δ
- γ·ln n), updated on the device once per step from the request's own decode counts of the previous step
(plugins/vllm/request_stats.py): δ += η·b·(target - realized), bounded by |δ| ≤ 0.3·b, where b is the decode law's
slope (∂c/∂target, so b·error is the correction the law itself predicts) and η = 0.3 smooths token-to-token noise.
It depends only on the request's own history, so a request's tokens still do not depend on the batch.

Where it is checked: at admission (plugins/vllm/admission.py, an HTTP 400 on the server, a ValueError from
`LLM.generate`), before the request reaches the engine. The worker parses again when a request enters the batch
(`RequestLaws`); a value that fails there (an engine without the admission check) is logged as a warning with the
request id and the request is served at the checkpoint's targets.
"""

from __future__ import annotations

import difflib
import logging
import math
import weakref
from collections.abc import Mapping
from typing import Any

import numpy as np

from ...checkpoint.config_io import SparseAttentionSettings
from ...request_keys import DENSE, FEEDBACK_KEY, KEY_PREFIX, KEYS, PHASE_TARGET_KEYS, TARGET_KEY
from .compat import v2_row_slots, v2_row_slots_problem
from .context import PHASES, phase_law

logger = logging.getLogger(__name__)

_TRUE, _FALSE = ("1", "true", "on", "yes"), ("0", "false", "off", "no")

Law = tuple[float, float, float, float]  # (c_prefill, c_decode, γ_prefill, γ_decode): ln λ = c - γ·ln n
Row = tuple[float, float, float, float, float, float]  # Law + (decode feedback target, feedback gain b; 0: off)
ROW_WIDTH = 6


class RequestTargetError(ValueError):
    """A request's sparse-attention keys are malformed or outside what the checkpoint's calibration covers."""


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
    laws = {}
    for phase in PHASES:
        calib = settings.phase(phase) if settings is not None else None
        if phase not in targets:
            laws[phase] = phase_law(calib)
            continue
        target, key = targets[phase]
        if target is None:
            laws[phase] = (-math.inf, 1.0)
            continue
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
        laws[phase] = phase_law(calib.at_target(target))
    return laws["prefill"][0], laws["decode"][0], laws["prefill"][1], laws["decode"][1]


def validate_request(extra_args: Mapping[str, Any] | None, settings: SparseAttentionSettings | None) -> Law | None:
    """A request's own law, or None when it sets no key; RequestTargetError (a ValueError) when it is invalid."""
    targets = requested_targets(extra_args)
    return None if targets is None else request_law(targets, settings)


def feedback_requested(extra_args: Mapping[str, Any] | None) -> bool:
    """Whether a request turns decode feedback on (`sparse_attn_decode_feedback`: a bool, 0/1 or a string)."""
    raw = (extra_args or {}).get(FEEDBACK_KEY, False)
    text = str(raw).strip().lower() if isinstance(raw, (str, bool, int)) and not isinstance(raw, float) else None
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise RequestTargetError(f"{FEEDBACK_KEY}={raw!r}: expected true or false")


def request_row(extra_args: Mapping[str, Any] | None, settings: SparseAttentionSettings | None) -> Row | None:
    """A request's row for the plan: its law and its decode feedback (target, gain b; gain 0 when off); None when
    it sets no key. RequestTargetError when invalid (feedback needs a calibrated, non-dense decode target)."""
    targets = requested_targets(extra_args)
    if targets is None:
        return None
    law = request_law(targets, settings)
    if not feedback_requested(extra_args):
        return (*law, 0.0, 0.0)
    calib = settings.decode if settings is not None else None
    target = targets["decode"][0] if "decode" in targets else (calib.target_sparsity if calib is not None else None)
    if calib is None or calib.a == 0.0 or calib.is_static or target is None or not math.isfinite(law[1]):
        raise RequestTargetError(f"{FEEDBACK_KEY}: feedback holds a decode target, and this request's decode is "
                                 "served dense or the checkpoint calibrates no decode law; drop the key or set "
                                 "sparse_attn_decode_target")
    return (*law, float(target), float(calib.b))


def checkpoint_law(settings: SparseAttentionSettings | None) -> Law:
    """The law of a request that sets no target."""
    return request_law({}, settings)


class V1Rows:
    """Model runner V1: metadata row i is the persistent batch's row i (`input_batch.req_ids`), and a request's
    params are `requests[id].sampling_params`."""

    name = "input_batch.req_ids + requests[...].sampling_params (model runner V1)"

    def __init__(self, runner) -> None:
        self._runner = runner

    def row_ids(self, num_reqs: int, common_attn_metadata=None) -> list:
        batch = self._runner.input_batch
        return list(batch.req_ids[: min(int(num_reqs), int(batch.num_reqs))])

    def extra_args(self, req_id: str):
        params = getattr(self._runner.requests.get(req_id), "sampling_params", None)
        return getattr(params, "extra_args", None)

    def is_live(self, req_id: str) -> bool:
        return req_id in self._runner.requests


# Model runner V2 keeps no request's SamplingParams where the plan can read them: its sampler hands each new
# request's params to every custom logits processor (`add_request(slot, params)`, plugins/vllm/admission.py), which
# records the extra_args per request-table slot here. The processor is built with a `LogitsProcRequestState` that
# wraps the runner's own per-slot buffers, so one runner's table is keyed by its `req_states.prompt_len` buffer.
_V2_SLOT_ARGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def v2_slot_args(req_states) -> dict[int, Any]:
    """The extra_args per request slot of one V2 runner (`req_states`: the runner's, or the processor's
    `LogitsProcRequestState` view of it), filled by the admission processor in its worker."""
    key = req_states.prompt_len
    table = _V2_SLOT_ARGS.get(key)
    if table is None:
        table = _V2_SLOT_ARGS[key] = {}
    return table


class V2Rows:
    """Model runner V2: `CommonAttentionMetadata.req_idx` maps metadata rows to request-table slots,
    `req_states.index_to_req_id` names each slot's request, and the slot's extra_args come from the admission
    processor's `add_request` (`v2_slot_args`)."""

    name = "req_states.index_to_req_id[req_idx] + the logits processor's add_request (model runner V2)"

    def __init__(self, runner) -> None:
        self._states = runner.req_states

    def row_ids(self, num_reqs: int, common_attn_metadata=None) -> list:
        slots = v2_row_slots(common_attn_metadata, num_reqs)
        if slots is None:  # a dummy or profiling run: no request's rows
            return []
        names = self._states.index_to_req_id
        return [names.get(slot) for slot in slots.tolist()]

    def extra_args(self, req_id: str):
        slot = self._states.req_id_to_index.get(req_id)
        return None if slot is None else v2_slot_args(self._states).get(slot)

    def is_live(self, req_id: str) -> bool:
        return req_id in self._states.req_id_to_index


def request_rows(runner):
    """`(view, reason)`: how this runner ties metadata rows to requests (`V1Rows` / `V2Rows`), or None and why."""
    if runner is None:
        return None, "no model runner given (direct install)"
    batch = getattr(runner, "input_batch", None)
    if batch is not None and hasattr(batch, "req_ids") and isinstance(getattr(runner, "requests", None), dict):
        return V1Rows(runner), None
    states = getattr(runner, "req_states", None)
    if states is not None and hasattr(states, "index_to_req_id") and hasattr(states, "req_id_to_index"):
        problem = v2_row_slots_problem()
        return (None, problem) if problem else (V2Rows(runner), None)
    return None, f"{type(runner).__name__} is neither vLLM's model runner V1 nor V2 as the plugin reads them"


class RequestLaws:
    """Each row's law and decode feedback (`Row`) for this step, from its request's `extra_args` (rows tied to
    requests by a `V1Rows` / `V2Rows` view).

    Called once per step by the planner (not per layer). The per-request parse is cached by request id, and the
    whole table by the batch's request ids, so a step whose batch did not change costs one list comparison.
    Returns None when no request of the step sets its own target (the checkpoint's law then fills the buffers).
    """

    def __init__(self, runner, rows=None) -> None:
        self._rows = rows if rows is not None else request_rows(runner)[0]
        self.name = self._rows.name
        self._parsed: dict[str, Law | None] = {}
        self._last_ids: list | None = None
        self._last_key = None
        self._last_table: np.ndarray | None = None

    def _law_of(self, req_id: str, settings) -> Row | None:
        if req_id in self._parsed:
            return self._parsed[req_id]
        law = None
        try:
            law = request_row(self._rows.extra_args(req_id), settings)
        except RequestTargetError as exc:
            logger.warning("request %s: %s; served at the checkpoint's targets", req_id, exc)
        self._parsed[req_id] = law
        return law

    def __call__(self, num_reqs: int, context, common_attn_metadata=None) -> np.ndarray | None:
        ids = self._rows.row_ids(num_reqs, common_attn_metadata)
        key = (context.version, id(context.settings), int(num_reqs))
        if key == self._last_key and ids == self._last_ids:
            return self._last_table
        if key[:2] != (self._last_key or (None, None))[:2]:
            self._parsed.clear()  # the engine was reconfigured: the checkpoint's law (and its ranges) changed
        else:  # forget requests that left the batch (a preempted one is parsed again when it returns)
            self._parsed = {rid: self._parsed[rid] for rid in ids if rid in self._parsed}
        laws = [self._law_of(rid, context.settings) if rid is not None else None for rid in ids]
        table = None
        if any(law is not None for law in laws):
            table = np.empty((int(num_reqs), ROW_WIDTH), dtype=np.float32)
            table[:] = (*checkpoint_law(context.settings), 0.0, 0.0)
            for row, law in enumerate(laws):
                if law is not None:
                    table[row] = law
        self._last_ids, self._last_key, self._last_table = ids, key, table
        return table


def request_laws_source(runner):
    """`(source, reason)`: the per-request law source of this runner, or None and why there is none."""
    rows, reason = request_rows(runner)
    return (RequestLaws(runner, rows), None) if rows is not None else (None, reason)
