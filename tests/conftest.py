"""Shared test fixtures: the prepared models are made by `make test` before pytest runs."""

from __future__ import annotations

import os
import tempfile

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Tests never write the committed results: anything a test (or a subprocess it starts) would write to
# bench/results goes to a throw-away folder instead. Set before asyncwebrl.bench.common is imported.
os.environ["ASYNCWEBRL_BENCH_DIR"] = tempfile.mkdtemp(prefix="awrl-test-results-")


@pytest.fixture(scope="session")
def default_model_path() -> str:
    from asyncwebrl.models.prepare import resolve_model_path

    return resolve_model_path("default")
