"""Suite-wide test setup: Triton interpreter without a GPU, marker-driven skips, the SmolLM2 checkpoint.

Markers are declared in pyproject.toml (``gpu``, ``e2e``); this file only decides when they skip, so every
test is always collected and a skip always says why.
"""

from __future__ import annotations

import importlib.metadata as md
import os
from pathlib import Path

import pytest
import torch  # importing torch does not import triton (checked), so the variable below is still in time

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # Triton reads TRITON_INTERPRET when it is imported; without a GPU the kernels only run interpreted.
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parent.parent
SMOLLM2_ENV = "MODELOPT_EXT_SMOLLM2"
SMOLLM2_DEFAULT = REPO / ".cache" / "models" / "SmolLM2-135M-Instruct"


def vllm_cpu_platform_reason() -> str | None:
    """Why vLLM's CPU engine cannot run in this interpreter, or None if it can.

    Decided from package metadata (no vLLM import): the official CUDA wheel imports fine but has no
    CPU kernels, so only a CPU build (the ``vllm-cpu`` distribution, or a ``vllm`` built with a ``+cpu``
    version) counts. This mirrors how vLLM itself detects its CPU platform.
    """
    try:
        md.version("vllm-cpu")
        return None
    except md.PackageNotFoundError:
        pass
    try:
        version = md.version("vllm")
    except md.PackageNotFoundError:
        return "vLLM is not installed here; e2e tests run in .venv-cpu (`make test` or `make venv-cpu`)"
    if "cpu" in version:
        return None
    return (
        f"vllm {version} here has no CPU engine (official CUDA wheel); "
        "e2e tests run in .venv-cpu with vllm-cpu (`make test` or `make venv-cpu`)"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    e2e_reason: str | None = None
    e2e_checked = False
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(gpu_skip)
        if "e2e" in item.keywords or "vllm_cpu" in item.keywords:
            if not e2e_checked:
                e2e_reason, e2e_checked = vllm_cpu_platform_reason(), True
            if e2e_reason:
                item.add_marker(pytest.mark.skip(reason=e2e_reason))


def smollm2_path() -> Path:
    """The SmolLM2-135M-Instruct HF checkpoint (``$MODELOPT_EXT_SMOLLM2`` or the `make model` output)."""
    return Path(os.environ.get(SMOLLM2_ENV) or SMOLLM2_DEFAULT).resolve()


@pytest.fixture(scope="session")
def smollm2_checkpoint() -> Path:
    """Path of the SmolLM2 checkpoint; skips (naming `make model`) when it has not been built."""
    path = smollm2_path()
    if not (path / "config.json").is_file():
        pytest.skip(f"SmolLM2 checkpoint not found at {path}: run `make model` (or set {SMOLLM2_ENV})")
    return path
