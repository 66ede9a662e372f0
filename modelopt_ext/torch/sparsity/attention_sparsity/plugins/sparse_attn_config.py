"""vLLM-free reading, validation and writing of a checkpoint's `sparse_attention_config` (NVIDIA ModelOpt's schema).

Schema (as ModelOpt exports it into config.json):

    "sparse_attention_config": {
      "config_groups": {"group_0": {
          "algorithm": "skip_softmax", "targets": ["LlamaAttention"],
          "threshold_scale_factor": {"formula": "a * exp(b * target_sparsity)",
                                     "prefill": {"a": 7.93, "b": 8.61}, "decode": {"a": 0.12, "b": 9.85}},
          "target_sparsity": {"prefill": 0.5, "decode": 0.5}}},
      "producer": {"name": "modelopt", "version": "..."}}

Rules we apply when reading (ModelOpt 0.47's own loader, `load_from_checkpoint_metadata`, behaves the same way):

- A phase is served sparse iff `threshold_scale_factor.<phase>` holds `a` and `b`; an absent phase is dense.
- `target_sparsity` is a per-phase dict or one number for both phases; a calibrated phase without a target gets
  ModelOpt's default 0.5 (with a warning).
- `ignore` lists layers kept dense (`SparseAttentionSettings.disabled_layers`).
- Groups with another algorithm ModelOpt knows (N:M `sparse_softmax`) are kept when we write and ignored when we
  serve; an algorithm nobody knows is an error, so a typo never silently means "dense".

Our extras inside the skip_softmax group (ModelOpt's loader reads only `algorithm`, `ignore`,
`threshold_scale_factor` and `target_sparsity` from it, so they travel harmlessly):

    "observed_sparsity_range": {"prefill": [0.06, 0.93]},   # sparsities the fit saw; targets outside extrapolate
    "fit": {"prefill": {"r2": 0.98, "n_points": 412}}       # fit quality
"""

from __future__ import annotations

import copy
import datetime
import json
import logging
import math
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

PHASES = ("prefill", "decode")

BLOCK_KEY = "sparse_attention_config"
SKIP_SOFTMAX = "skip_softmax"
# Algorithms a sparse_attention_config may carry. Only skip_softmax is served here; the N:M sparse-softmax ones are
# ModelOpt's and are preserved untouched.
KNOWN_ALGORITHMS = (SKIP_SOFTMAX, "sparse_softmax", "triton_sparse_softmax")
FORMULA = "a * exp(b * target_sparsity)"
# What ModelOpt serves a calibrated phase at when the checkpoint names no target for it.
DEFAULT_TARGET_SPARSITY = 0.5
PRODUCER_NAME = "modelopt_ext"


class SparseAttentionConfigError(ValueError):
    """A malformed `sparse_attention_config`; the message names the offending field."""


@dataclass(frozen=True)
class PhaseCalibration:
    """Calibrated fit `scale_factor = a * exp(b * sparsity)` of one phase and the target to serve at."""

    a: float
    b: float
    target_sparsity: float
    # Optional calibration extras (None when the checkpoint does not carry them, e.g. one exported by ModelOpt).
    observed_sparsity_range: tuple[float, float] | None = None
    r2: float | None = None
    n_points: int | None = None

    @property
    def scale_factor(self) -> float:
        """λ * kv_len for this phase's target: the per-sequence threshold is scale_factor / kv_len."""
        return self.a * math.exp(self.b * self.target_sparsity)


@dataclass(frozen=True)
class SparseAttentionSettings:
    """What serving needs: the per-phase calibration (None = dense for that phase) and the layers it covers."""

    prefill: PhaseCalibration | None
    decode: PhaseCalibration | None
    disabled_layers: tuple[str, ...] = ()
    # The skip_softmax group's `targets` (attention class names) and its key inside config_groups.
    attention_classes: tuple[str, ...] = ()
    group_name: str = "group_0"

    def phase(self, name: str) -> PhaseCalibration | None:
        return {"prefill": self.prefill, "decode": self.decode}[name]


# --------------------------------------------------------------------------------------------- validation helpers


def _fail(path: str, msg: str) -> SparseAttentionConfigError:
    return SparseAttentionConfigError(f"{path}: {msg}")


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _finite_positive(value: Any, path: str) -> float:
    if not _is_number(value) or not math.isfinite(value) or value <= 0:
        raise _fail(path, f"must be a finite positive number, got {value!r}")
    return float(value)


def _target(value: Any, path: str) -> float:
    if not _is_number(value) or not math.isfinite(value) or not 0.0 <= value < 1.0:
        raise _fail(path, f"must be a number in [0, 1), got {value!r}")
    return float(value)


def _mapping(value: Any, path: str) -> Mapping:
    if not isinstance(value, Mapping):
        raise _fail(path, f"must be a JSON object, got {type(value).__name__} {value!r}")
    return value


def _str_list(value: Any, path: str) -> tuple[str, ...]:
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        raise _fail(path, f"must be a list of strings, got {value!r}")
    return tuple(value)


def _phase_map(group: Mapping, key: str, gpath: str) -> Mapping:
    value = group.get(key)
    if value is None:
        return {}
    value = _mapping(value, f"{gpath}.{key}")
    for phase in value:
        if phase not in PHASES:
            raise _fail(f"{gpath}.{key}.{phase}", f"unknown phase; expected one of {list(PHASES)}")
    return value


def _observed_range(group: Mapping, phase: str, gpath: str) -> tuple[float, float] | None:
    ranges = _phase_map(group, "observed_sparsity_range", gpath)
    if ranges.get(phase) is None:
        return None
    path = f"{gpath}.observed_sparsity_range.{phase}"
    rng = ranges[phase]
    if (
        not isinstance(rng, list | tuple)
        or len(rng) != 2
        or not all(_is_number(v) and math.isfinite(v) for v in rng)
        or not 0.0 <= rng[0] <= rng[1] <= 1.0
    ):
        raise _fail(path, f"must be [lo, hi] with 0 <= lo <= hi <= 1, got {rng!r}")
    return float(rng[0]), float(rng[1])


def _fit_quality(group: Mapping, phase: str, gpath: str) -> tuple[float | None, int | None]:
    fits = _phase_map(group, "fit", gpath)
    if fits.get(phase) is None:
        return None, None
    path = f"{gpath}.fit.{phase}"
    fit = _mapping(fits[phase], path)
    r2 = fit.get("r2")
    if r2 is not None and (not _is_number(r2) or not math.isfinite(r2)):
        raise _fail(f"{path}.r2", f"must be a finite number, got {r2!r}")
    n = fit.get("n_points")
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 0):
        raise _fail(f"{path}.n_points", f"must be a non-negative integer, got {n!r}")
    return (None if r2 is None else float(r2)), n


def _parse_phase(group: Mapping, phase: str, gpath: str) -> PhaseCalibration | None:
    tsf = group["threshold_scale_factor"]
    params = tsf.get(phase)
    if params is None:
        return None
    ppath = f"{gpath}.threshold_scale_factor.{phase}"
    params = _mapping(params, ppath)
    for key in ("a", "b"):
        if key not in params:
            raise _fail(f"{ppath}.{key}", "missing (the fit `scale_factor = a * exp(b * sparsity)` needs a and b)")
    a = _finite_positive(params["a"], f"{ppath}.a")
    b = _finite_positive(params["b"], f"{ppath}.b")

    raw_target = group.get("target_sparsity")
    if _is_number(raw_target):
        target = _target(raw_target, f"{gpath}.target_sparsity")
    elif raw_target is None or raw_target.get(phase) is None:
        logger.warning(
            "%s.target_sparsity.%s is missing; serving %s at ModelOpt's default target %.2f",
            gpath, phase, phase, DEFAULT_TARGET_SPARSITY,
        )  # fmt: skip
        target = DEFAULT_TARGET_SPARSITY
    else:
        target = _target(raw_target[phase], f"{gpath}.target_sparsity.{phase}")

    observed = _observed_range(group, phase, gpath)
    r2, n_points = _fit_quality(group, phase, gpath)
    if observed is not None and not observed[0] <= target <= observed[1]:
        logger.warning(
            "%s target sparsity %.3f lies outside the sparsity range observed during calibration [%.3f, %.3f]: "
            "the threshold is extrapolated and the realised sparsity may differ; recalibrate with wider trials "
            "or pick a target inside the range",
            phase, target, observed[0], observed[1],
        )  # fmt: skip
    return PhaseCalibration(a, b, target, observed_sparsity_range=observed, r2=r2, n_points=n_points)


def parse_sparse_attention_config(block: Any, *, path: str = BLOCK_KEY) -> SparseAttentionSettings:
    """Validate a `sparse_attention_config` block and return its skip-softmax settings.

    Raises `SparseAttentionConfigError` naming the exact field (e.g.
    `sparse_attention_config.config_groups.group_0.threshold_scale_factor.prefill.a`) so a bad checkpoint fails
    before any model weights load.
    """
    block = _mapping(block, path)
    groups = _mapping(block.get("config_groups"), f"{path}.config_groups")
    if not groups:
        raise _fail(f"{path}.config_groups", "is empty; expected a group with algorithm 'skip_softmax'")
    skip_names = []
    for name, group in groups.items():
        gpath = f"{path}.config_groups.{name}"
        group = _mapping(group, gpath)
        algo = group.get("algorithm")
        if algo not in KNOWN_ALGORITHMS:
            raise _fail(f"{gpath}.algorithm", f"unknown algorithm {algo!r}; supported: {list(KNOWN_ALGORITHMS)}")
        if algo == SKIP_SOFTMAX:
            skip_names.append(name)
        else:
            logger.info("%s: algorithm %r is not served by modelopt_ext; the group is ignored", gpath, algo)
    if not skip_names:
        raise _fail(
            f"{path}.config_groups",
            "has no group with algorithm 'skip_softmax'; calibrate the checkpoint (calibrate_sparse_attn.py) "
            "or remove the sparse_attention_config block",
        )
    if len(skip_names) > 1:
        raise _fail(f"{path}.config_groups", f"has several skip_softmax groups {skip_names}; keep exactly one")

    name = skip_names[0]
    gpath = f"{path}.config_groups.{name}"
    group = groups[name]
    tsf = _mapping(group.get("threshold_scale_factor"), f"{gpath}.threshold_scale_factor")
    formula = tsf.get("formula", FORMULA)
    if formula != FORMULA:
        raise _fail(f"{gpath}.threshold_scale_factor.formula", f"must be {FORMULA!r}, got {formula!r}")
    raw_target = group.get("target_sparsity")
    if raw_target is not None and not _is_number(raw_target):
        raw_target = _phase_map(group, "target_sparsity", gpath)
        for phase, value in raw_target.items():
            if value is not None:
                _target(value, f"{gpath}.target_sparsity.{phase}")
    elif raw_target is not None:
        _target(raw_target, f"{gpath}.target_sparsity")
    phases = {phase: _parse_phase(group, phase, gpath) for phase in PHASES}
    if all(cal is None for cal in phases.values()):
        raise _fail(
            f"{gpath}.threshold_scale_factor",
            f"calibrates no phase; expected {{'a': .., 'b': ..}} under at least one of {list(PHASES)}",
        )
    if isinstance(raw_target, Mapping):
        for phase in PHASES:
            if phases[phase] is None and raw_target.get(phase) is not None:
                # ModelOpt exports targets for both phases even when it calibrated one: normal, not a warning.
                logger.info("%s.target_sparsity.%s is set but %s is not calibrated: %s stays dense",
                            gpath, phase, phase, phase)  # fmt: skip
    ignore = _str_list(group.get("ignore", []), f"{gpath}.ignore")
    classes = _str_list(group.get("targets", []), f"{gpath}.targets")
    return SparseAttentionSettings(
        prefill=phases["prefill"],
        decode=phases["decode"],
        disabled_layers=ignore,
        attention_classes=classes,
        group_name=str(name),
    )


def settings_from_hf_config(hf_config: Any) -> SparseAttentionSettings | None:
    """Settings from a `transformers.PretrainedConfig`-like object (vLLM's `model_config.hf_config`), or None."""
    block = hf_config.get(BLOCK_KEY) if isinstance(hf_config, Mapping) else getattr(hf_config, BLOCK_KEY, None)
    if block is None:
        return None
    return parse_sparse_attention_config(block)


def _config_path(ckpt_dir_or_config_json: str | os.PathLike) -> Path:
    path = Path(ckpt_dir_or_config_json)
    return path / "config.json" if path.is_dir() else path


def _read_json(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} does not exist; pass a checkpoint directory containing config.json") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise SparseAttentionConfigError(f"{path}: not valid JSON ({exc})") from None


def load_sparse_attention_config(ckpt_dir_or_config_json: str | os.PathLike) -> SparseAttentionSettings | None:
    """Read and validate the block from `<ckpt>/config.json` (or a config.json / standalone block file).

    Returns None when the file carries no `sparse_attention_config` (serve dense). A standalone file written by
    `write_json_atomic(..., block)` (top-level `config_groups`) is accepted as the block itself.
    """
    path = _config_path(ckpt_dir_or_config_json)
    data = _read_json(path)
    if not isinstance(data, Mapping):
        raise SparseAttentionConfigError(f"{path}: top level must be a JSON object")
    block = data if "config_groups" in data else data.get(BLOCK_KEY)
    if block is None:
        return None
    try:
        return parse_sparse_attention_config(block)
    except SparseAttentionConfigError as exc:
        raise SparseAttentionConfigError(f"{exc} (in {path})") from None


# ----------------------------------------------------------------------------------------------------- building


def _producer_version() -> str:
    try:
        from importlib.metadata import version

        return version("modelopt-ext")
    except Exception:  # not installed as a distribution (e.g. run from a source tree)
        return "unknown"


def _get(obj: Any, key: str, default: Any = None) -> Any:
    return obj.get(key, default) if isinstance(obj, Mapping) else getattr(obj, key, default)


def build_sparse_attention_config(
    fits: SparseAttentionSettings | Mapping[str, Any],
    *,
    target_sparsity: float | Mapping[str, float] | None = None,
    attention_classes: list[str] | tuple[str, ...] | None = None,
    ignore: list[str] | tuple[str, ...] | None = None,
    producer: Mapping[str, str] | None = None,
    group_name: str = "group_0",
) -> dict:
    """Build a ModelOpt-compatible block (plus our extras) from per-phase fits.

    `fits` is a `SparseAttentionSettings` or a mapping phase -> fit, where a fit is anything with `a` and `b`
    (attributes or keys; `calibration.fit.PhaseFit`, `PhaseCalibration`, a dict) and optionally `r2`, `n_points`,
    `sparsity_range` / `observed_sparsity_range`. A phase mapped to None or left out stays dense.
    `target_sparsity` (one number or per phase) overrides targets carried by the fits; every calibrated phase
    needs one. The result is validated with `parse_sparse_attention_config` before it is returned.
    """
    if isinstance(fits, SparseAttentionSettings):
        attention_classes = attention_classes if attention_classes is not None else fits.attention_classes
        ignore = ignore if ignore is not None else fits.disabled_layers
        fits = {phase: fits.phase(phase) for phase in PHASES}
    unknown = set(fits) - set(PHASES)
    if unknown:
        raise ValueError(f"fits has unknown phases {sorted(unknown)}; expected keys among {list(PHASES)}")
    tsf: dict[str, Any] = {"formula": FORMULA}
    targets: dict[str, float] = {}
    observed: dict[str, list[float]] = {}
    quality: dict[str, dict[str, Any]] = {}
    for phase in PHASES:
        fit = fits.get(phase)
        if fit is None:
            continue
        tsf[phase] = {"a": float(_get(fit, "a")), "b": float(_get(fit, "b"))}
        if isinstance(target_sparsity, Mapping):
            target = target_sparsity.get(phase)
        else:
            target = target_sparsity
        if target is None:
            target = _get(fit, "target_sparsity")
        if target is None:
            raise ValueError(f"no target sparsity for calibrated phase {phase!r}; pass target_sparsity=")
        targets[phase] = float(target)
        rng = _get(fit, "observed_sparsity_range") or _get(fit, "sparsity_range")
        if rng is not None:
            observed[phase] = [float(rng[0]), float(rng[1])]
        r2, n_points = _get(fit, "r2"), _get(fit, "n_points")
        if r2 is not None or n_points is not None:
            quality[phase] = {k: v for k, v in (("r2", r2), ("n_points", n_points)) if v is not None}
            if "r2" in quality[phase]:
                quality[phase]["r2"] = float(quality[phase]["r2"])
    group: dict[str, Any] = {
        "algorithm": SKIP_SOFTMAX,
        "targets": list(attention_classes) if attention_classes else ["Attention"],
    }
    if ignore:
        group["ignore"] = list(ignore)
    group["threshold_scale_factor"] = tsf
    group["target_sparsity"] = targets
    if observed:
        group["observed_sparsity_range"] = observed
    if quality:
        group["fit"] = quality
    block = {
        "config_groups": {group_name: group},
        "producer": dict(producer) if producer else {"name": PRODUCER_NAME, "version": _producer_version()},
    }
    parse_sparse_attention_config(block)
    return block


# ------------------------------------------------------------------------------------------------------ writing


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # e.g. platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_text_atomic(path: Path, text: str) -> None:
    """Temp file in the same directory + fsync + os.replace: readers see the old file or the new, never half."""
    path = Path(path)
    try:
        mode = path.stat().st_mode & 0o777
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(path.parent)


def write_json_atomic(path: str | os.PathLike, obj: Any) -> Path:
    """Write `obj` as JSON atomically. It is serialised first, so an unserialisable object touches nothing."""
    text = json.dumps(obj, indent=2, allow_nan=False) + "\n"
    path = Path(path)
    _write_text_atomic(path, text)
    return path


def _backup(config_path: Path) -> Path:
    """Copy config.json to config.json.bak, or a timestamped name so an earlier backup is never overwritten."""
    backup = config_path.with_name(config_path.name + ".bak")
    if backup.exists():
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%S%fZ")
        backup = config_path.with_name(f"{config_path.name}.{stamp}.bak")
    tmp = backup.with_name(f".{backup.name}.tmp")
    shutil.copy2(config_path, tmp)
    os.replace(tmp, backup)
    return backup


def merge_sparse_attention_config(existing: Any, block: Mapping) -> dict:
    """Merge our block into an existing one: other algorithms' groups and top-level keys stay as they were.

    The new skip_softmax group replaces the old one in place (same group name); groups of other algorithms keep
    their names and order; a new group whose name is taken gets the next free `group_<i>`.
    """
    if not isinstance(existing, Mapping) or not isinstance(existing.get("config_groups"), Mapping):
        return copy.deepcopy(dict(block))
    merged = copy.deepcopy(dict(existing))
    new_groups = list(block["config_groups"].items())
    new_skip = next((g for _, g in new_groups if _get(g, "algorithm") == SKIP_SOFTMAX), None)
    groups: dict[str, Any] = {}
    placed_skip = False
    for name, group in merged["config_groups"].items():
        if new_skip is None or _get(group, "algorithm") != SKIP_SOFTMAX:
            groups[name] = group
        elif not placed_skip:
            groups[name] = copy.deepcopy(new_skip)  # first old skip_softmax group's slot; later ones dropped
            placed_skip = True
    for name, group in new_groups:
        if _get(group, "algorithm") == SKIP_SOFTMAX and placed_skip:
            continue
        if name in groups:
            i = 0
            while f"group_{i}" in groups:
                i += 1
            name = f"group_{i}"
        groups[name] = copy.deepcopy(group)
    merged["config_groups"] = groups
    for key, value in block.items():
        if key != "config_groups":
            merged[key] = copy.deepcopy(value)
    return merged


def write_sparse_attention_config(ckpt_dir: str | os.PathLike, block: Mapping, *, backup: bool = True) -> Path:
    """Put `block` into `<ckpt_dir>/config.json` atomically, keeping every other key and other algorithms' groups.

    With `backup`, the previous file is copied to `config.json.bak` (timestamped if that exists) first.
    Returns the config.json path.
    """
    parse_sparse_attention_config(block)
    config_path = _config_path(ckpt_dir)
    config = _read_json(config_path)
    if not isinstance(config, Mapping):
        raise SparseAttentionConfigError(f"{config_path}: top level must be a JSON object")
    config = dict(config)
    config[BLOCK_KEY] = merge_sparse_attention_config(config.get(BLOCK_KEY), block)
    text = json.dumps(config, indent=2, allow_nan=False) + "\n"  # serialise before anything is touched
    if backup:
        saved = _backup(config_path)
        logger.info("backed up %s to %s", config_path, saved)
    _write_text_atomic(config_path, text)
    logger.info("wrote %s into %s", BLOCK_KEY, config_path)
    return config_path
