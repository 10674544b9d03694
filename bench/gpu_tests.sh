#!/usr/bin/env bash
# The CUDA tests, on the GPU box (carry .wscache and .whl, as bench/gpu_e2e_1gpu.sh does):
#   bash bench/gpu_tests.sh
# They skip on a machine without CUDA, so `make test` on a CPU never runs them: the GPU recipe's step
# against the fp32 step (tests/training/test_precision.py), the GPU engine against transformers
# (tests/inference/test_graph_engine.py) and the captured same-device landing
# (tests/weights/test_landing.py). The box has pytest but no Chromium, Ray or registry; the tiny models
# come from the carried cache.
set -euo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
WHL=${WHL:-.whl}
if ls $WHL/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $WHL/*.whl
  export PYTHONPATH=/tmp/site:$PWD
fi
export ASYNCWEBRL_CACHE=${ASYNCWEBRL_CACHE:-$PWD/.wscache/cache}
export ASYNCWEBRL_TINY_MODEL=${ASYNCWEBRL_TINY_MODEL:-$ASYNCWEBRL_CACHE/models/tiny-qwen2.5-vl}
python3 -m pytest -q -p no:cacheprovider -rs tests/training/test_precision.py tests/inference/test_graph_engine.py tests/weights/test_landing.py "$@"
