"""Offline RULER-style calibration prompts: long synthetic contexts that need no download.

Why RULER-like tasks: calibration needs attention patterns of real long-context use (a few relevant keys among many
distractors), at several lengths, because the fitted law must hold across kv_len. Tasks generated here:

- `niah_noise`: one key -> number "needle" hidden at a random depth in repeated filler sentences.
- `niah_needle`: the haystack is itself made of distractor needles (many keys with random numbers); one is asked.
- `niah_essay`: a needle in real prose, only when `data_dir` holds essay `.txt` files.
- `variable_tracking`: a chain `VAR A = 12345`, `VAR B = VAR A`, ... scattered through filler; asks for all names.
- `freq_words_extraction`: a long Zipf-distributed stream of made-up words; asks for the three most frequent.
- `prose` / `code`: natural English documentation and Python source that CPython ships (calibration split of
  `natural_text.py`; the held-out split is kept for the fidelity benchmark), so the fitted law also sees the
  attention of ordinary text, not only of synthetic retrieval tasks.

Lengths are powers of two between `min_seqlen` and `max_seqlen` (or, with `exact_top`, `max_seqlen` itself and its
halvings, so that the longest calibration prompt reaches the longest prompt served); each prompt is grown (by whole
haystack units) to the largest size whose token count with the given tokenizer, special tokens included, is <= the
target.
Everything is deterministic for a seed, and results are cached as JSON keyed by the tokenizer's vocabulary hash and
the parameters.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..checkpoint.atomic_io import write_json_atomic
from . import natural_text

logger = logging.getLogger(__name__)

# Bump when generation changes, so stale caches are not reused.
BUILDER_VERSION = 3
# Natural text first: a short calibration (8 samples over 4 lengths) fits on prose and code, what users serve most.
BASE_TASKS = ("prose", "code", "niah_noise", "niah_needle", "variable_tracking", "freq_words_extraction")
ESSAY_TASK = "niah_essay"

_FILLER = (
    "The river keeps running past the old mill.",
    "A light wind moves across the open field.",
    "The morning is quiet and the road is empty.",
    "Somewhere a bell rings and then stops.",
    "The clouds drift slowly to the east.",
)
_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "st", "tr", "pl", "kr")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ou", "ee")


@dataclass(frozen=True)
class CalibrationSample:
    """One calibration prompt and its token count with the tokenizer it was built for."""

    prompt: str
    num_tokens: int
    task: str
    target_length: int = 0


def _pseudo_word(rng: random.Random, syllables: int | None = None) -> str:
    n = syllables or rng.randint(2, 3)
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(n))


def _number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


class _Stream:
    """Lazily generated, deterministic sequence of haystack units: unit i never depends on how many are asked."""

    def __init__(self, make: Callable[[random.Random, int], str], seed: int):
        self._make, self._rng, self._items = make, random.Random(seed), []

    def take(self, n: int) -> list[str]:
        while len(self._items) < n:
            self._items.append(self._make(self._rng, len(self._items)))
        return self._items[:n]


def _insert(units: list[str], inserts: list[tuple[float, str]]) -> list[str]:
    """Insert texts at fractional depths (0 = start, 1 = end), keeping their order."""
    out = list(units)
    for depth, text in sorted(inserts, key=lambda x: x[0], reverse=True):
        out.insert(round(depth * len(units)), text)
    return out


def _niah_prompt(haystack: list[str], key: str, value: str, depth: float) -> str:
    needle = f"One of the special magic numbers for {key} is: {value}."
    context = " ".join(_insert(haystack, [(depth, needle)]))
    return (
        "Some special magic numbers are hidden within the following text. Make sure to memorize them. "
        "I will quiz you about the numbers afterwards.\n"
        f"{context}\n"
        f"What is the special magic number for {key} mentioned in the provided text? "
        f"The special magic number for {key} mentioned in the provided text is"
    )


def _task_renderer(task: str, rng: random.Random, essay_sentences: list[str]) -> Callable[[int], str]:
    """A function size -> prompt for one sample; all randomness is drawn here or in a per-sample stream."""
    stream_seed = rng.getrandbits(63)
    if task in ("niah_noise", "niah_essay"):
        key, value, depth = _pseudo_word(rng, 3), _number(rng), rng.random()
        if task == "niah_noise":
            stream = _Stream(lambda r, i: _FILLER[i % len(_FILLER)], stream_seed)
        else:
            start = rng.randrange(len(essay_sentences))
            stream = _Stream(lambda r, i: essay_sentences[(start + i) % len(essay_sentences)], stream_seed)
        return lambda size: _niah_prompt(stream.take(size), key, value, depth)
    if task == "niah_needle":
        key, value, depth = _pseudo_word(rng, 3), _number(rng), rng.random()

        def distractor(r: random.Random, i: int) -> str:
            other = _pseudo_word(r, 3)
            while other == key:
                other = _pseudo_word(r, 3)
            return f"One of the special magic numbers for {other} is: {_number(r)}."

        stream = _Stream(distractor, stream_seed)
        return lambda size: _niah_prompt(stream.take(size), key, value, depth)
    if task == "variable_tracking":
        names = []
        while len(names) < 5:
            name = _pseudo_word(rng, 2).upper()
            if name not in names:
                names.append(name)
        value = str(rng.randint(10_000, 99_999))
        chain = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, 5)]
        depths = sorted(rng.random() for _ in chain)
        stream = _Stream(lambda r, i: _FILLER[i % len(_FILLER)], stream_seed)

        def render(size: int) -> str:
            context = " ".join(_insert(stream.take(size), list(zip(depths, chain, strict=True))))
            return (
                "Memorize and track the chain(s) of variable assignment hidden in the following text.\n"
                f"{context}\n"
                f"Question: Find all variables that are assigned the value {value} in the text above. "
                f"Answer: According to the chain(s) of variable assignment in the text above, {len(chain)} "
                f"variables are assigned the value {value}, they are:"
            )

        return render
    if task == "freq_words_extraction":
        vocab: list[str] = []
        while len(vocab) < 400:
            word = _pseudo_word(rng)
            if word not in vocab:
                vocab.append(word)
        weights = [1.0 / (rank + 1) ** 1.5 for rank in range(len(vocab))]
        stream = _Stream(lambda r, i: r.choices(vocab, weights)[0], stream_seed)
        return lambda size: (
            "Read the following coded text and track the frequency of each coded word. Find the three most "
            "frequently appeared coded words.\n"
            f"{' '.join(stream.take(size))}\n"
            "Question: Do not provide any explanation. What are the three most frequently appeared words in the "
            "above coded text? Answer: According to the coded text above, the three most frequently appeared "
            "words are:"
        )
    if task in natural_text.SOURCES:
        lines = natural_text.line_stream(task, "calibration", stream_seed)
        return lambda size: natural_text.render_prefix(lines, size)
    raise ValueError(f"unknown calibration task {task!r}; known: {[*BASE_TASKS, ESSAY_TASK]}")


def _count_tokens(tokenizer: Any, text: str) -> int:
    return len(tokenizer.encode(text))


class TemplateTooLong(ValueError):
    """A task's prompt template, with an empty haystack, already has more tokens than a length bin allows."""

    def __init__(self, task: str, base: int, target: int):
        super().__init__(
            f"task {task!r}: the prompt template alone has {base} tokens, more than the target length {target}; "
            "raise min_seqlen"
        )
        self.base = base


def _fit_to_length(render: Callable[[int], str], tokenizer: Any, target: int, task: str) -> tuple[str, int]:
    """Largest haystack size whose prompt has <= target tokens.

    Counts grow with size, so: estimate tokens per unit from a probe, bracket the estimate, then bisect. That is
    ~10 tokenizations of a full-length prompt instead of ~20 for a plain doubling search.
    """

    def count(size: int) -> int:
        return _count_tokens(tokenizer, render(size))

    base = count(0)
    if base > target:
        raise TemplateTooLong(task, base, target)
    probe = 32
    per_unit = max((count(probe) - base) / probe, 1e-3)
    guess = max(1, int((target - base) / per_unit))
    lo, hi = int(guess * 0.97), int(guess * 1.03) + 2
    while lo > 0 and count(lo) > target:
        lo, hi = lo // 2, lo
    while count(hi) <= target:
        lo, hi = hi, hi * 2
        if hi > 1 << 26:
            raise RuntimeError(f"task {task!r}: prompt does not grow with the haystack size (tokenizer issue?)")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if count(mid) <= target:
            lo = mid
        else:
            hi = mid
    prompt = render(lo)
    return prompt, _count_tokens(tokenizer, prompt)


def target_lengths(max_seqlen: int, min_seqlen: int | None = None, *, exact_top: bool = False) -> list[int]:
    """Powers of two in [min_seqlen, max_seqlen], longest first; min_seqlen defaults to 4 bins (max / 8).

    With `exact_top` the bins are `max_seqlen` and its halvings instead (8160 -> 8160, 4080, 2040, 1020): the
    longest calibration prompt then reaches `max_seqlen`, where powers of two would stop up to half below it (4096)
    and leave the longest served prompts to a law extrapolated in length. A power of two gives the same bins either
    way."""
    if max_seqlen < 2:
        raise ValueError(f"max_seqlen must be >= 2, got {max_seqlen}")
    # longest bin: max_seqlen itself, or the largest power of two <= max_seqlen
    top = max_seqlen if exact_top else 1 << (max_seqlen.bit_length() - 1)
    floor = max(2, min_seqlen if min_seqlen is not None else top // 8)
    lengths = []
    length = top
    while length >= floor:
        lengths.append(length)
        length //= 2
    if not lengths:
        what = "length bin" if exact_top else "power of two"
        raise ValueError(f"no {what} in [min_seqlen={min_seqlen}, max_seqlen={max_seqlen}]")
    return lengths


def _read_essays(data_dir: str | os.PathLike) -> tuple[list[str], str]:
    """Sentences of every `*.txt` under data_dir (sorted), and a content hash for the cache key."""
    root = Path(data_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"calibration data dir {root} does not exist")
    files = sorted(p for p in root.rglob("*.txt") if p.is_file())
    if not files:
        raise FileNotFoundError(f"calibration data dir {root} has no .txt essay files")
    digest = hashlib.sha256()
    sentences: list[str] = []
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + text.encode())
        for part in text.replace("\n", " ").split(". "):
            part = " ".join(part.split())
            if part:
                sentences.append(part if part.endswith((".", "!", "?")) else part + ".")
    if not sentences:
        raise ValueError(f"calibration data dir {root}: the .txt files are empty")
    return sentences, digest.hexdigest()


def _tokenizer_fingerprint(tokenizer: Any) -> dict[str, Any]:
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    vocab_hash = hashlib.sha256(json.dumps(sorted(vocab.items()), ensure_ascii=False).encode()).hexdigest()
    return {
        "name": str(getattr(tokenizer, "name_or_path", "") or ""),
        "class": type(tokenizer).__name__,
        "vocab_size": len(vocab),
        "vocab_sha256": vocab_hash,
        # Catches differences in special tokens (e.g. whether a BOS is added) that the vocab alone does not.
        "probe": list(tokenizer.encode("Calibration probe 123.")),
    }


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "modelopt_ext" / "calibration_data"


def build_calibration_prompts(
    tokenizer: Any,
    *,
    num_samples: int,
    max_seqlen: int,
    min_seqlen: int | None = None,
    seed: int = 0,
    data_dir: str | os.PathLike | None = None,
    cache_dir: str | os.PathLike | None = None,
    use_cache: bool = True,
    tasks: tuple[str, ...] | None = None,
    exact_top: bool = False,
) -> list[CalibrationSample]:
    """Build `num_samples` RULER-style prompts spread over power-of-two lengths and tasks.

    Sample i gets length bin `i % n_bins` and task `(i // n_bins) % n_tasks`: each task is run at every length
    before the next task starts, so the lengths see the same mix of tasks and the fitted length law is not a task
    difference in disguise (with one task per length, the "length exponent" fits which task sat at which length);
    n_bins * n_tasks samples cover every (length, task) pair. `exact_top`: the bins of `target_lengths(...,
    exact_top=True)`, from `max_seqlen` itself down. A task whose template alone is longer than a bin
    (a retrieval task in a 128-token bin) gives its samples there to the next task in the list. `data_dir` adds the
    `niah_essay` task over its `.txt` files. Results are cached under `cache_dir` (default
    `$XDG_CACHE_HOME/modelopt_ext/calibration_data`) unless `use_cache=False`.
    """
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    lengths = target_lengths(max_seqlen, min_seqlen, exact_top=exact_top)
    essay_sentences: list[str] = []
    essay_hash = None
    if data_dir is not None:
        essay_sentences, essay_hash = _read_essays(data_dir)
    task_list = tuple(tasks) if tasks else BASE_TASKS + ((ESSAY_TASK,) if essay_sentences else ())
    if ESSAY_TASK in task_list and not essay_sentences:
        raise ValueError(f"task {ESSAY_TASK!r} needs data_dir with essay .txt files")

    key = {
        "builder_version": BUILDER_VERSION,
        "tokenizer": _tokenizer_fingerprint(tokenizer),
        "num_samples": num_samples,
        "lengths": lengths,
        "seed": seed,
        "tasks": list(task_list),
        "essays_sha256": essay_hash,
    }
    key_hash = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    cache_path = Path(cache_dir or default_cache_dir()) / f"calib_prompts_{key_hash}.json"
    if use_cache:
        cached = _load_cache(cache_path, key)
        if cached is not None:
            logger.info("loaded %d calibration prompts from %s", len(cached), cache_path)
            return cached

    n_bins = len(lengths)
    too_long: dict[tuple[str, int], int] = {}  # (task, length bin) -> template tokens, for tasks a bin cannot hold
    samples = []
    for i in range(num_samples):
        first = (i // n_bins) % len(task_list)  # the sample's task, then the others in list order
        tasks_from = task_list[first:] + task_list[:first]
        samples.append(
            _sample_in_bin(tokenizer, seed * 1_000_003 + i, lengths[i % n_bins], tasks_from, essay_sentences, too_long)
        )
    for (task, length), base in sorted(too_long.items(), key=lambda x: (-x[0][1], x[0][0])):
        logger.info(
            "calibration task %r left out of the %d-token length bin (its template alone has %d tokens); "
            "its samples there use the next task in the list", task, length, base,
        )  # fmt: skip
    logger.info("built %d calibration prompts, lengths %s, tasks %s", len(samples), lengths, list(task_list))
    if use_cache:
        try:
            cache_path.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(cache_path, {"key": key, "samples": [asdict(s) for s in samples]})
        except OSError as exc:  # a read-only cache must not fail calibration
            logger.warning("could not write calibration prompt cache %s: %s", cache_path, exc)
    return samples


def _sample_in_bin(
    tokenizer: Any,
    rng_seed: int,
    length: int,
    tasks: tuple[str, ...],
    essay_sentences: list[str],
    too_long: dict[tuple[str, int], int],
) -> CalibrationSample:
    """One prompt of the `length` bin from the first of `tasks` whose template fits it.

    A task whose template alone exceeds the bin (e.g. variable_tracking, ~140 tokens, in a 128-token bin) gives its
    sample to the next task, so short bins still get their samples; `too_long` remembers such (task, bin) pairs.
    """
    for task in tasks:
        if (task, length) in too_long:
            continue
        try:
            render = _task_renderer(task, random.Random(rng_seed), essay_sentences)
            prompt, n_tokens = _fit_to_length(render, tokenizer, length, task)
        except TemplateTooLong as exc:
            too_long[(task, length)] = exc.base
            continue
        return CalibrationSample(prompt=prompt, num_tokens=n_tokens, task=task, target_length=length)
    shortest = min(base for (_, n), base in too_long.items() if n == length)
    raise ValueError(
        f"no calibration task fits the {length}-token length bin: the shortest prompt template has {shortest} "
        f"tokens; raise min_seqlen to at least {1 << (shortest - 1).bit_length()}"
    )


def _load_cache(path: Path, key: dict) -> list[CalibrationSample] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("key") != key:
            return None
        return [CalibrationSample(**s) for s in data["samples"]]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, KeyError) as exc:
        logger.warning("ignoring unreadable calibration prompt cache %s: %s", path, exc)
        return None


def load_prompts_file(path: str | os.PathLike) -> list[str]:
    """Prompts from a file: JSONL with a "prompt" field per line (`.jsonl`, or lines starting with `{`), else one
    prompt per non-empty line."""
    path = Path(path)
    lines = path.read_text(encoding="utf-8").splitlines()
    nonempty = [(n, line) for n, line in enumerate(lines, 1) if line.strip()]
    if not nonempty:
        raise ValueError(f"{path}: no prompts (the file is empty)")
    jsonl = path.suffix == ".jsonl" or nonempty[0][1].lstrip().startswith("{")
    if not jsonl:
        return [line for _, line in nonempty]
    prompts = []
    for n, line in nonempty:
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{n}: not valid JSON ({exc.msg})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
            raise ValueError(f'{path}:{n}: expected an object with a string "prompt" field')
        prompts.append(obj["prompt"])
    return prompts


def samples_from_prompts(tokenizer: Any, prompts: list[str], task: str = "user") -> list[CalibrationSample]:
    """Wrap user prompts (e.g. from `load_prompts_file`) as samples with their token counts."""
    return [CalibrationSample(p, _count_tokens(tokenizer, p), task, 0) for p in prompts]
