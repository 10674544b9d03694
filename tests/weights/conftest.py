"""Fixtures shared by the weight-refresh tests."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="module")
def tiny() -> str:
    """The tiny Qwen2.5-VL model folder the test servers load (ASYNCWEBRL_TINY_MODEL overrides it)."""
    from asyncwebrl.models.prepare import resolve_model_path

    return os.environ.get("ASYNCWEBRL_TINY_MODEL") or resolve_model_path("tiny-qwen2.5-vl")
