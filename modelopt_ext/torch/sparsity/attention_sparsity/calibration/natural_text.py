"""Natural prose and source code that every Python installation ships, split into calibration and held-out sets.

Calibration on synthetic RULER-style tasks alone fits the attention of needle-in-a-haystack prompts, not of what
users serve. These two sources need no download and carry a licence that allows this use:

- **prose**: the English reference documentation of the Python language and library that CPython ships as
  `pydoc_data.topics` (about 80 topics, 460 kB; Python Software Foundation License 2.0);
- **code**: the Python standard library's own modules (`*.py` directly in the stdlib directory; PSF License 2.0).

Each document (a topic, a module) belongs to exactly one split, decided by a hash of its name: about one in four
is `heldout`, the rest `calibration`. The fidelity benchmark measures on `heldout` only, so a calibrated target is
checked on text calibration never saw. The split and the document order are deterministic (no randomness unless
a seed is given), and so independent of the machine as long as the Python minor version is the same.
"""

from __future__ import annotations

import hashlib
import random
import sysconfig
from functools import cache
from pathlib import Path

SOURCES = ("prose", "code")
SPLITS = ("calibration", "heldout")
_HELDOUT_EVERY = 4  # one document in four is held out
# Tiny or generated modules that are not representative code.
_MIN_DOC_CHARS = 2000


def split_of(name: str) -> str:
    """The split of a document name (stable across runs and machines)."""
    digest = hashlib.sha256(name.encode()).digest()
    return "heldout" if digest[0] % _HELDOUT_EVERY == 0 else "calibration"


@cache
def _prose() -> tuple[tuple[str, str], ...]:
    from pydoc_data.topics import topics

    return tuple((f"topic:{k}", v.strip()) for k, v in sorted(topics.items()) if len(v) >= _MIN_DOC_CHARS)


@cache
def _code() -> tuple[tuple[str, str], ...]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for path in sorted(stdlib.glob("*.py")):
        if path.name.startswith("_"):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if len(text) >= _MIN_DOC_CHARS:
            docs.append((f"module:{path.stem}", text))
    return tuple(docs)


def documents(source: str, split: str) -> list[tuple[str, str]]:
    """(name, text) of every document of `source` ("prose" or "code") in `split` ("calibration" or "heldout")."""
    if source not in SOURCES:
        raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    docs = _prose() if source == "prose" else _code()
    chosen = [(n, t) for n, t in docs if split_of(n) == split]
    if not chosen:
        raise RuntimeError(f"no {source} documents in the {split} split (is the Python standard library installed?)")
    return chosen


def line_stream(source: str, split: str, seed: int) -> list[str]:
    """The lines of the split's documents, documents in a seeded order (enough text for long prompts: the whole
    split, about 100k tokens of prose and far more code)."""
    docs = documents(source, split)
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    lines: list[str] = []
    for i in order:
        lines.extend(docs[i][1].splitlines())
        lines.append("")
    return lines


def render_prefix(lines: list[str], size: int) -> str:
    """The first `size` lines (wrapping around the stream) as one text."""
    if size <= len(lines):
        return "\n".join(lines[:size])
    reps = size // len(lines) + 1
    return "\n".join((lines * reps)[:size])


def heldout_prompt(tokenizer, source: str, num_tokens: int, seed: int = 0) -> tuple[str, int]:
    """A held-out prompt of `source` with at most `num_tokens` tokens (special tokens included): (text, tokens)."""
    lines = line_stream(source, "heldout", seed)
    ids = tokenizer.encode(render_prefix(lines, len(lines)))
    while len(ids) < num_tokens:  # the held-out code split is long; prose may need to wrap
        lines = lines + lines
        ids = tokenizer.encode(render_prefix(lines, len(lines)))
    text = tokenizer.decode(ids[:num_tokens], skip_special_tokens=True)
    n = len(tokenizer.encode(text))
    while n > num_tokens:  # decode/encode round trips can merge differently at the cut
        text = text[: int(len(text) * 0.999)]
        n = len(tokenizer.encode(text))
    return text, n
