"""The CUDA-graph self-test (kernels/.../graph_check.py) on the CPU: everything but the capture itself.

`replay_by_call` replays the captured closure with the host values it froze (batch size, `max_model_len`, the
persistent buffers) while the self-test rewrites lengths, block tables, padding rows and λ in the buffers. The
kernels that must pass it do; a launch that freezes a host value read from the captured step's lengths (what an
eager-only launch does: a grid sized from this step's longest sequence) must fail it, with the reason. On a GPU
the same test runs with a real capture (scripts/gpu_check.py; the vLLM plugin at engine start).
"""

from __future__ import annotations

import pytest
import torch

from modelopt_ext.torch.kernels.sparsity.attention import cpu_kernel
from modelopt_ext.torch.kernels.sparsity.attention.api import kernel_launcher, triton_available
from modelopt_ext.torch.kernels.sparsity.attention.graph_check import decode_graph_self_test, replay_by_call

SHAPES = dict(num_heads=4, num_kv_heads=2, head_size=32, page_size=16, max_model_len=5000, dtype=torch.float32,
              device="cpu")  # fmt: skip


def _backends():
    out = [pytest.param("torch")]
    out.append(pytest.param("cpu", marks=pytest.mark.skipif(not cpu_kernel.available(),
                                                            reason=f"{cpu_kernel.unavailable_reason()}")))
    out.append(pytest.param("triton", marks=pytest.mark.skipif(not triton_available(), reason="no triton")))
    return out


@pytest.mark.parametrize("backend", _backends())
def test_kernels_pass_the_self_test(backend):
    sizes = (1, 3) if backend != "triton" else (3,)  # the interpreter is slow: one padded batch size
    problem = decode_graph_self_test(kernel_launcher(backend), batch_sizes=sizes, rounds=2, capture=replay_by_call,
                                     **SHAPES)  # fmt: skip
    assert problem is None, problem


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    not triton_available(), reason="no triton"))])  # fmt: skip
def test_kernels_pass_the_self_test_with_sinks(backend):
    """gpt-oss decode graphs launch with attention sinks: a persistent [Hq] buffer rewritten every round."""
    problem = decode_graph_self_test(kernel_launcher(backend), batch_sizes=(3,), rounds=2, capture=replay_by_call,
                                     sinks=True, **SHAPES)  # fmt: skip
    assert problem is None, problem


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_the_self_test_launches_on_an_fp8_cache_with_its_scales(cache_dtype):
    """An engine serving an FP8 cache captures launches on FP8 bytes with k_scale / v_scale: every launch of the
    self-test gets the FP8 caches and the same scales (!= 1), and the reference passes it."""
    seen = []
    launch = kernel_launcher("torch")

    def spy(*args, **kwargs):
        seen.append((args[1].dtype, args[2].dtype, kwargs.get("k_scale"), kwargs.get("v_scale")))
        return launch(*args, **kwargs)

    problem = decode_graph_self_test(spy, batch_sizes=(3,), rounds=2, capture=replay_by_call, cache_dtype=cache_dtype,
                                     **SHAPES)  # fmt: skip
    assert problem is None, problem
    assert seen and {x[:2] for x in seen} == {(cache_dtype, cache_dtype)}
    assert {x[2:] for x in seen} == {(0.5, 2.0)}


def test_sinks_reach_the_launch_from_their_buffer():
    """With `sinks=True` every launch gets the same float32 [Hq] buffer, its contents new each round; without, no
    launch gets a `sinks` argument (a sinkless model keeps the launch it always had)."""
    seen = []
    launch = kernel_launcher("torch")

    def spy(*args, **kwargs):
        sinks = kwargs.get("sinks")
        seen.append(None if sinks is None else (sinks.data_ptr(), sinks.dtype, tuple(sinks.shape), sinks.clone()))
        return launch(*args, **kwargs)

    assert decode_graph_self_test(spy, batch_sizes=(3,), rounds=2, capture=replay_by_call, **SHAPES) is None
    assert seen and all(x is None for x in seen)
    seen.clear()
    assert decode_graph_self_test(spy, batch_sizes=(3,), rounds=2, capture=replay_by_call, sinks=True,
                                  **SHAPES) is None  # fmt: skip
    assert len({x[0] for x in seen}) == 1 and all(x[1:3] == (torch.float32, (4,)) for x in seen)
    assert not torch.equal(seen[1][3], seen[-1][3]), "the sinks must change between rounds"


def test_a_launch_sized_from_the_captured_lengths_fails():
    """A grid bound frozen from the captured step's lengths: replays with longer sequences must be caught."""
    launch = kernel_launcher("triton" if triton_available() else "torch")
    frozen = {}

    def eager_sized(*args, seq_lens=None, **kwargs):
        seq_lens_k = args[5]
        if "bound" not in frozen:  # what a graph would keep from the capture
            frozen["bound"] = int(seq_lens_k.max())
        if "counts" in kwargs:  # the captured launch (the eager comparison launch is sized from its own lengths)
            kwargs["max_seqlen_k"] = frozen["bound"]
            kwargs.pop("workspace", None)
        return launch(*args, **kwargs)

    if not triton_available():
        pytest.skip("only the Triton kernel sizes its grid from max_seqlen_k")
    problem = decode_graph_self_test(eager_sized, batch_sizes=(2,), rounds=1, capture=replay_by_call, **SHAPES)
    assert problem is not None and "round 1" in problem and "differs from the eager launch" in problem, problem


def test_failures_are_reported_not_raised():
    def broken(*args, **kwargs):
        raise RuntimeError("no kernel image is available for execution on the device")

    problem = decode_graph_self_test(broken, batch_sizes=(1,), rounds=1, capture=replay_by_call, **SHAPES)
    assert problem.startswith("RuntimeError: no kernel image")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_decode_launch_replays_in_a_cuda_graph(dtype):
    """The real capture: what the vLLM plugin runs at engine start before it declares full decode graphs."""
    shapes = {**SHAPES, "dtype": dtype, "device": "cuda", "num_heads": 32, "num_kv_heads": 8, "head_size": 128}
    problem = decode_graph_self_test(kernel_launcher("triton"), batch_sizes=(1, 8), rounds=3, **shapes)
    assert problem is None, problem
    problem = decode_graph_self_test(kernel_launcher("triton"), batch_sizes=(8,), rounds=3, sinks=True, **shapes)
    assert problem is None, problem
