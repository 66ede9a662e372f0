"""Per-step sparse-attention plan: what every sparse layer of a batch needs, derived once per step.

FlashInfer's metadata has carried no block table or sequence lengths since vLLM 0.14.1, so the plugin wraps
`FlashInferMetadataBuilder.build` (once, idempotently) and attaches a `SparsePlan` built from the
`CommonAttentionMetadata`. FlashAttention and CPU-attention metadata carry those tensors themselves; their plan is
built from the metadata at the first sparse layer of the step and cached on it. Per-sequence λ tensors are
computed on the device, once per step and settings, without any host synchronisation.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass, field

import torch

logger = logging.getLogger(__name__)

PLAN_ATTR = "modelopt_sparse_plan"
"""Attribute name of the `SparsePlan` on a vLLM attention-metadata object."""

_WRAPPED_MARK = "__modelopt_sparse_wrapped__"

# Scale-factor pairs (prefill, decode) and trial tuples of the installed layers: the builder wrapper plans their λ.
_REGISTERED_SERVING: set[tuple[float | None, float | None]] = set()
_REGISTERED_TRIALS: set[tuple[float, ...]] = set()


def _dense_factor(sf: float | None) -> bool:
    """A phase scale factor that can never give 0 < λ < 1: no calibration, non-positive or not finite."""
    return sf is None or not (sf > 0.0 and math.isfinite(sf))


@dataclass
class SparsePlan:
    """Batch tensors of one step (sliced to the real requests) and the λ tensors derived from them."""

    num_reqs: int
    block_table: torch.Tensor  # [B, max_pages] int32
    seq_lens: torch.Tensor  # [B] int32, new tokens included
    query_start_loc: torch.Tensor  # [B + 1] int32
    max_query_len: int
    max_seq_len: int
    num_decodes: int | None = None  # host hint when the backend split the batch (FlashInfer)
    num_prefills: int | None = None
    _cache: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_tensors(
        cls,
        block_table,
        seq_lens,
        query_start_loc,
        max_query_len,
        max_seq_len,
        num_reqs=None,
        num_decodes=None,
        num_prefills=None,
    ) -> SparsePlan:
        b = int(seq_lens.shape[0]) if num_reqs is None else int(num_reqs)
        return cls(
            num_reqs=b,
            block_table=block_table[:b].to(torch.int32),
            seq_lens=seq_lens[:b].to(torch.int32),
            query_start_loc=query_start_loc[: b + 1].to(torch.int32),
            max_query_len=int(max_query_len),
            max_seq_len=int(max_seq_len),
            num_decodes=num_decodes,
            num_prefills=num_prefills,
        )

    def is_decode(self) -> torch.Tensor:
        """[B] bool: decode iff q_len == 1 (docs/skip_softmax.md)."""
        if "is_decode" not in self._cache:
            q_lens = self.query_start_loc[1:] - self.query_start_loc[:-1]
            self._cache["is_decode"] = q_lens == 1
        return self._cache["is_decode"]

    def phases_present(self) -> tuple[bool, bool]:
        """(prefill possible, decode possible) from host values only.

        Prefill (q_len > 1) exists iff max_query_len > 1. The backend's decode count covers every q_len <= its
        reorder threshold (spec decode may count q_len > 1 as decode), so it only proves decode absent when 0.
        """
        prefill = self.max_query_len > 1
        decode = True if self.num_decodes is None else self.num_decodes > 0
        return prefill, decode

    def is_dense(self, sf_prefill: float | None, sf_decode: float | None) -> bool:
        """True when λ = sf / kv_len is dense (>= 1 or no calibration) for every sequence, decided on the host."""
        prefill, decode = self.phases_present()
        for present, sf in ((prefill, sf_prefill), (decode, sf_decode)):
            if present and not _dense_factor(sf) and sf < self.max_seq_len:
                return False
        return True

    def thresholds(self, sf_prefill: float | None, sf_decode: float | None) -> torch.Tensor:
        """[B] float32 λ per sequence: its phase's scale factor / kv_len (inf, i.e. dense, without calibration)."""
        key = ("serve", sf_prefill, sf_decode)
        lam = self._cache.get(key)
        if lam is None:
            pre = math.inf if _dense_factor(sf_prefill) else float(sf_prefill)
            dec = math.inf if _dense_factor(sf_decode) else float(sf_decode)
            sf = torch.where(self.is_decode(), dec, pre).to(torch.float32)
            lam = sf / self.seq_lens.clamp_min(1).to(torch.float32)
            self._cache[key] = lam
        return lam

    def trial_thresholds(self, scale_factors: tuple[float, ...]) -> torch.Tensor:
        """[B, T] float32 λ for calibration trials given as scale factors: λ[b, t] = sf_t / kv_len[b]."""
        key = ("trials", tuple(scale_factors))
        lam = self._cache.get(key)
        if lam is None:
            sf = torch.tensor(list(scale_factors), dtype=torch.float32).to(self.seq_lens.device, non_blocking=True)
            lam = sf.unsqueeze(0) / self.seq_lens.clamp_min(1).to(torch.float32).unsqueeze(1)
            self._cache[key] = lam
        return lam

    def precompute(self) -> None:
        """Plan λ for every registered setting, so layers only run kernels."""
        for sf_prefill, sf_decode in _REGISTERED_SERVING:
            if not self.is_dense(sf_prefill, sf_decode):
                self.thresholds(sf_prefill, sf_decode)
        for trials in _REGISTERED_TRIALS:
            self.trial_thresholds(trials)


def register_plan_settings(
    serving: tuple[float | None, float | None] | None = None, trials: tuple[float, ...] | None = None
) -> None:
    """Let the builder wrapper precompute λ for these settings (install calls this; the latest install wins,
    other settings are still planned lazily, once per step, by the first layer that needs them)."""
    if serving is not None:
        _REGISTERED_SERVING.clear()
        _REGISTERED_SERVING.add(serving)
    if trials is not None:
        _REGISTERED_TRIALS.clear()
        _REGISTERED_TRIALS.add(tuple(trials))


def plan_from_common_metadata(common_attn_metadata, metadata=None) -> SparsePlan:
    """Plan from vLLM's `CommonAttentionMetadata` (fields present since 0.10.2)."""
    cam = common_attn_metadata
    plan = SparsePlan.from_tensors(
        cam.block_table_tensor,
        cam.seq_lens,
        cam.query_start_loc,
        cam.max_query_len,
        cam.max_seq_len,
        num_reqs=cam.num_reqs,
        num_decodes=getattr(metadata, "num_decodes", None),
        num_prefills=getattr(metadata, "num_prefills", None),
    )
    plan.precompute()
    return plan


def plan_from_backend_metadata(metadata) -> SparsePlan:
    """Plan of a FlashAttention / CPU-attention metadata object, built once per step and cached on it."""
    plan = getattr(metadata, PLAN_ATTR, None)
    if plan is not None:
        return plan
    block_table = getattr(metadata, "block_table", None)
    if block_table is None:
        block_table = getattr(metadata, "block_table_tensor", None)
    missing = [n for n in ("seq_lens", "query_start_loc", "max_query_len", "max_seq_len") if not hasattr(metadata, n)]
    if block_table is None or missing:
        raise RuntimeError(
            f"{type(metadata).__name__} carries no block table / {missing}: this vLLM version's metadata is not "
            "supported by the sparse plugin"
        )
    plan = SparsePlan.from_tensors(
        block_table, metadata.seq_lens, metadata.query_start_loc, metadata.max_query_len, metadata.max_seq_len
    )
    plan.precompute()
    setattr(metadata, PLAN_ATTR, plan)
    return plan


def _common_metadata_argument(args: tuple, kwargs: dict):
    """`common_attn_metadata` of a `build(common_prefix_len, common_attn_metadata, ...)` call, any call style."""
    if "common_attn_metadata" in kwargs:
        return kwargs["common_attn_metadata"]
    if len(args) >= 2:
        return args[1]
    raise TypeError("build() called without common_attn_metadata (positional index 1 or keyword)")


def wrap_metadata_builder(builder_cls) -> bool:
    """Wrap `builder_cls.build` so its metadata carries a `SparsePlan`. Returns False when already wrapped.

    Accepts `common_attn_metadata` by position (vLLM 0.32+ `AttentionGroup.build_metadata`) and by keyword
    (older runners, `build_for_cudagraph_capture`). The original method stays reachable as `__wrapped__`.
    """
    original = builder_cls.__dict__.get("build")
    if original is None:
        raise TypeError(f"{builder_cls.__name__} defines no build(); cannot attach the sparse plan")
    if getattr(original, _WRAPPED_MARK, False):
        return False

    @functools.wraps(original)
    def build(self, *args, **kwargs):
        metadata = original(self, *args, **kwargs)
        cam = _common_metadata_argument(args, kwargs)
        setattr(metadata, PLAN_ATTR, plan_from_common_metadata(cam, metadata))
        return metadata

    setattr(build, _WRAPPED_MARK, True)
    builder_cls.build = build
    logger.info("wrapped %s.build to attach the sparse-attention plan", builder_cls.__name__)
    return True


def unwrap_metadata_builder(builder_cls) -> bool:
    """Undo `wrap_metadata_builder`; returns False when it was not wrapped."""
    current = builder_cls.__dict__.get("build")
    if current is None or not getattr(current, _WRAPPED_MARK, False):
        return False
    builder_cls.build = current.__wrapped__
    return True
