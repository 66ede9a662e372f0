"""Fixtures for the mtsa tests (helpers live in mtsa_models.py, importable by test modules)."""

from __future__ import annotations

import copy

import pytest
from mtsa_models import make_tiny_llama


@pytest.fixture
def tiny_llama():
    return make_tiny_llama


@pytest.fixture
def dense_and_copy():
    def build(seed: int = 0, **kwargs):
        dense = make_tiny_llama(seed, **kwargs)
        return dense, copy.deepcopy(dense)

    return build
