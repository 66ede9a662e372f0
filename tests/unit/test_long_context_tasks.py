"""The long-context task generator and scoring (benchmarks/task_generation.py) and the benchmark's pure helpers
(benchmarks/long_context_tasks.py): no engine, no model, no tokenizer download.

Lengths are measured with a tokenizer-free length function (whitespace words of the message and the answer prefix):
the generator takes any monotone length function, the benchmark passes the model's tokenizer through its chat
template.
"""

from __future__ import annotations

import re

import pytest
from benchmark_modules import load_benchmark

tg = load_benchmark("task_generation")


def words(text: str, prefix: str) -> int:
    return len(text.split()) + len(prefix.split())


@pytest.fixture(scope="module")
def units():
    return tg.filler_units("prose")  # the package's held-out prose (the Python docs every install ships)


def test_filler_is_heldout_text_in_short_units(units):
    from modelopt_ext.torch.sparsity.attention_sparsity.calibration import natural_text

    assert len(units) > 500
    assert all(0 < len(u) <= tg._MAX_UNIT_CHARS for u in units)
    heldout = "\n".join(t for _, t in natural_text.documents("prose", "heldout"))
    calibration = "\n".join(t for _, t in natural_text.documents("prose", "calibration"))
    sample = [u for u in units[:200] if len(u) > 60]
    assert sample and all(u.strip() in heldout for u in sample)
    assert sum(u.strip() in calibration for u in sample) < len(sample) // 2  # not the calibration documents


@pytest.mark.parametrize("task", tg.TASKS)
def test_deterministic_per_seed_and_seeds_differ(task, units):
    a = tg.generate(task, 600, 3, tg.REPORT_SEED, words, units)
    b = tg.generate(task, 600, 3, tg.REPORT_SEED, words, units)
    assert a == b
    c = tg.generate(task, 600, 3, tg.TUNING_SEED, words, units)
    d = tg.generate(task, 600, 4, tg.REPORT_SEED, words, units)
    assert c.text != a.text and c.answers != a.answers
    assert d.text != a.text and d.answers != a.answers


def test_tuning_and_reporting_seeds_differ(units):
    assert tg.TUNING_SEED != tg.REPORT_SEED
    tune = {p.text for p in tg.generate_cell("niah_single", 400, 8, tg.TUNING_SEED, words, units)}
    report = {p.text for p in tg.generate_cell("niah_single", 400, 8, tg.REPORT_SEED, words, units)}
    assert len(tune) == len(report) == 8 and not tune & report


@pytest.mark.parametrize("length", [300, 1000, 3000])
@pytest.mark.parametrize("task", tg.TASKS)
def test_lengths_hit_the_target(task, length, units):
    for p in tg.generate_cell(task, length, 3, tg.REPORT_SEED, words, units):
        assert p.tokens == words(p.text, p.answer_prefix)
        assert length - tg.tolerance(length) <= p.tokens <= length, (task, length, p.tokens)


@pytest.mark.parametrize("task", tg.TASKS)
def test_answers_sit_where_intended(task, units):
    for p in tg.generate_cell(task, 1500, 4, tg.REPORT_SEED, words, units):
        context, _, question = p.text.rpartition("\n\n")
        lines = context.split("\n")
        assert p.needles and p.answers
        # every needle line is in the context exactly once, and holds its answers
        positions = [lines.index(n) for n in p.needles]
        assert all(lines.count(n) == 1 for n in p.needles)
        for answer in p.answers:
            assert any(answer in n for n in p.needles)
            # outside the needle lines (and the question / prefix) the answer does not occur
            rest = "\n".join(line for line in lines if line not in p.needles)
            assert re.search(rf"\b{re.escape(answer)}\b", rest) is None
        assert not any(d in p.answers for d in p.distractors)
        if task in ("niah_single", "niah_multikey"):  # the reply starts with the asked needle's words
            asked = [n for n in p.needles if p.answers[0] in n]
            assert len(asked) == 1 and asked[0] == f"{p.answer_prefix} {p.answers[0]}."
        if task == "variable_tracking":
            assert positions == sorted(positions)  # assignments come in chain order
            value = p.needles[0].rpartition("= ")[2]
            assert value in question and value in p.answer_prefix
        if task != "kv_lookup":  # needles sit at (about) their depths in the filler
            for pos, depth in zip(sorted(positions), sorted(p.depths), strict=True):
                assert abs(pos / len(lines) - depth) < 0.1  # the preface and the other inserted lines shift it
        else:
            assert p.needles[0].startswith('"') and p.needles[0].split('"')[1] in question


def test_question_is_at_the_end(units):
    for task in tg.TASKS:
        p = tg.generate(task, 800, 0, tg.REPORT_SEED, words, units)
        assert p.text.rstrip().endswith(("only.", "spaces."))
        assert "?" in p.text.rpartition("\n\n")[2]


def test_too_short_a_length_is_refused(units):
    with pytest.raises(ValueError, match="without filler"):
        tg.generate("variable_tracking", 40, 0, tg.REPORT_SEED, words, units)


def test_scoring_normalizes_and_is_strict():
    assert tg.score(" 1234567 ", ["1234567"]) == 1
    assert tg.score("The special magic number is:\n  1234567.", ["1234567"]) == 1
    assert tg.score("  vniba,  MBKSR\n\tgxuxn ODBDT and muwsw", ["VNIBA", "MBKSR", "GXUXN", "ODBDT", "MUWSW"]) == 1
    # wrong, partial, or run into other digits / names
    assert tg.score("7654321", ["1234567"]) == 0
    assert tg.score("12345678", ["1234567"]) == 0
    assert tg.score("123 4567", ["1234567"]) == 0
    assert tg.score("VNIBAX MBKSR GXUXN ODBDT MUWSW", ["VNIBA", "MBKSR", "GXUXN", "ODBDT", "MUWSW"]) == 0
    assert tg.score("VNIBA MBKSR GXUXN", ["VNIBA", "MBKSR", "GXUXN", "ODBDT", "MUWSW"]) == 0
    assert tg.item_fraction("VNIBA MBKSR GXUXN", ["VNIBA", "MBKSR", "GXUXN", "ODBDT", "MUWSW"]) == pytest.approx(0.6)
    # a distractor in the reply fails it (listing every number of the context is not an answer)
    assert tg.score("1234567 or 7654321", ["1234567"], ["7654321"]) == 0
    assert tg.item_fraction("1234567 or 7654321", ["1234567"], ["7654321"]) == 0.0
    assert tg.score("", ["1234567"]) == 0


def test_generated_answers_score(units):
    for task in tg.TASKS:
        p = tg.generate(task, 700, 1, tg.REPORT_SEED, words, units)
        assert tg.score(" " + ", ".join(a.lower() for a in p.answers) + ".", p.answers, p.distractors) == 1
        if len(p.answers) > 1:
            assert tg.score(" ".join(p.answers[:-1]), p.answers, p.distractors) == 0
        if p.distractors:
            assert tg.score(" ".join(p.answers + p.distractors[:1]), p.answers, p.distractors) == 0


def test_benchmark_helpers_without_a_server():
    lct = load_benchmark("long_context_tasks")  # imports task_generation by name: `tg`
    args = lct.parse_args(["--quick"])
    assert args.seed == tg.REPORT_SEED and args.lengths == [2048, 4096] and args.prompts == 8
    assert lct.parse_args(["--tuning"]).seed == tg.TUNING_SEED
    full = lct.parse_args([])
    assert full.lengths == [2048, 4096, 8192] and full.prompts == 20 and full.targets == ["0.5", "0.7"]
    for bad in ("1.5", "0", "prefil:0.7", "decode:x", "decode:1"):
        with pytest.raises(SystemExit):
            lct.parse_args(["--targets", bad])
    phases = lct.parse_args(["--targets", "0.70,prefill:0.7,decode:0.50"]).targets
    assert phases == ["0.7", "prefill:0.7", "decode:0.5"]
    # per-phase modes ask the server for that phase's target and the other phase dense (docs/serving.md's keys)
    assert lct.mode_xargs("dense") == {"sparse_attn_target": "dense"}
    assert lct.mode_xargs("0.7") == {"sparse_attn_target": 0.7}
    assert lct.mode_xargs("prefill:0.7") == {"sparse_attn_prefill_target": 0.7, "sparse_attn_decode_target": "dense"}
    assert lct.mode_xargs("decode:0.5") == {"sparse_attn_decode_target": 0.5, "sparse_attn_prefill_target": "dense"}
    assert lct.prompt_length(8192, 8192) + lct.MAX_TOKENS_MULTI < 8192 and lct.prompt_length(2048, 8192) == 2048

    def cell(score, skipped):
        realized = {
            ph: {"visited": 100.0, "skipped": skipped, "sparsity": skipped / 100} for ph in ("prefill", "decode")
        }
        return {"n": 4, "score": score, "realized": realized, "replies": []}

    results = {"dense": {"kv_lookup": {"2048": cell(0.75, 0.0)}}, "0.5": {"kv_lookup": {"2048": cell(0.5, 50.0)}}}
    rows = lct.summarize(results, ["dense", "0.5"], [("kv_lookup", 2048)])
    assert rows[0]["below_dense_bar"] and rows[0]["targets"]["0.5"]["delta_points"] == pytest.approx(-25)
    text = lct.table(rows, ["dense", "0.5"])
    assert "50 % (75 %, -25)" in text and lct.BAR_NOTE in text and "0.50 / 0.50" in text
    assert lct.mode_totals(results)["0.5"] == {"prefill": 0.5, "decode": 0.5}
