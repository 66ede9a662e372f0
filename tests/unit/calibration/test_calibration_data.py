"""Offline RULER-style calibration prompts: lengths with a real (in-process trained) tokenizer, determinism, cache."""

from __future__ import annotations

import json
import logging
import random
import re

import pytest

from modelopt_ext.torch.sparsity.attention_sparsity.calibration import natural_text
from modelopt_ext.torch.sparsity.attention_sparsity.calibration.data import (
    BASE_TASKS,
    ESSAY_TASK,
    CalibrationSample,
    _task_renderer,
    build_calibration_prompts,
    load_prompts_file,
    samples_from_prompts,
    target_lengths,
)


class ByteTokenizer:
    """One token per UTF-8 byte plus a BOS: the simplest real tokenizer (used to make the BPE training corpus)."""

    def encode(self, text):
        return [256, *text.encode()]


@pytest.fixture(scope="module")
def tokenizer():
    """A byte-level BPE (GPT-2 style) trained in-process on builder output, wrapped as a HF fast tokenizer."""
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    corpus = [
        s.prompt
        for s in build_calibration_prompts(
            ByteTokenizer(), num_samples=8, max_seqlen=4096, min_seqlen=512, seed=1234, use_cache=False
        )
    ]
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token=None))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=1000,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    assert hf.encode("hi")[0] == hf.bos_token_id  # counts include the BOS the model sees
    return hf


def test_target_lengths_are_powers_of_two():
    assert target_lengths(4096) == [4096, 2048, 1024, 512]
    assert target_lengths(3000, 256) == [2048, 1024, 512, 256]
    assert target_lengths(1024, 1024) == [1024]
    with pytest.raises(ValueError, match="no power of two"):
        target_lengths(1000, 1000)


def test_lengths_land_just_under_powers_of_two(tokenizer):
    n = 4 * len(BASE_TASKS)
    samples = build_calibration_prompts(tokenizer, num_samples=n, max_seqlen=2048, min_seqlen=256, use_cache=False)
    assert len(samples) == n
    assert {s.target_length for s in samples} == {2048, 1024, 512, 256}
    for s in samples:
        assert s.num_tokens == len(tokenizer.encode(s.prompt))
        # one haystack unit (a sentence, a needle line, a word, a line of text) is below 48 tokens; a line of
        # stdlib code can reach ~100 (long literals, docstring lines)
        unit = 128 if s.task == "code" else 48
        assert s.target_length - unit <= s.num_tokens <= s.target_length, (s.task, s.target_length, s.num_tokens)
    # every (length, task) pair is covered by n_bins * n_tasks samples
    assert {(s.target_length, s.task) for s in samples} == {(n, t) for n in (2048, 1024, 512, 256) for t in BASE_TASKS}


def test_every_task_runs_at_every_length_before_the_next(tokenizer):
    """A short calibration still separates length from text: each task it covers is seen at every length (the
    length law is fitted across lengths; one task per length would fit the task difference instead)."""
    samples = build_calibration_prompts(tokenizer, num_samples=8, max_seqlen=1024, min_seqlen=128, use_cache=False)
    assert [(s.task, s.target_length) for s in samples] == [
        (task, n) for task in ("prose", "code") for n in (1024, 512, 256, 128)
    ]


def test_task_contents(tokenizer):
    samples = build_calibration_prompts(
        tokenizer, num_samples=len(BASE_TASKS), max_seqlen=512, min_seqlen=512, use_cache=False
    )
    by_task = {s.task: s.prompt for s in samples}
    assert set(by_task) == set(BASE_TASKS)
    for task in ("niah_noise", "niah_needle"):
        key = re.search(r"What is the special magic number for (\w+) mentioned", by_task[task]).group(1)
        assert re.search(rf"special magic numbers for {key} is: \d{{7}}\.", by_task[task]), task
    vt = by_task["variable_tracking"]
    value = re.search(r"assigned the value (\d+) in the text", vt).group(1)
    first = re.search(rf"VAR (\w+) = {value}\.", vt).group(1)
    assert f"= VAR {first}." in vt
    words = by_task["freq_words_extraction"].split("\n")[1].split()
    assert len(words) > 50 and len(set(words)) < len(words) / 2  # Zipf: a few words dominate
    # natural text from the calibration split only
    code_starts = {text.splitlines()[0] for _, text in natural_text.documents("code", "calibration")}
    assert re.search(r"\b(the|of|and)\b", by_task["prose"]) and by_task["code"].splitlines()[0] in code_starts
    heldout = {name for src in natural_text.SOURCES for name, _ in natural_text.documents(src, "heldout")}
    for src in natural_text.SOURCES:
        texts = dict(natural_text.documents(src, "heldout"))
        first_lines = {t.splitlines()[0] for t in texts.values() if t.splitlines()[0].strip()}
        assert not any(line in by_task[src].splitlines() for line in first_lines if len(line) > 30), src
    assert heldout and not heldout & {n for src in natural_text.SOURCES for n, _ in
                                      natural_text.documents(src, "calibration")}  # fmt: skip


def test_heldout_prompts_have_the_requested_length(tokenizer):
    for source in natural_text.SOURCES:
        text, n = natural_text.heldout_prompt(tokenizer, source, 700)
        assert 650 <= n <= 700 and n == len(tokenizer.encode(text))


def test_deterministic_for_a_seed(tokenizer):
    kw = dict(num_samples=6, max_seqlen=1024, min_seqlen=256, use_cache=False)
    a = build_calibration_prompts(tokenizer, seed=3, **kw)
    b = build_calibration_prompts(tokenizer, seed=3, **kw)
    c = build_calibration_prompts(tokenizer, seed=4, **kw)
    assert a == b
    assert [s.prompt for s in a] != [s.prompt for s in c]


def test_cache_hit_and_miss(tokenizer, tmp_path):
    kw = dict(num_samples=4, max_seqlen=512, min_seqlen=256, seed=0, cache_dir=tmp_path)
    first = build_calibration_prompts(tokenizer, **kw)
    files = list(tmp_path.glob("calib_prompts_*.json"))
    assert len(files) == 1
    data = json.loads(files[0].read_text())
    assert data["key"]["tokenizer"]["vocab_size"] == len(tokenizer.get_vocab())
    # Mark the cached prompts: a second call must return the marked ones, i.e. read the cache, not regenerate.
    data["samples"][0]["prompt"] = "FROM CACHE"
    files[0].write_text(json.dumps(data))
    second = build_calibration_prompts(tokenizer, **kw)
    assert second[0].prompt == "FROM CACHE" and second[1:] == first[1:]
    # other parameters: a different key, a new file
    build_calibration_prompts(tokenizer, **dict(kw, seed=1))
    assert len(list(tmp_path.glob("calib_prompts_*.json"))) == 2
    # a different tokenizer (byte-level) misses too
    third = build_calibration_prompts(ByteTokenizer(), **dict(kw, max_seqlen=1024, min_seqlen=1024))
    assert len(list(tmp_path.glob("calib_prompts_*.json"))) == 3
    assert 1024 - 128 <= third[0].num_tokens <= 1024  # task 0 is prose: a line is up to ~100 bytes
    # a corrupt cache is regenerated, not fatal
    files[0].write_text("{broken")
    assert build_calibration_prompts(tokenizer, **kw) == first


def test_essay_dir_adds_an_essay_haystack(tokenizer, tmp_path):
    essays = tmp_path / "essays"
    essays.mkdir()
    (essays / "a.txt").write_text("Startups are hard. Most of them fail early.\nThe ones that live learn fast. " * 3)
    (essays / "b.txt").write_text("Writing is thinking. Clear prose comes from clear ideas. ")
    samples = build_calibration_prompts(
        tokenizer, num_samples=len(BASE_TASKS) + 1, max_seqlen=512, min_seqlen=512, data_dir=essays, use_cache=False
    )
    essay = [s for s in samples if s.task == ESSAY_TASK]
    assert len(essay) == 1
    assert "Most of them fail early." in essay[0].prompt and "special magic numbers for" in essay[0].prompt
    assert essay[0].num_tokens <= 512
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no .txt essay files"):
        build_calibration_prompts(tokenizer, num_samples=1, max_seqlen=512, data_dir=empty, use_cache=False)
    with pytest.raises(ValueError, match="needs data_dir"):
        build_calibration_prompts(tokenizer, num_samples=1, max_seqlen=512, tasks=(ESSAY_TASK,), use_cache=False)


def _template_tokens(tokenizer, task):
    """Tokens of a task's prompt with an empty haystack (the smallest prompt the task can make)."""
    return len(tokenizer.encode(_task_renderer(task, random.Random(0), [])(0)))


def test_a_bin_too_short_for_a_template_goes_to_the_next_task(tokenizer, caplog):
    """The default shortest bin (max / 8) can be shorter than a retrieval task's template (variable_tracking has
    ~140 tokens with SmolLM2's tokenizer; `--calib_max_seqlen 1024` makes a 128-token bin): that task's samples in
    that bin go to the next task that fits, the other bins keep the task, and nothing is over its target."""
    base = _template_tokens(tokenizer, "variable_tracking")
    short = 1 << (base.bit_length() - 1)  # the largest power of two below the template
    assert short < base <= 2 * short
    tasks = ("variable_tracking", "prose", "code")
    with caplog.at_level(logging.INFO, logger="modelopt_ext"):
        samples = build_calibration_prompts(
            tokenizer, num_samples=3 * 3, max_seqlen=4 * short, min_seqlen=short, tasks=tasks, use_cache=False
        )
    assert [(s.task, s.target_length) for s in samples] == [
        ("variable_tracking", 4 * short), ("variable_tracking", 2 * short), ("prose", short),
        ("prose", 4 * short), ("prose", 2 * short), ("prose", short),
        ("code", 4 * short), ("code", 2 * short), ("code", short),
    ]  # fmt: skip
    for s in samples:
        assert 0 < s.num_tokens == len(tokenizer.encode(s.prompt)) <= s.target_length
    assert f"'variable_tracking' left out of the {short}-token length bin" in caplog.text


def test_too_short_target_names_the_fix(tokenizer):
    base = _template_tokens(tokenizer, "niah_noise")
    short = 1 << (base.bit_length() - 1)
    with pytest.raises(ValueError, match=rf"raise min_seqlen to at least {2 * short}"):
        build_calibration_prompts(
            tokenizer, num_samples=2, max_seqlen=short, min_seqlen=short, tasks=("niah_noise",), use_cache=False
        )


def test_load_prompts_file(tmp_path, tokenizer):
    txt = tmp_path / "p.txt"
    txt.write_text("first prompt\n\nsecond prompt\n")
    assert load_prompts_file(txt) == ["first prompt", "second prompt"]
    jl = tmp_path / "p.jsonl"
    jl.write_text(json.dumps({"prompt": "a\nmulti-line prompt"}) + "\n" + json.dumps({"prompt": "b"}) + "\n")
    assert load_prompts_file(jl) == ["a\nmulti-line prompt", "b"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps({"text": "no"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: expected an object with a string \"prompt\" field"):
        load_prompts_file(bad)
    (tmp_path / "empty.txt").write_text("\n")
    with pytest.raises(ValueError, match="no prompts"):
        load_prompts_file(tmp_path / "empty.txt")
    samples = samples_from_prompts(tokenizer, load_prompts_file(txt))
    assert samples[0] == CalibrationSample("first prompt", len(tokenizer.encode("first prompt")), "user", 0)
