"""The house's shape (issue #65): the vLLM plugin on at most 8 import floors, no module of it over 350 lines, no
function over 80 lines outside @triton.jit kernels. Read from the source with `ast` (nothing is imported).

A floor is a step of the longest chain of module-level imports among the plugin's own modules: a module that imports
none of its siblings is on floor 1, one that imports a floor-k module is on floor k + 1 or higher. Imports inside
functions do not count, and the package's other rules say when those are allowed (only to break a real cycle).
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = ROOT / "modelopt_ext/torch/sparsity/attention_sparsity/plugins/vllm"
MAX_FLOORS, MAX_MODULE_LINES, MAX_FUNCTION_LINES = 8, 350, 80
CODE_DIRS = ("modelopt_ext", "benchmarks", "scripts", "examples", "tools", "tests")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PLUGIN).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(name: str, is_package: bool, node: ast.ImportFrom) -> list[str]:
    """The plugin modules a relative `from ... import ...` may name (the module and each imported name)."""
    base = name.split(".") if name else []
    if not is_package:
        base = base[:-1]
    up = node.level - 1
    if up > len(base):
        return []  # above the plugin package
    base = base[: len(base) - up]
    if node.module is None:
        return [".".join([*base, alias.name]) for alias in node.names]
    target = ".".join([*base, *node.module.split(".")])
    return [target, *(f"{target}.{alias.name}" for alias in node.names)]


def plugin_import_graph() -> dict[str, set[str]]:
    """{module: the plugin modules it imports at module level} (`try:` bodies included, `if` blocks not)."""
    files = {_module_name(p): p for p in PLUGIN.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        deps = set()
        for node in ast.parse(path.read_text()).body:
            for stmt in node.body if isinstance(node, ast.Try) else [node]:
                if isinstance(stmt, ast.ImportFrom) and stmt.level:
                    deps.update(t for t in _imported(name, path.name == "__init__.py", stmt) if t in files)
        graph[name] = deps - {name}
    return graph


def floors(graph: dict[str, set[str]]) -> dict[str, int]:
    @functools.cache
    def floor(name: str) -> int:
        return 1 + max((floor(dep) for dep in graph[name]), default=0)

    return {name: floor(name) for name in graph}


def _is_triton_jit(node: ast.FunctionDef) -> bool:
    for dec in node.decorator_list:
        target = dec.func if isinstance(dec, ast.Call) else dec
        if isinstance(target, ast.Attribute) and target.attr == "jit":
            return True
    return False


def long_functions(limit: int) -> list[str]:
    out = []
    for folder in CODE_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _is_triton_jit(node):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > limit:
                        out.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    return out


def test_the_plugin_stands_on_at_most_eight_floors():
    graph = plugin_import_graph()
    assert {"plan", "install", "entry", "worker"} <= set(graph)  # the graph sees the plugin's modules
    assert "feedback" in graph["law_rows"]  # and their imports
    by_module = floors(graph)
    tallest = max(by_module, key=by_module.get)
    assert by_module[tallest] <= MAX_FLOORS, f"{tallest} is on floor {by_module[tallest]}: {sorted(by_module.items())}"


def test_no_plugin_module_is_over_350_lines():
    big = {str(p.relative_to(PLUGIN)): n for p in PLUGIN.rglob("*.py")
           if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}  # fmt: skip
    assert not big, f"modules of plugins/vllm over {MAX_MODULE_LINES} lines: {big}"


def test_no_function_is_over_80_lines():
    assert not long_functions(MAX_FUNCTION_LINES), "\n".join(long_functions(MAX_FUNCTION_LINES))


def test_the_measures_see_what_they_measure():
    """The floor count follows a chain, and the function counter finds a long function."""
    assert floors({"a": {"b"}, "b": {"c"}, "c": set()}) == {"a": 3, "b": 2, "c": 1}
    assert long_functions(1)  # every function of the project is longer than one line
