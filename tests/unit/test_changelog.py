"""CHANGELOG.md reads as one: every entry says what changed for a user in at most three lines of at most 120
characters, and links the page that holds its measurement; the links point at files and headings that exist.

Measurements belong in docs/fidelity.md, docs/benchmarks.md, docs/coherence.md or docs/history/, not in the changelog.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CHANGELOG = REPO / "CHANGELOG.md"
MAX_LINES = 3
MAX_WIDTH = 120
LINK = re.compile(r"\]\(([^)\s]+)\)")


def entries(text: str) -> list[tuple[int, list[str]]]:
    """(first line number, lines) of every top-level bullet: a line starting with "- ", and the indented ones after."""
    out: list[tuple[int, list[str]]] = []
    current: list[str] | None = None
    for n, line in enumerate(text.splitlines(), 1):
        if line.startswith("- "):
            current = [line]
            out.append((n, current))
        elif current is not None and line.startswith("  ") and line.strip():
            current.append(line)
        else:
            current = None
    return out


def github_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives a file's headings (lower case, punctuation dropped, spaces as hyphens, -1 on repeat)."""
    seen: Counter[str] = Counter()
    anchors = set()
    in_code = False
    for line in markdown.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        m = None if in_code else re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        anchors.add(slug if not seen[slug] else f"{slug}-{seen[slug]}")
        seen[slug] += 1
    return anchors


def test_the_parser_sees_entries():
    sample = "## x\n\n- one\n  two\n- three\n\n  not an entry\n**Group**\n- four\n"
    assert entries(sample) == [(3, ["- one", "  two"]), (5, ["- three"]), (9, ["- four"])]
    assert github_anchors("# A b\n## Why version 5\n### Levers at 0.7, now (issue #56)\n## A b\n") == {
        "a-b", "why-version-5", "levers-at-07-now-issue-56", "a-b-1"}  # fmt: skip


def test_every_entry_is_at_most_three_lines():
    text = CHANGELOG.read_text(encoding="utf-8")
    found = entries(text)
    assert len(found) > 50  # the parser still finds the entries
    long = [f"line {n}: {len(lines)} lines: {lines[0][:80]}" for n, lines in found if len(lines) > MAX_LINES]
    assert not long, "changelog entries say what changed in at most 3 lines; measurements go to the linked docs:\n" \
        + "\n".join(long)  # fmt: skip


def test_lines_are_at_most_120_characters():
    wide = [(n, len(line)) for n, line in enumerate(CHANGELOG.read_text(encoding="utf-8").splitlines(), 1)
            if len(line) > MAX_WIDTH]  # fmt: skip
    assert not wide, f"(line, characters) over {MAX_WIDTH}: {wide}"


@pytest.mark.parametrize("doc", ["CHANGELOG.md", "docs/history/changelog.md"])
def test_links_point_at_files_and_headings_that_exist(doc):
    path = REPO / doc
    broken = []
    for target in LINK.findall(path.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+://", target):
            continue
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        if not linked.exists():
            broken.append(target)
        elif anchor and linked.suffix == ".md" and anchor not in github_anchors(linked.read_text(encoding="utf-8")):
            broken.append(target)
    assert not broken, f"{doc} links to missing files or headings: {broken}"
