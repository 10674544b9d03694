#!/usr/bin/env bash
# The GPU workload of `asyncwebrl bench e2e` (issue 9) on a 2-GPU box without Ray or Chromium:
# local scheduler, rollout server on GPU 0, trainer on GPU 1, NCCL weight updates, a random-init
# Qwen2.5-VL-3B-shaped model, and the synthetic env replaying real MiniWoB++ screenshots.
#
# Prepare on a machine with Chromium (the screenshots) and the tiny models (`make test` prepares them):
#   asyncwebrl record-screens .wscache/screens --episodes 48 --tasks miniwob-all
#   mkdir -p .wscache/cache/models && cp -r ~/.cache/asyncwebrl/models/tiny-qwen2.5-vl .wscache/cache/models/
# then on the GPU box:   bash bench/gpu_e2e.sh OUTDIR [GPUS=2] [SHAPE=qwen2.5-vl-3b]
# (GPUS=0 SHAPE=qwen2.5-vl-tiny rehearses the same script on a CPU with the venv.)
set -x
OUTD=${1:-$OUT}; GPUS=${2:-2}; SHAPE=${3:-qwen2.5-vl-3b}
SCREENS=${SCREENS:-.wscache/screens}
export NCCL_NVLS_ENABLE=0 ASYNCWEBRL_CACHE=${ASYNCWEBRL_CACHE:-$PWD/.wscache/cache} ASYNCWEBRL_BENCH_DIR=$OUTD PYTHONUNBUFFERED=1
if [ "$GPUS" != 0 ]; then
  if ls .whl/*.whl >/dev/null 2>&1; then  # wheels carried to a box without a registry
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
  fi
  nvidia-smi -L
  PY=${PY:-python3}
else
  PY=${PY:-.venv/bin/python}
fi
T0=$(date +%s)
$PY -c "from asyncwebrl.bench.inference import make_random_model as m; m('$SHAPE', '/tmp/awrl-model', 'bfloat16')" || exit 1
echo "model ready after $(( $(date +%s) - T0 )) s"
$PY -m asyncwebrl.cli bench e2e scheduler=local env=synthetic gpus=$GPUS model=/tmp/awrl-model steps=4 batch=2 \
  n_samples=4 max_steps=3 max_new_tokens=16 eta=1 out=e2e-gpu fileroot=$OUTD/runs \
  "extra=inference.dtype=bfloat16;actor.dtype=bfloat16;env.synthetic_replay_dir=$SCREENS;inference.startup_timeout_s=300"
echo "e2e done after $(( $(date +%s) - T0 )) s"
