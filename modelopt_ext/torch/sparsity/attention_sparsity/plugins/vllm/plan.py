"""The per-step sparse plan: what every sparse layer of a step needs, prepared once by the metadata builder.

A sparse backend's metadata builder (plugins/vllm/backends/base.py) owns one `SparsePlanner` and, in `build`, puts a
`SparsePlan` in the metadata it returns (the declared field `PLAN_ATTR` of the sparse metadata classes). Each layer's
forward then only runs the kernel with the plan's tensors, through the kernels' internal launch entry
(`kernel_launcher`): everything a step needs is normalised here, once, into the form the kernels take, so `forward`
does no validation, no normalisation, no host synchronisation and no copy of the query.

The planner holds one object per concern, each with its own small state:

- `StepGeometry` (plugins/vllm/step_geometry.py): prompt lengths, phases and the law's length n per sequence;
- `LawRows` (plugins/vllm/law_rows.py): each row's law, (c, γ) per phase, and decode feedback;
- `CalibrationTrials` (plugins/vllm/calibration_trials.py): calibration's per-trial law table;
- `SplitKWorkspace` (here): the Triton decode kernel's persistent split-K workspace.

CUDA graphs. Every tensor of a plan is a view of a persistent buffer sized by `max_num_seqs` and allocated when the
builder is created; `build` writes into them in place. The law buffers depend only on the settings (and the batch's
own targets) and are rewritten only when those change; the serving counts and the split-K workspace are persistent
too.
When the builder runs full decode graphs (plugins/vllm/cudagraphs.py), a uniform decode batch gets a
capture-safe plan (`graph_bound`): the kernel's decode grid is sized from `max_model_len` instead of this step's
longest sequence, and no host decision picks the dense path (the kernel itself drops nothing where λ says so), so
a graph captured from one step replays correctly with the next step's buffers.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from modelopt_ext.torch.kernels.sparsity.attention.semantics import decode_workspace_numel

from .calibration_trials import CalibrationTrials
from .law_rows import LawRows
from .step_geometry import StepGeometry

logger = logging.getLogger(__name__)

PLAN_ATTR = "modelopt_sparse_plan"
"""Name of the `SparsePlan` field of the sparse metadata classes (plugins/vllm/backends/)."""


@dataclasses.dataclass(eq=False)
class SparsePlan:
    """Tensors of one step, sliced to its B sequences (views of the planner's persistent buffers)."""

    num_reqs: int
    block_table: torch.Tensor  # [B, max_pages] int32
    seq_lens: torch.Tensor  # [B] int32, new tokens included
    query_start_loc: torch.Tensor  # [B + 1] int32
    max_query_len: int
    max_seq_len: int  # host bound on seq_lens (the kernel's split-K workspace hint)
    prompt_lens: torch.Tensor  # [B] int32
    is_decode: torch.Tensor  # [B] bool: the sequence's first new row is at or past its prompt length
    phase_index: torch.Tensor  # [B] int64: 0 prefill, 1 decode (same as is_decode)
    law_lens: torch.Tensor  # [B] int64: n of the law (prompt_len for prefill sequences, kv_len for decode)
    log_scale_factors: torch.Tensor | None = None  # serve: [B, 2] float32
    length_exponents: torch.Tensor | None = None  # [B, 2] float32
    trial_log_scale_factors: torch.Tensor | None = None  # calibrate: [B, T, 2] float32
    kernel_log_sf: torch.Tensor | None = None  # the law in the kernels' form: [B, 1, 2] (serve) or [B, T, 2]
    calibrate: bool = False
    dense: bool = False  # serve: no row of this step can drop a tile (decided on the host)
    decode_only: bool = False  # every sequence has one new row (or none: padding): the kernel skips its prefill grid
    counts: torch.Tensor | None = None  # serve: [B, 1, 2] int64 persistent counts the kernel zeroes and fills
    workspace: tuple | None = None  # the Triton kernel's persistent split-K workspace (None: it allocates)
    request_index: torch.Tensor | None = None  # serve: [B] int64 row of each sequence in `request_table`
    request_table: torch.Tensor | None = None  # serve: [slots·2, 2] int64 per-request counts (request_stats.py)
    prompt_lens_from: str = "kernel default"  # where prompt_lens came from this step
    _record_keys: tuple | None = dataclasses.field(default=None, repr=False)

    def record_keys(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(law lengths, is_decode) of this step, copied once (the buffers are reused next step), shared by layers."""
        if self._record_keys is None:
            self._record_keys = (self.law_lens.clone(), self.is_decode.clone())
        return self._record_keys


class SplitKWorkspace:
    """The Triton decode kernel's split-K workspace, allocated once for the planner's capacity."""

    def __init__(self) -> None:
        self.tensors: tuple[torch.Tensor, torch.Tensor] | None = None  # (accumulators, max/sum)
        self.shape: tuple[int, int, int] | None = None  # (num_heads, head_size, max_model_len) it was reserved for

    def reserve(self, capacity: int, num_heads: int, head_size: int, max_model_len: int, device) -> int:
        """Allocate for `capacity` sequences of up to `max_model_len` keys; the size in bytes (0: one split)."""
        self.shape = (num_heads, head_size, max_model_len)
        acc, ml = decode_workspace_numel(capacity, num_heads, head_size, max_model_len)
        if acc <= 1:
            self.tensors = None
            return 0
        self.tensors = tuple(torch.empty(n, dtype=torch.float32, device=device) for n in (acc, ml))
        return 4 * (acc + ml)


class SparsePlanner:
    """Persistent plan buffers of one metadata builder, and the per-step `plan()` that fills them."""

    def __init__(self, max_num_seqs: int, device) -> None:
        self.device = torch.device(device)
        self.split_k = SplitKWorkspace()
        self._allocate(max(1, int(max_num_seqs)))

    def _allocate(self, capacity: int) -> None:
        self.capacity = capacity
        self.geometry = StepGeometry(capacity, self.device)
        self.laws = LawRows(capacity, self.device)
        self.trials = CalibrationTrials(capacity, self.device)
        self.counts = torch.zeros(capacity, 1, 2, dtype=torch.int64, device=self.device)
        self._law_key = None

    @property
    def workspace(self):
        return self.split_k.tensors

    def reserve_workspace(self, num_heads: int, head_size: int, max_model_len: int) -> int:
        """Allocate the Triton decode kernel's split-K workspace once, for `capacity` sequences of up to
        `max_model_len` keys; returns its size in bytes (0 when every sequence fits one split)."""
        return self.split_k.reserve(self.capacity, num_heads, head_size, max_model_len, self.device)

    def _ensure_capacity(self, num_reqs: int) -> None:
        if num_reqs > self.capacity:  # vLLM never exceeds max_num_seqs; tests and direct use might
            logger.warning("sparse plan: %d sequences > max_num_seqs %d; growing the plan buffers (new addresses)",
                           num_reqs, self.capacity)
            self._allocate(max(num_reqs, 2 * self.capacity))
            if self.split_k.shape is not None:
                self.reserve_workspace(*self.split_k.shape)

    def _serving_laws(self, context, cam, b: int):
        """Fill the law buffers for a serving step; the step's per-request laws (None: the checkpoint's)."""
        rows = context.request_laws(b, context, cam) if context.request_laws is not None else None
        key = (id(context), context.version)
        if rows is not None:
            self.laws.write(rows, b)
        elif self._law_key != key or self.laws.written is not None:
            self.laws.fill(context.law())
        self._law_key = key
        self.trials.forget()
        return rows

    def plan(self, context, common_attn_metadata, graph_bound: int | None = None) -> SparsePlan:
        """Fill the buffers for this step from vLLM's `CommonAttentionMetadata` and the engine's context.

        `graph_bound` (the engine's `max_model_len`): this step may be captured in, or replay, a full decode graph,
        so the plan must not depend on this step's lengths on the host (see the module docstring).
        """
        cam = common_attn_metadata
        b = int(cam.num_reqs)
        self._ensure_capacity(b)
        if context.calibrating:
            self.trials.refresh(context, self.laws)
            self._law_key = None
        else:
            rows = self._serving_laws(context, cam, b)
        source, longest_prompt = self.geometry.fill(context, cam, b)
        geometry = self.geometry
        max_query_len = int(cam.max_query_len)
        max_seq_len = int(cam.max_seq_len) if graph_bound is None else int(graph_bound)
        plan = SparsePlan(
            num_reqs=b,
            block_table=cam.block_table_tensor[:b],
            seq_lens=cam.seq_lens[:b],
            query_start_loc=cam.query_start_loc[: b + 1],
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            prompt_lens=geometry.prompt_lens[:b],
            is_decode=geometry.is_decode[:b],
            phase_index=geometry.phase_index[:b],
            law_lens=geometry.law_lens[:b],
            length_exponents=self.laws.gamma[:b],
            prompt_lens_from=source,
            decode_only=max_query_len <= 1,
            workspace=self.workspace,
        )
        if context.calibrating:
            plan.trial_log_scale_factors = plan.kernel_log_sf = self.trials.fill(geometry.law_lens, b)
            plan.calibrate = True
        else:
            self._serving_fields(plan, context, cam, rows is not None, graph_bound, max(max_seq_len, longest_prompt))
        return plan

    def _serving_fields(self, plan: SparsePlan, context, cam, own_rows: bool, graph_bound, longest: int) -> None:
        """The law, the counters (per phase and per request), decode feedback, and the host's dense decision."""
        b = plan.num_reqs
        plan.log_scale_factors = self.laws.c[:b]
        plan.kernel_log_sf = plan.log_scale_factors.unsqueeze(1)
        plan.counts = self.counts[:b]
        counters = context.request_counters
        if counters is not None and context.track_sparsity:
            plan.request_index = counters.step(b, self.capacity, plan.phase_index, self.device, cam)
            plan.request_table = counters.flat_table
            if own_rows and self.laws.feedback_on:
                self.laws.apply_feedback(counters, b)
        if graph_bound is None:  # eager: the dense path when no row can drop a tile (feedback rows: at any δ)
            plan.dense = not self.laws.can_drop(longest)
