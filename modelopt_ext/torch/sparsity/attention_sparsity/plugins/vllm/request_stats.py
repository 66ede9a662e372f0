"""Realized sparsity per request: visited and dropped row-tiles of each request, per phase, summed over layers.

One `RequestCounters` per engine (its context), fed by the serving kernels' per-sequence counts. No host sync and no
allocation on the device per step or layer:

- a device table [slots, phase, (visited, skipped)] int64, allocated once (`SLOTS_PER_SEQ` × max_num_seqs slots);
- each request gets a slot when it first appears in a step (host dict), and keeps it while vLLM keeps its state
  (a preempted request keeps its counts: model runner V1 keeps its state, V2 drops it and re-adds the request
  later, whose counts then continue from those copied out);
- per step the planner writes each row's flat index (slot·2 + phase) into a persistent device buffer (pinned
  staging, one non-blocking copy, only when the batch changed) and every sparse layer adds its per-row counts there
  with one `index_add_` (capturable in CUDA graphs: fixed addresses);
- a request that left vLLM's runner (finished or aborted) has its row copied, non-blocking, to host memory and its
  slot zeroed and freed; the last `KEEP_FINISHED` finished requests are kept for `snapshot()`, which syncs once.

Counts are this worker's: with tensor parallelism each rank counts its own heads (sum the ranks, as for the layer
counters). Steps in which no row can drop a tile run vLLM's native forward and are not counted.
"""

from __future__ import annotations

import logging
import re
from collections import OrderedDict

import numpy as np
import torch

from .feedback import FeedbackState
from .request_rows import request_rows

logger = logging.getLogger(__name__)

SLOTS_PER_SEQ = 4  # slots per max_num_seqs: running requests plus preempted ones that keep their counts
KEEP_FINISHED = 4096
_ENGINE_SUFFIX = re.compile(r"-[0-9a-f]{8}$")  # vLLM's InputProcessor appends "-<8 hex>" to the user's request id
PHASES = ("prefill", "decode")


def user_request_id(engine_id: str) -> str:
    """The id the user gave (or vLLM's output reports) for an engine-side request id."""
    return _ENGINE_SUFFIX.sub("", engine_id)


class RequestCounters:
    """Per-request counts of one engine, on the device; see the module docstring."""

    def __init__(self, runner, rows=None) -> None:
        self._rows = rows if rows is not None else request_rows(runner)[0]  # V1Rows / V2Rows
        self.table: torch.Tensor | None = None  # [slots + 1, 2, 2]; the last slot absorbs overflow, never reported
        self.flat_index: torch.Tensor | None = None  # [capacity] int64: slot·2 + phase of each row of this step
        self._slot_of: dict[str, int] = {}
        self._free: list[int] = []
        self._finished: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._host_slots: list[torch.Tensor] = []
        self._slots_dev: torch.Tensor | None = None
        self._turn = 0
        self._last_ids: list | None = None
        self._overflow_logged = False

    def _allocate(self, capacity: int, device: torch.device) -> None:
        slots = SLOTS_PER_SEQ * capacity
        self.table = torch.zeros(slots + 1, 2, 2, dtype=torch.int64, device=device)
        self._flat_table = self.table.view(-1, 2)
        self.feedback = FeedbackState(slots + 1, device)  # decode feedback δ per slot (plugins/vllm/feedback.py)
        self.flat_index = torch.zeros(capacity, dtype=torch.int64, device=device)
        self._slots_dev = torch.zeros(capacity, dtype=torch.int64, device=device)
        pin = device.type == "cuda"
        self._host_slots = [torch.zeros(capacity, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._free = list(range(slots - 1, -1, -1))
        self._slot_of.clear()
        self._last_ids = None

    @property
    def flat_table(self) -> torch.Tensor:
        return self._flat_table

    def _slot(self, req_id: str) -> int:
        slot = self._slot_of.get(req_id)
        if slot is None:
            if self._free:
                slot = self._slot_of[req_id] = self._free.pop()
                earlier = self._finished.pop(req_id, None)
                if earlier is not None:  # model runner V2 drops a preempted request's state; it returns by its id
                    self.table[slot].copy_(earlier, non_blocking=True)
                    self.feedback.resume(slot, earlier[1])
            else:
                slot = self.table.shape[0] - 1
                if not self._overflow_logged:
                    self._overflow_logged = True
                    logger.warning("per-request sparsity: more than %d requests hold counters (preempted ones keep "
                                   "theirs); request %s and later ones beyond that are not counted per request",
                                   self.table.shape[0] - 1, req_id)  # fmt: skip
        return slot

    def _finish(self, req_id: str) -> None:
        slot = self._slot_of.pop(req_id)
        host = torch.empty(2, 2, dtype=torch.int64, pin_memory=self.table.is_cuda)
        host.copy_(self.table[slot], non_blocking=True)
        self.table[slot].zero_()
        self.feedback.forget(slot)
        self._free.append(slot)
        self._finished[req_id] = host
        while len(self._finished) > KEEP_FINISHED:
            self._finished.popitem(last=False)

    def step(self, num_reqs: int, capacity: int, phase_index: torch.Tensor, device,
             common_attn_metadata=None) -> torch.Tensor:  # fmt: skip
        """Each row's flat index into the table for this step (a view of a persistent buffer)."""
        if self.table is None or self.flat_index.shape[0] < capacity:
            self._allocate(capacity, torch.device(device))
        ids = self._rows.row_ids(num_reqs, common_attn_metadata)
        live = len(ids)
        if ids != self._last_ids:
            present = set(ids)
            for req_id in [r for r in self._slot_of if r not in present and not self._rows.is_live(r)]:
                self._finish(req_id)
            staging = self._host_slots[self._turn]
            self._turn ^= 1
            host = staging.numpy()
            host[: int(num_reqs)] = self.table.shape[0] - 1  # padding rows (no request): the overflow slot
            host[:live] = np.fromiter((self._slot(r) if r is not None else self.table.shape[0] - 1 for r in ids),
                                      dtype=np.int64, count=live)  # fmt: skip
            self._slots_dev[: int(num_reqs)].copy_(staging[: int(num_reqs)], non_blocking=True)
            self._last_ids = ids
        index = self.flat_index[: int(num_reqs)]
        torch.mul(self._slots_dev[: int(num_reqs)], 2, out=index)
        index.add_(phase_index)
        return index

    def decode_offsets(self, num_reqs: int, gain: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The decode feedback δ of this step's rows [B] (plugins/vllm/feedback.py), from their requests' counts."""
        b = int(num_reqs)
        return self.feedback.offsets(self.table[:, 1, :], self._slots_dev[:b], gain[:b], target[:b])

    def snapshot(self) -> dict[str, dict]:
        """{engine request id: {"finished": bool, "prefill"/"decode": {"visited", "skipped", "sparsity"}}}; syncs."""
        if self.table is None:
            return {}
        running = {rid: self.table[slot] for rid, slot in self._slot_of.items()}
        if self.table.is_cuda:
            torch.cuda.synchronize(self.table.device)
        out = {}
        for finished, rows in ((True, self._finished), (False, running)):
            for rid, counts in rows.items():
                values = counts.tolist()
                out[rid] = {"finished": finished, "user_request_id": user_request_id(rid)}
                for phase, (visited, skipped) in zip(PHASES, values, strict=True):
                    out[rid][phase] = {"visited": int(visited), "skipped": int(skipped),
                                       "sparsity": skipped / visited if visited else None}  # fmt: skip
        return out

    def reset(self) -> None:
        """Forget finished requests and zero the running ones' counts (in place)."""
        self._finished.clear()
        if self.table is not None:
            self.table.zero_()


def request_counters_source(runner):
    """A `RequestCounters` for this runner, or None where rows cannot be tied to requests (`request_rows`)."""
    rows, _ = request_rows(runner)
    return RequestCounters(runner, rows) if rows is not None else None
