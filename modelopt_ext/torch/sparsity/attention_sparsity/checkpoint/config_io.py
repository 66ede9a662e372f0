"""vLLM-free reading, building, merging and writing of a checkpoint's `sparse_attention_config` block.

The schema (NVIDIA ModelOpt's block plus our extras), its validation and what a block resolves to live in
`.schema` (see its docstring for the rules); this module does the checkpoint I/O around it and re-exports the names
the serving side imports. Writing is atomic (`.atomic_io`), keeps every other key of config.json, every group of
another algorithm and, on recalibration, the skip_softmax group's policy (`ignore`, `initial_disabled_steps`, keys
of a newer ModelOpt): only the calibration keys (`schema.CALIBRATION_KEYS`) are replaced.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .atomic_io import backup_file, write_json_atomic, write_text_atomic
from .constants import (
    BLOCK_KEY,
    CALIBRATION_KEYS,
    CONTRACT_VERSION,
    DEFAULT_TARGET_SPARSITY,
    FORMULA,
    KNOWN_ALGORITHMS,
    PHASES,
    SKIP_SOFTMAX,
)
from .errors import SparseAttentionConfigError
from .resolve import (
    PhaseCalibration,
    SparseAttentionSettings,
    active_sparse_softmax_groups,
    parse_sparse_attention_config,
    validate_block,
)

__all__ = [
    "BLOCK_KEY",
    "DEFAULT_TARGET_SPARSITY",
    "FORMULA",
    "KNOWN_ALGORITHMS",
    "PHASES",
    "PRODUCER_NAME",
    "SKIP_SOFTMAX",
    "PhaseCalibration",
    "SparseAttentionConfigError",
    "SparseAttentionSettings",
    "build_sparse_attention_config",
    "load_sparse_attention_config",
    "merge_sparse_attention_config",
    "parse_sparse_attention_config",
    "settings_from_hf_config",
    "write_json_atomic",
    "write_sparse_attention_config",
]

logger = logging.getLogger(__name__)

PRODUCER_NAME = "modelopt_ext"


def hf_config_block(hf_config: Any) -> Any:
    """The raw `sparse_attention_config` block of a `transformers.PretrainedConfig`-like object or dict, or None."""
    return hf_config.get(BLOCK_KEY) if isinstance(hf_config, Mapping) else getattr(hf_config, BLOCK_KEY, None)


def settings_from_hf_config(hf_config: Any) -> SparseAttentionSettings | None:
    """Settings from a `transformers.PretrainedConfig`-like object (vLLM's `model_config.hf_config`), or None."""
    block = hf_config_block(hf_config)
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


_PHASE_SECTIONS = (
    "threshold_scale_factor", "target_sparsity", "observed_sparsity_range", "fit", "length_exponent",
    "length_exponent_slope", "reference_length",
)  # fmt: skip
"""The group's per-phase sections, in the order the block writes them (the first two always, the rest when set)."""


def _length_law_entries(fit: Any) -> dict[str, Any]:
    """A phase's length-law entries (γ at the pivot target, its slope, n_ref), written only when γ is not ModelOpt's 1.

    A PhaseCalibration carries the γ served at its own target and the pivot's as `pivot_length_exponent`; a fit
    carries the pivot's as `length_exponent`.
    """
    gamma = _get(fit, "pivot_length_exponent")
    gamma = _get(fit, "length_exponent") if gamma is None else gamma
    slope, n_ref = _get(fit, "length_exponent_slope") or 0.0, _get(fit, "reference_length")
    out: dict[str, Any] = {}
    if gamma is not None and (gamma != 1.0 or slope != 0.0):
        out["length_exponent"] = _as_number(gamma)
        if slope != 0.0:
            out["length_exponent_slope"] = _as_number(slope)
        if n_ref is not None:
            out["reference_length"] = _as_number(n_ref)
    return out


def _phase_entries(phase: str, fit: Any, target_sparsity: float | Mapping[str, float] | None) -> dict[str, Any]:
    """One calibrated phase's entry in each per-phase section it has (`_PHASE_SECTIONS`); refuses a static threshold
    and a phase without a target."""
    if isinstance(fit, PhaseCalibration) and fit.is_static:
        raise ValueError(
            f"{phase}: a static threshold (length_exponent 0) has no place in threshold_scale_factor; "
            "calibrate the phase, or leave it out"
        )
    out: dict[str, Any] = {"threshold_scale_factor": {"a": _as_number(_get(fit, "a")), "b": _as_number(_get(fit, "b"))}}
    target = target_sparsity.get(phase) if isinstance(target_sparsity, Mapping) else target_sparsity
    if target is None:
        target = _get(fit, "target_sparsity")
    if target is None:
        raise ValueError(f"no target sparsity for calibrated phase {phase!r}; pass target_sparsity=")
    out["target_sparsity"] = _as_number(target)
    rng = _get(fit, "observed_sparsity_range") or _get(fit, "sparsity_range")
    if rng is not None:
        out["observed_sparsity_range"] = [_as_number(rng[0]), _as_number(rng[1])]
    r2, n_points = _get(fit, "r2"), _get(fit, "n_points")
    if r2 is not None or n_points is not None:
        out["fit"] = {}
        if r2 is not None:
            out["fit"]["r2"] = _as_number(r2)
        if n_points is not None:
            out["fit"]["n_points"] = int(n_points)
    out.update(_length_law_entries(fit))
    return out


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
    `sparsity_range` / `observed_sparsity_range`, `length_exponent`, `length_exponent_slope` and `reference_length`
    (our length law, written only when γ differs from ModelOpt's 1). A phase mapped to None or left out stays dense.
    `target_sparsity` (one number or per phase) overrides targets carried by the fits; every calibrated phase needs
    one. The result is validated before it is returned.
    """
    if isinstance(fits, SparseAttentionSettings):
        attention_classes = attention_classes if attention_classes is not None else fits.attention_classes
        ignore = ignore if ignore is not None else fits.disabled_layers
        fits = {phase: fits.phase(phase) for phase in PHASES}
    unknown = set(fits) - set(PHASES)
    if unknown:
        raise ValueError(f"fits has unknown phases {sorted(unknown)}; expected keys among {list(PHASES)}")
    sections: dict[str, dict[str, Any]] = {key: {} for key in _PHASE_SECTIONS}
    sections["threshold_scale_factor"]["formula"] = FORMULA
    for phase in PHASES:
        fit = fits.get(phase)
        if fit is None:
            continue
        for key, value in _phase_entries(phase, fit, target_sparsity).items():
            sections[key][phase] = value
    group: dict[str, Any] = {
        "algorithm": SKIP_SOFTMAX,
        "targets": list(attention_classes) if attention_classes else ["Attention"],
    }
    if ignore:
        group["ignore"] = list(ignore)
    group["threshold_scale_factor"] = sections["threshold_scale_factor"]
    group["target_sparsity"] = sections["target_sparsity"]
    group.update((key, sections[key]) for key in _PHASE_SECTIONS[2:] if sections[key])
    if any(fits.get(phase) is not None for phase in PHASES):
        group["contract_version"] = CONTRACT_VERSION
    block = {
        "config_groups": {group_name: group},
        "producer": dict(producer) if producer else {"name": PRODUCER_NAME, "version": _producer_version()},
    }
    parse_sparse_attention_config(block)
    return block


def _as_number(value: Any) -> Any:
    """float() for numbers (numpy scalars included); anything else is left for the schema to name."""
    try:
        return float(value) if not isinstance(value, bool | str) and value is not None else value
    except (TypeError, ValueError):
        return value


# ------------------------------------------------------------------------------------------------------ merging


def _merge_skip_group(old: Mapping, new: Mapping) -> dict:
    """The old group's policy (every non-calibration key: ignore, initial_disabled_steps, unknown keys, ...) with
    the new calibration; a policy key the new group sets explicitly wins."""
    merged = {k: copy.deepcopy(v) for k, v in old.items() if k not in CALIBRATION_KEYS}
    for key, value in new.items():
        merged[key] = copy.deepcopy(value)
    return merged


def merge_sparse_attention_config(existing: Any, block: Mapping) -> dict:
    """Merge our block into an existing one.

    - Groups of other algorithms (N:M sparse softmax) keep their names, order and content; top-level keys stay
      unless the new block sets them (`producer`).
    - The new skip_softmax group merges into the old one in place (same group name): the calibration keys
      (`threshold_scale_factor`, `target_sparsity`, `observed_sparsity_range`, `fit`, `length_exponent`,
      `reference_length`) are replaced as a whole; every other key of the old group (`ignore`,
      `initial_disabled_steps`, `targets`, keys a newer ModelOpt wrote) is kept unless the new group sets it.
    - A new group whose name is taken gets the next free `group_<i>`.
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
            groups[name] = _merge_skip_group(group, new_skip) if isinstance(group, Mapping) else new_skip
            placed_skip = True
        else:
            logger.warning("dropping a second skip_softmax group %r from the existing block (one is allowed)", name)
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


# ------------------------------------------------------------------------------------------------------ writing


def write_sparse_attention_config(ckpt_dir: str | os.PathLike, block: Mapping, *, backup: bool = True) -> Path:
    """Put `block` into `<ckpt_dir>/config.json` atomically, merged with what is there (`merge_...`).

    The new block is validated first and the merged one after, so nothing invalid is ever written. With `backup`,
    the previous file is copied to `config.json.bak` (timestamped if that exists) first. Returns the path.
    """
    parse_sparse_attention_config(block)
    config_path = _config_path(ckpt_dir)
    config = _read_json(config_path)
    if not isinstance(config, Mapping):
        raise SparseAttentionConfigError(f"{config_path}: top level must be a JSON object")
    config = dict(config)
    merged = merge_sparse_attention_config(config.get(BLOCK_KEY), block)
    try:
        model = validate_block(merged)
    except SparseAttentionConfigError as exc:
        raise SparseAttentionConfigError(
            f"{exc}\n(merging into the block already in {config_path}; fix or remove that block first)"
        ) from None
    for name in active_sparse_softmax_groups(model):
        logger.warning(
            "%s keeps N:M group %r, which modelopt_ext does not serve: loading the checkpoint will refuse until the "
            "group is removed (NVIDIA ModelOpt serves it)", config_path, name,
        )  # fmt: skip
    config[BLOCK_KEY] = merged
    text = json.dumps(config, indent=2, allow_nan=False) + "\n"  # serialise before anything is touched
    if backup:
        saved = backup_file(config_path)
        logger.info("backed up %s to %s", config_path, saved)
    write_text_atomic(config_path, text)
    logger.info("wrote %s into %s", BLOCK_KEY, config_path)
    return config_path


def linked_checkpoint_copy(src: str | os.PathLike, dst: str | os.PathLike, *, overwrite: bool = False) -> Path:
    """A checkpoint of one's own to calibrate into: `config.json` copied (it is what gets rewritten), every other
    file linked (weights are never duplicated), hidden files left out; the original is never touched.

    `dst` must not exist unless `overwrite`, which replaces it (a folder made by an earlier call). Returns `dst`.
    """
    src, dst = Path(src).resolve(), Path(dst)
    if not (src / "config.json").is_file():
        raise FileNotFoundError(f"{src} has no config.json; pass a Hugging Face checkpoint folder")
    if dst.resolve() == src:
        raise ValueError(f"{dst} is the checkpoint itself; pass another folder")
    if dst.exists() or dst.is_symlink():
        if not overwrite:
            raise FileExistsError(f"{dst} exists; remove it or pass overwrite=True")
        if dst.is_dir() and not dst.is_symlink():
            shutil.rmtree(dst)
        else:
            dst.unlink()
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name == "config.json":
            shutil.copy2(f, dst / f.name)
        elif not f.name.startswith("."):
            (dst / f.name).symlink_to(f.resolve())
    return dst
