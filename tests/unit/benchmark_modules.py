"""Import a benchmark script as Python runs it: its folder first on sys.path (benchmarks import each other), and
benchmarks/ too (a study in benchmarks/studies/ imports the shared modules of benchmarks/; docs/benchmarks.md)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def load_benchmark(script: str, module_name: str):
    """`benchmarks/<script>.py` (`"fidelity"`, `"studies/decode_levers"`) as a fresh module named `module_name` (not
    registered in sys.modules); sys.path is as before once it is loaded."""
    path = BENCH / f"{script}.py"
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    saved = list(sys.path)
    sys.path[:0] = list(dict.fromkeys([str(path.parent), str(BENCH)]))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = saved
    return module
