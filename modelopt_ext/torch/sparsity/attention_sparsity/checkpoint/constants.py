"""Names and numbers of the `sparse_attention_config` block and of mtsa's mode config (no heavy imports)."""

from __future__ import annotations

from modelopt_ext.torch.kernels.sparsity import contract_version as _contract_version

PHASES = ("prefill", "decode")

# ------------------------------------------------------------------------------------------------------ constants

BLOCK_KEY = "sparse_attention_config"
SKIP_SOFTMAX = "skip_softmax"
# ModelOpt's N:M sparse-softmax algorithms (its loader treats both names alike).
SPARSE_SOFTMAX_ALGORITHMS = ("sparse_softmax", "triton_sparse_softmax")
KNOWN_ALGORITHMS = (SKIP_SOFTMAX, *SPARSE_SOFTMAX_ALGORITHMS)
FORMULA = "a * exp(b * target_sparsity)"
# What ModelOpt serves a calibrated phase at when the checkpoint names no target for it.
DEFAULT_TARGET_SPARSITY = 0.5
# ModelOpt 0.47's static λ for a skip_softmax group without calibration (SKIP_SOFTMAX_TRITON_DEFAULT's
# `skip_softmax_threshold`); a test checks it against the installed ModelOpt.
MODELOPT_STATIC_THRESHOLD = 0.1
# N:M defaults of ModelOpt's loader (SPARSE_SOFTMAX_DEFAULTS): a group without sparsity_n is 2:4.
MODELOPT_DEFAULT_SPARSITY_N = 2
# Our optional per-phase length exponent γ; ModelOpt's law is γ = 1.
LENGTH_EXPONENT_RANGE = (0.0, 4.0)
# γ may vary with the target: γ(target) = length_exponent + length_exponent_slope·(target − pivot). The checkpoint
# stores γ at this fixed pivot, so a target edited by hand in config.json is served with the right γ.
LENGTH_EXPONENT_PIVOT = 0.5
# Calibration results inside the skip_softmax group: replaced as a whole on recalibration. Every other group key
# (ignore, initial_disabled_steps, targets, keys of a newer ModelOpt) is policy and survives a recalibration.
CALIBRATION_KEYS = (
    "threshold_scale_factor",
    "target_sparsity",
    "observed_sparsity_range",
    "fit",
    "length_exponent",
    "length_exponent_slope",
    "reference_length",
    "contract_version",
)
# The version of docs/skip_softmax.md our calibrations are made under: the kernels' own, defined once in
# modelopt_ext.torch.kernels.sparsity.contract_version (no torch there). Written into the skip_softmax group as
# `contract_version`: a calibration made under another version means something else by λ.
CONTRACT_VERSION = _contract_version.CONTRACT_VERSION

# Mode config (sparse_cfg).
METHODS = ("skip_softmax",)
BACKENDS = ("auto", "torch", "triton")
BACKEND_ALIASES = {"pytorch": "torch"}  # ModelOpt's spelling of the non-Triton path
CALIBRATION_KEY = "calibration"
