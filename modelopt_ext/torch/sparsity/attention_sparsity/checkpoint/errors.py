"""Errors of the checkpoint block and the mode config: one line per problem, `<field path>: <problem and fix>`,
rendered from pydantic's validation errors."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import ValidationError
from pydantic_core import PydanticCustomError

from .constants import (
    KNOWN_ALGORITHMS,
    SKIP_SOFTMAX,
)


class SparseAttentionConfigError(ValueError):
    """A malformed config or checkpoint block; the message names the offending field and the fix."""


# --------------------------------------------------------------------------------------------- error plumbing


def _fail(msg: str, sub: str = "") -> PydanticCustomError:
    """A validation error with our message; `sub` is appended to the field path (a key below the validated node)."""
    return PydanticCustomError("modelopt_ext", "{msg}", {"msg": msg, "sub": sub})


def did_you_mean(key: Any, choices: Iterable[str], cutoff: float = 0.6) -> str:
    close = difflib.get_close_matches(str(key), list(choices), n=1, cutoff=cutoff)
    return f"did you mean {close[0]!r}? " if close else ""


def _type_name(value: Any) -> str:
    return {dict: "object", list: "list", str: "string", type(None): "null"}.get(type(value), type(value).__name__)


_MISSING_HINTS = {
    "a": "the fit scale_factor = a * exp(b * target_sparsity) needs a and b",
    "b": "the fit scale_factor = a * exp(b * target_sparsity) needs a and b",
    "config_groups": "add a group with algorithm 'skip_softmax': calibrate the checkpoint",
}
_GROUP_TAGS = {SKIP_SOFTMAX, "sparse_softmax"}


def _render_loc(loc: tuple) -> list[str]:
    parts = [str(p) for p in loc]
    # Discriminated unions put the union member's tag after the group name: drop it.
    if len(parts) > 2 and parts[0] == "config_groups" and parts[2] in _GROUP_TAGS:
        del parts[2]
    return parts


def _message(err: dict) -> tuple[str, list[str]]:
    """Our message for one pydantic error, and extra path parts."""
    kind, value, ctx = err["type"], err.get("input"), err.get("ctx") or {}
    if kind == "modelopt_ext":
        return err["msg"], [ctx["sub"]] if ctx.get("sub") else []
    if kind == "missing":
        hint = _MISSING_HINTS.get(str(err["loc"][-1]) if err["loc"] else "", "add it")
        return f"missing ({hint})", []
    if kind in ("model_type", "model_attributes_type", "dict_type", "dataclass_type"):
        return f"must be a JSON object, got {_type_name(value)} {value!r}", []
    if kind == "union_tag_invalid":
        algo = value.get("algorithm") if isinstance(value, Mapping) else None
        return (
            f"unknown algorithm {algo!r}; {did_you_mean(algo, KNOWN_ALGORITHMS)}"
            f"supported: {list(KNOWN_ALGORITHMS)}",
            ["algorithm"],
        )
    if kind == "union_tag_not_found":
        if not isinstance(value, Mapping):
            return f"must be a JSON object, got {_type_name(value)} {value!r}", []
        return f"missing (every group names its algorithm, one of {list(KNOWN_ALGORITHMS)})", ["algorithm"]
    if kind == "literal_error":
        return f"must be {ctx.get('expected')}, got {value!r}", []
    if kind in ("bool_type", "bool_parsing"):
        return f"must be true or false, got {value!r}", []
    if kind in ("string_type", "string_sub_type"):
        return f"must be a string, got {_type_name(value)} {value!r}", []
    return f"{err['msg']}, got {value!r}", []


def format_validation_error(exc: ValidationError, root: str) -> str:
    """One line per error: ``<root>.<field path>: <what is wrong and what to do>``."""
    lines = []
    for err in exc.errors(include_url=False):
        msg, extra = _message(err)
        path = ".".join([root, *_render_loc(err["loc"]), *extra])
        lines.append(f"{path}: {msg}")
    return "\n".join(lines)

