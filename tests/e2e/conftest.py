"""Shared setup for the end-to-end tests on vLLM's CPU engine (run in .venv-cpu; see tests/conftest.py).

Every engine here runs the way a user's does: vLLM's default multi-process engine (EngineCore and worker processes);
nothing sets VLLM_ENABLE_V1_MULTIPROCESSING.
"""

from __future__ import annotations

import pytest


@pytest.fixture
def vllm_cpu_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Offline, default multiprocessing. Set OMP_NUM_THREADS=1 before the interpreter starts (the Makefile does) for
    steady speed on 2 cores; it is read when torch loads, too early for a fixture. The KV cache must be capped by the
    test (``kv_cache_memory_bytes``), otherwise vLLM claims most of the machine's RAM."""
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
