"""Import a benchmark script as Python runs it: its folder first on sys.path (benchmarks import each other), and
benchmarks/ too (a study in benchmarks/studies/ imports the shared modules of benchmarks/; docs/benchmarks.md)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks"


def load_script(path: Path, module_name: str, search: tuple[Path, ...] = ()):
    """The Python file `path` as a fresh module `module_name`, registered in sys.modules (dataclasses look their
    module up there, and benchmarks import each other by name); its folder and `search` lead sys.path while it
    loads, and sys.path is as before once it is loaded."""
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    saved = list(sys.path)
    sys.path[:0] = list(dict.fromkeys(str(folder) for folder in (path.parent, *search)))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = saved
    return module


def load_benchmark(script: str, module_name: str | None = None):
    """`benchmarks/<script>.py` (`"fidelity"`, `"studies/decode_levers"`) as a fresh module named `module_name`
    (default: the script's own name, by which the other benchmarks import it)."""
    path = BENCH / f"{script}.py"
    return load_script(path, module_name or path.stem, (BENCH,))
