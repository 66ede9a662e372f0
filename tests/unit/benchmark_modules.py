"""Import a benchmark script as Python runs it: its folder first on sys.path (benchmarks import each other)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def load_benchmark(script: str, module_name: str):
    """`benchmarks/<script>.py` as a fresh module named `module_name` (not registered in sys.modules)."""
    spec = importlib.util.spec_from_file_location(module_name, BENCH / f"{script}.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(BENCH))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
    return module
