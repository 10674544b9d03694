"""Shared test fixtures: the prepared models are made by `make test` before pytest runs."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def default_model_path() -> str:
    from asyncwebrl.models.prepare import resolve_model_path

    return resolve_model_path("default")
