"""Which request each row of a step's metadata belongs to, as model runner V1 or V2 keeps it.

The per-request law source (plugins/vllm/request_targets.py) and the per-request counters
(plugins/vllm/request_stats.py) both tie metadata rows to requests through one of these views.
"""

from __future__ import annotations

import weakref
from typing import Any

from .compat import v2_row_slots, v2_row_slots_problem


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
