"""What the calibrate and serve commands check and set before a vLLM engine starts. Standard library only (no
vLLM import).

- `model_context_length(config)`: the longest sequence the model supports, as vLLM derives it from config.json.
- `tensor_parallel_problem(config, tp)`: why vLLM would refuse `--tensor_parallel_size tp` for this model, or None.
- `cpu_threads_bind(tp)`: a `VLLM_CPU_OMP_THREADS_BIND` value for vLLM's CPU engine with `tp` workers. vLLM's
  default ("auto") binds each tensor-parallel worker to its own NUMA node and refuses to start when the machine has
  fewer NUMA nodes than workers (every single-socket machine); splitting this process's CPUs into `tp` contiguous
  groups ("0|1" on 2 cores) works on any machine with at least `tp` CPUs.
"""

from __future__ import annotations

import os

ENV_CPU_BIND = "VLLM_CPU_OMP_THREADS_BIND"
# Rope scalings whose factor stretches the context beyond max_position_embeddings (vLLM's rule; llama3, su and
# longrope already state the stretched length).
_STRETCHING_ROPE = ("linear", "dynamic", "yarn", "mrope")


def _text_config(config: dict) -> dict:
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


def model_context_length(config: dict) -> tuple[int, str] | None:
    """(length, where it comes from) of the model's context, or None when config.json does not say."""
    cfg = _text_config(config)
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length"):
        value = cfg.get(key)
        if isinstance(value, int) and value > 0:
            length, where = value, f"{key} {value}"
            break
    else:
        return None
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if isinstance(rope, dict):
        kind = rope.get("rope_type", rope.get("type"))
        factor = rope.get("factor")
        if kind in _STRETCHING_ROPE and isinstance(factor, int | float) and factor > 1:
            length, where = int(length * factor), f"{where} x {kind} rope factor {factor:g}"
    return length, where


def tensor_parallel_problem(config: dict, tp: int) -> str | None:
    """Why vLLM would refuse this tensor-parallel size for the model (its head counts), or None."""
    cfg = _text_config(config)
    heads = cfg.get("num_attention_heads")
    if isinstance(heads, int) and heads % tp:
        sizes = ", ".join(str(d) for d in range(1, heads + 1) if heads % d == 0)
        return f"the model's {heads} attention heads are not divisible by {tp}; use one of {sizes}"
    kv_heads = cfg.get("num_key_value_heads")
    if isinstance(kv_heads, int) and kv_heads % tp and tp % kv_heads:
        return f"the model's {kv_heads} KV heads neither divide nor are a multiple of {tp}"
    return None


def cpu_threads_bind(workers: int, cpus: list[int] | None = None) -> str:
    """`workers` contiguous groups of this process's CPUs, '|'-separated (vLLM's manual binding syntax)."""
    cpus = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
    if len(cpus) < workers:
        raise ValueError(f"vLLM's CPU engine needs a CPU per worker (tensor x pipeline parallel size): {workers} "
                         f"workers, {len(cpus)} CPUs")  # fmt: skip
    per, extra = divmod(len(cpus), workers)
    groups, start = [], 0
    for rank in range(workers):
        size = per + (1 if rank < extra else 0)
        groups.append(",".join(str(c) for c in cpus[start : start + size]))
        start += size
    return "|".join(groups)


def set_cpu_threads_bind(env: dict, workers: int) -> str | None:
    """On vLLM's CPU engine with more than one worker (tensor x pipeline parallel size), set
    VLLM_CPU_OMP_THREADS_BIND in `env` unless the user did; returns the value set (None: nothing to do). Raises
    ValueError when the machine has fewer CPUs than workers."""
    if workers <= 1 or env.get(ENV_CPU_BIND):
        return None
    env[ENV_CPU_BIND] = cpu_threads_bind(workers)
    return env[ENV_CPU_BIND]
