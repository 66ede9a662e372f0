"""The plugin package's `__all__` lists only public names; the private names outside checks rely on stay importable."""

from __future__ import annotations

import importlib

import pytest

pytest.importorskip("vllm")

PACKAGE = "modelopt_ext.torch.sparsity.attention_sparsity.plugins.vllm"

# Private names kept importable from the package itself (not listed in `__all__`).
PRIVATE_REEXPORTS = (
    "_flashinfer_kv_cache_views",
    "_BACKEND_BY_NATIVE",
    "_SPARSE_BY_NATIVE",
    "_SPARSE_CLASSES",
    "_layers",
)


def test_all_lists_only_public_names():
    package = importlib.import_module(PACKAGE)
    private = [name for name in package.__all__ if name.startswith("_")]
    assert private == [], f"private names in {PACKAGE}.__all__: {private}"
    assert len(set(package.__all__)) == len(package.__all__), "duplicate names in __all__"


def test_every_name_in_all_resolves():
    package = importlib.import_module(PACKAGE)
    missing = [name for name in package.__all__ if not hasattr(package, name)]
    assert missing == [], f"names in {PACKAGE}.__all__ the package does not define: {missing}"


def test_flashinfer_kv_cache_views_is_importable_from_the_package():
    """The published name `_flashinfer_kv_cache_views` stays, from the package and from kv_cache, as the public
    `flashinfer_kv_cache_views`."""
    from modelopt_ext.torch.sparsity.attention_sparsity.plugins.vllm import _flashinfer_kv_cache_views
    from modelopt_ext.torch.sparsity.attention_sparsity.plugins.vllm.kv_cache import (
        _flashinfer_kv_cache_views as defined,
    )
    from modelopt_ext.torch.sparsity.attention_sparsity.plugins.vllm.kv_cache import flashinfer_kv_cache_views

    assert _flashinfer_kv_cache_views is defined is flashinfer_kv_cache_views
    assert callable(_flashinfer_kv_cache_views)


@pytest.mark.parametrize("name", ("flashinfer_kv_cache_views", "flash_attn_kv_cache_views", "cpu_attn_kv_cache_views"))
def test_kv_cache_views_are_public(name):
    package = importlib.import_module(PACKAGE)
    assert name in package.__all__
    assert getattr(package, name) is getattr(importlib.import_module(f"{PACKAGE}.kv_cache"), name)


@pytest.mark.parametrize("name", PRIVATE_REEXPORTS)
def test_private_names_stay_importable_but_unlisted(name):
    package = importlib.import_module(PACKAGE)
    assert hasattr(package, name)
    assert name not in package.__all__
