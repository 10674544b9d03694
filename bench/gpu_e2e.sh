#!/usr/bin/env bash
# The GPU headline of `asyncwebrl bench e2e` (issues 9, 18) on a 2-GPU box without Ray or Chromium:
# local scheduler, rollout server on GPU 0 (the graph engine), trainer on GPU 1, NCCL weight updates,
# a random-init Qwen2.5-VL-3B-shaped model, workload=web-shaped: the synthetic env replaying real
# MiniWoB++ screenshots and Chromium latencies recorded here (bench/data/web_latency.json),
# heavy-tailed episode lengths, 64 concurrent sessions (batch 8 x n_samples 8), 12 steps per mode.
# The trainer runs the GPU recipe users run: fp32 master weights and AdamW state, bf16 compute
# (actor.mixed_precision, the CUDA default), packed micro-batches of 8192 tokens (docs/gpu.md).
#
# Prepare on a machine with Chromium (the screenshots) and the tiny models (`make test` prepares them):
#   asyncwebrl record-screens .wscache/screens --episodes 48 --tasks miniwob-all
#   mkdir -p .wscache/cache/models && cp -r ~/.cache/asyncwebrl/models/tiny-qwen2.5-vl .wscache/cache/models/
# then on the GPU box:   bash bench/gpu_e2e.sh OUTDIR [GPUS=2] [SHAPE=qwen2.5-vl-3b]
# (GPUS=0 SHAPE=qwen2.5-vl-tiny rehearses the same script on a CPU with the venv.)
# Both modes need more than one 10-minute device call: MODES=sync MODE_DIR=.gpu-halves in one call,
# copy $OUT/halves back into the carried tree, then MODES=async MODE_DIR=.gpu-halves combines them.
set -x
OUTD=${1:-$OUT}; GPUS=${2:-2}; SHAPE=${3:-qwen2.5-vl-3b}; STEPS=${STEPS:-12}
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
$PY -m asyncwebrl.cli bench e2e workload=web-shaped scheduler=local gpus=$GPUS model=/tmp/awrl-model steps=$STEPS \
  batch=8 n_samples=8 max_new_tokens=16 eta=1 out=${OUTNAME:-e2e-gpu} modes=${MODES:-sync,async} mode_dir=${MODE_DIR:-} fileroot=${FILEROOT:-/tmp/awrl-runs} \
  "extra=inference.dtype=bfloat16;actor.dtype=float32;actor.mixed_precision=true;actor.mb_max_tokens=8192;env.synthetic_replay_dir=$SCREENS;inference.startup_timeout_s=300;inference.max_batch_size=64;inference.max_context_len=1024"
[ -n "$MODE_DIR" ] && mkdir -p $OUTD/halves && cp $MODE_DIR/*.json $OUTD/halves/
echo "e2e done after $(( $(date +%s) - T0 )) s"
# the servers' logs (engine stats, graph capture) next to the result
tail -n 30 ${FILEROOT:-/tmp/awrl-runs}/asyncwebrl/*/logs/*.log > $OUTD/servers.log 2>/dev/null
