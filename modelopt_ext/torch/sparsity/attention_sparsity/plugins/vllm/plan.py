"""The per-step sparse plan: what every sparse layer of a step needs, prepared once by the metadata builder.

A sparse backend's metadata builder (plugins/vllm/backends.py) owns one `SparsePlanner` and, in `build`, attaches a
`SparsePlan` to the metadata it returns (attribute `PLAN_ATTR`). Each layer's forward then only runs the kernel
with the plan's tensors, through the kernels' internal launch entry (`kernel_launcher`): everything a step needs is
normalised here, once, into the form the kernels take, so `forward` does no validation, no normalisation, no host
synchronisation and no copy of the query.

What the kernel gets per sequence (docs/skip_softmax.md, version 3; sinks are per layer, not planned):

- `prompt_lens` [B] int32: the request's prompt length (plugins/vllm/prompt_lens.py says where it comes from; the
  kernel's default rule where vLLM does not expose it). A row at `pos < prompt_len` is a prefill row.
- serving: `log_scale_factors` [B, 2] float32 = (c_prefill, c_decode), c = ln a + b·target (-inf: dense phase), and
  `length_exponents` [B, 2] = (γ_prefill, γ_decode); ln λ_row = c - γ·ln(n). The checkpoint's law in every row,
  except the rows of requests that set their own targets (plugins/vllm/request_targets.py): a step with such a
  request writes every row's law from the host, through pinned staging and one non-blocking copy per tensor.
- calibration: `log_scale_factors` [B, T, 2] = ln sf_t for both phases, `length_exponents` = 1: dense output and
  counts [B, T, 2] per trial.
- per sequence, for statistics and calibration records: its phase (decode iff its first new row is at or past
  `prompt_len`) and the law's length n (`prompt_len` for a prefill sequence, `kv_len` for a decode one).

CUDA graphs. Every tensor above is a view of a persistent buffer sized by `max_num_seqs` and allocated when the
builder is created; `build` writes into them in place (host prompt lengths through one of two pinned staging
buffers, used in turn, and one non-blocking copy; phases and lengths by device ops). The law buffers depend only on
the settings and are rewritten only when the settings change; the serving counts and the Triton kernel's split-K
workspace are persistent too.
When the builder runs full decode graphs (plugins/vllm/cudagraphs.py), a uniform decode batch gets a
capture-safe plan (`graph_bound`): the kernel's decode grid is sized from `max_model_len` instead of this step's
longest sequence, and no host decision picks the dense path (the kernel itself drops nothing where λ says so), so
a graph captured from one step replays correctly with the next step's buffers.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import numpy as np
import torch

from .request_stats import FEEDBACK_BOUND

logger = logging.getLogger(__name__)

PLAN_ATTR = "modelopt_sparse_plan"
"""Attribute name of the `SparsePlan` on a vLLM attention-metadata object."""


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


def _pin(t: torch.Tensor) -> torch.Tensor:
    try:
        return t.pin_memory() if torch.cuda.is_available() else t
    except RuntimeError:  # pragma: no cover - no pinnable memory
        return t


class SparsePlanner:
    """Persistent plan buffers of one metadata builder, and the per-step `plan()` that fills them."""

    def __init__(self, max_num_seqs: int, device) -> None:
        self.device = torch.device(device)
        self.capacity = 0
        self.workspace = None  # (accumulators, max/sum) for the Triton decode kernel (`reserve_workspace`)
        self._workspace_shape = None
        self._law_key = None
        self._trial_key = None
        self._allocate(max(1, int(max_num_seqs)))

    def _allocate(self, capacity: int) -> None:
        dev = self.device
        self.capacity = capacity
        self.prompt_lens = torch.zeros(capacity, dtype=torch.int32, device=dev)
        self.is_decode = torch.zeros(capacity, dtype=torch.bool, device=dev)
        self.phase_index = torch.zeros(capacity, dtype=torch.int64, device=dev)
        self.law_lens = torch.zeros(capacity, dtype=torch.int64, device=dev)
        self.log_scale_factors = torch.full((capacity, 2), -math.inf, dtype=torch.float32, device=dev)
        self.length_exponents = torch.ones(capacity, 2, dtype=torch.float32, device=dev)
        self.counts = torch.zeros(capacity, 1, 2, dtype=torch.int64, device=dev)
        self.trial_log_scale_factors = None
        # Two pinned staging buffers used in turn: with vLLM's async scheduling the host builds step t+1 while the
        # device may still have step t's non-blocking copy pending, which must not see its source overwritten.
        self._host_prompt_lens = [_pin(torch.zeros(capacity, dtype=torch.int32)) for _ in range(2)]
        # per-request rows, staged: (c, γ) per phase and the decode feedback (target, gain)
        self._host_laws = [_pin(torch.zeros(3, capacity, 2, dtype=torch.float32)) for _ in range(2)]
        self._base_c = torch.zeros(capacity, 2, dtype=torch.float32, device=dev)  # rows' c before feedback
        self._feedback = torch.zeros(capacity, 2, dtype=torch.float32, device=dev)  # (target, gain) per row
        self._feedback_on = False
        self._staging_turn = 0
        self._rows_written = None  # the per-request table the law buffers hold (None: the checkpoint's law)
        self._row_laws = ()  # its distinct laws, for the host's dense decision
        self._law_key = self._trial_key = None

    def _ensure_capacity(self, num_reqs: int) -> None:
        if num_reqs > self.capacity:  # vLLM never exceeds max_num_seqs; tests and direct use might
            logger.warning("sparse plan: %d sequences > max_num_seqs %d; growing the plan buffers (new addresses)",
                           num_reqs, self.capacity)
            self._allocate(max(num_reqs, 2 * self.capacity))
            if self._workspace_shape is not None:
                self.reserve_workspace(*self._workspace_shape)

    def reserve_workspace(self, num_heads: int, head_size: int, max_model_len: int) -> int:
        """Allocate the Triton decode kernel's split-K workspace once, for `capacity` sequences of up to
        `max_model_len` keys; returns its size in bytes (0 when every sequence fits one split)."""
        from modelopt_ext.torch.kernels.sparsity.attention.semantics import decode_workspace_numel

        self._workspace_shape = (num_heads, head_size, max_model_len)
        acc, ml = decode_workspace_numel(self.capacity, num_heads, head_size, max_model_len)
        if acc <= 1:
            self.workspace = None
            return 0
        self.workspace = tuple(torch.empty(n, dtype=torch.float32, device=self.device) for n in (acc, ml))
        return 4 * (acc + ml)

    def _refresh_law(self, context) -> None:
        key = (id(context), context.version)
        if self._rows_written is not None:
            self._law_key, self._rows_written, self._feedback_on = None, None, False
        if context.calibrating:
            if self._trial_key != key:
                if context.trial_laws:  # folded per sequence each step (plan): ln λ_t = c_t - γ_t·ln n, γ = 0
                    laws = torch.tensor(context.trial_laws, dtype=torch.float32, device=self.device)
                    self._trial_c, self._trial_gamma = laws[:, :2], laws[:, 2:]
                    self.trial_log_scale_factors = torch.zeros(self.capacity, len(laws), 2, device=self.device)
                    self.length_exponents.fill_(0.0)
                else:
                    log_sf = torch.tensor(context.trial_log_scale_factors(), dtype=torch.float32)
                    table = log_sf[None, :, None].expand(self.capacity, -1, 2)
                    self.trial_log_scale_factors = table.contiguous().to(self.device)
                    self.length_exponents.fill_(1.0)
                self._trial_key = key
                self._law_key = None
        elif self._law_key != key:
            (c_pre, c_dec), (g_pre, g_dec) = context.law()
            self.log_scale_factors[:, 0] = c_pre
            self.log_scale_factors[:, 1] = c_dec
            self.length_exponents[:, 0] = g_pre
            self.length_exponents[:, 1] = g_dec
            self._law_key = key
            self._trial_key = None

    def plan(self, context, common_attn_metadata, graph_bound: int | None = None) -> SparsePlan:
        """Fill the buffers for this step from vLLM's `CommonAttentionMetadata` and the engine's context.

        `graph_bound` (the engine's `max_model_len`): this step may be captured in, or replay, a full decode graph,
        so the plan must not depend on this step's lengths on the host (see the module docstring).
        """
        cam = common_attn_metadata
        b = int(cam.num_reqs)
        self._ensure_capacity(b)
        rows = None
        if context.request_laws is not None and not context.calibrating:
            rows = context.request_laws(b, context, cam)
        if rows is None:
            self._refresh_law(context)
        elif rows is not self._rows_written:  # the source returns the same table while the batch is unchanged
            self._write_rows(rows, b)
        seq_lens = cam.seq_lens[:b]
        qsl = cam.query_start_loc[: b + 1]
        q_lens = qsl[1:] - qsl[:-1]

        host = context.prompt_lens(cam) if context.prompt_lens is not None else None
        prompt = self.prompt_lens[:b]
        if host is not None:
            staging = self._host_prompt_lens[self._staging_turn][:b]
            staging.copy_(torch.from_numpy(np.ascontiguousarray(host[:b], dtype=np.int32)))
            prompt.copy_(staging, non_blocking=True)
            source = context.prompt_lens.name if hasattr(context.prompt_lens, "name") else "runner"
            longest_prompt = int(host[:b].max()) if b else 0
        else:  # the kernel's default (docs/skip_softmax.md): q_len == 1 decodes, longer queries are all prompt
            prompt.copy_(torch.where(q_lens == 1, seq_lens - 1, seq_lens))
            source, longest_prompt = "kernel default", 0
        decode = self.is_decode[:b]
        torch.ge(seq_lens - q_lens, prompt, out=decode)
        self.phase_index[:b].copy_(decode)
        self.law_lens[:b].copy_(torch.where(decode, seq_lens, prompt))

        max_query_len = int(cam.max_query_len)
        max_seq_len = int(cam.max_seq_len) if graph_bound is None else int(graph_bound)
        plan = SparsePlan(
            num_reqs=b,
            block_table=cam.block_table_tensor[:b],
            seq_lens=seq_lens,
            query_start_loc=qsl,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            prompt_lens=prompt,
            is_decode=decode,
            phase_index=self.phase_index[:b],
            law_lens=self.law_lens[:b],
            length_exponents=self.length_exponents[:b],
            prompt_lens_from=source,
            decode_only=max_query_len <= 1,
            workspace=self.workspace,
        )
        if context.calibrating:
            self._calibration_fields(plan, context, b)
        else:
            self._serving_fields(plan, context, cam, rows, graph_bound, max(max_seq_len, longest_prompt))
        self._staging_turn ^= 1
        return plan

    def _calibration_fields(self, plan: SparsePlan, context, b: int) -> None:
        """The per-trial law table: ln sf_t (γ = 1), or each trial's served law folded per sequence."""
        table = self.trial_log_scale_factors[:b]
        if context.trial_laws:
            # Every row of a sequence in this step has the sequence's law length, except in a chunk that
            # recomputes a preempted request's prompt and generated tokens (its generated rows then get the
            # prompt's length): exact for fidelity measurements, which never preempt.
            log_n = self.law_lens[:b].clamp(min=1).to(torch.float32).log()
            torch.sub(self._trial_c[None], self._trial_gamma[None] * log_n[:, None, None], out=table)
        plan.trial_log_scale_factors = plan.kernel_log_sf = table
        plan.calibrate = True

    def _serving_fields(self, plan: SparsePlan, context, cam, rows, graph_bound, longest: int) -> None:
        """The law, the counters (per phase and per request), decode feedback, and the host's dense decision."""
        b = plan.num_reqs
        plan.log_scale_factors = self.log_scale_factors[:b]
        plan.kernel_log_sf = plan.log_scale_factors.unsqueeze(1)
        plan.counts = self.counts[:b]
        feedback = self._feedback_on and rows is not None
        counters = context.request_counters
        if counters is not None and context.track_sparsity:
            plan.request_index = counters.step(b, self.capacity, plan.phase_index, self.device, cam)
            plan.request_table = counters.flat_table
            if feedback:  # decode feedback: c_decode = the row's base + δ of its request
                offsets = counters.decode_offsets(b, self._feedback[:, 1], self._feedback[:, 0])
                torch.add(self._base_c[:b, 1], offsets, out=self.log_scale_factors[:b, 1])
        if graph_bound is None:  # eager: the dense path when no row can drop a tile (feedback rows: at any δ)
            laws = [context.law()] if rows is None else self._row_laws
            plan.dense = all(step_is_dense(law, longest) for law in laws)

    def _write_rows(self, rows: np.ndarray, b: int) -> None:
        """Every row's (c, γ) per phase from the host (requests with their own targets in this step)."""
        staging = self._host_laws[self._staging_turn]
        host = staging.numpy()
        host[0, :b] = rows[:b, 0:2]
        host[1, :b] = rows[:b, 2:4]
        host[2, :b] = rows[:b, 4:6]
        self.log_scale_factors[:b].copy_(staging[0, :b], non_blocking=True)
        self.length_exponents[:b].copy_(staging[1, :b], non_blocking=True)
        self._feedback_on = bool((rows[:b, 5] > 0).any())
        if self._feedback_on:
            self._base_c[:b].copy_(self.log_scale_factors[:b])
            self._feedback[:b].copy_(staging[2, :b], non_blocking=True)
        self._rows_written = rows
        # the host's dense decision: a feedback row's decode c may move down to c - bound on the device
        self._row_laws = [((c0, c1 - FEEDBACK_BOUND * abs(gain)), (g0, g1))
                          for c0, c1, g0, g1, _, gain in {tuple(r) for r in rows[:b].tolist()}]  # fmt: skip


def step_is_dense(law, longest: int) -> bool:
    """True when no row of a step can drop a tile: every phase has ln λ >= 0 at every length n <= `longest`.

    ln λ = c - γ·ln(n) is smallest at n = longest for γ > 0 and at n = 1 for γ <= 0; a dense phase has c = -inf.
    A host decision from host values only (the step's longest sequence or prompt).
    """
    (c_pre, c_dec), (g_pre, g_dec) = law
    n = max(int(longest), 1)
    for c, g in ((c_pre, g_pre), (c_dec, g_dec)):
        if not math.isfinite(c):
            continue
        lowest = c - g * math.log(n) if g > 0 else c
        if lowest < 0:
            return False
    return True
