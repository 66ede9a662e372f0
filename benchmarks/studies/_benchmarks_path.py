"""Puts benchmarks/ on sys.path, so a study imports the shared benchmark modules (coherence, bench_cpu, ...) by name.

Python puts only a script's own folder (benchmarks/studies/) on sys.path; a study imports this module first
(`import _benchmarks_path  # noqa: F401`), before any module of benchmarks/ (docs/benchmarks.md, "Layout").
"""

from __future__ import annotations

import sys
from pathlib import Path

BENCHMARKS = str(Path(__file__).resolve().parents[1])
if BENCHMARKS not in sys.path:
    sys.path.insert(1, BENCHMARKS)
