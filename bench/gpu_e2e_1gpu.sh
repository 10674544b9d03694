#!/usr/bin/env bash
# One GPU (issue 31): the shared-device layout, hf[rollout]:d1|fsdp[actor]:d1 — the train-rollout server
# and the trainer rank resident on the same GPU, both running (async), or taking turns (sync: the
# baseline). Local scheduler, no Ray or Chromium on the box, a random-init Qwen2.5-VL-3B-shaped model,
# workload=web-shaped (the synthetic env replaying recorded MiniWoB++ screenshots and Chromium
# latencies, 64 concurrent sessions), weights over the same-device path (CUDA IPC handles,
# /update_weights_from_tensor). A copy of bench/gpu_e2e.sh for this layout; the trainer runs the GPU recipe
# (fp32 master weights, bf16 compute, packed micro-batches of 8192 tokens) and the server's share of the
# device is inference.mem_fraction_static=SHARE (0.2: the fit estimate allows 0.07-0.27 for 3B here).
#
# Prepare here (Chromium and the tiny models needed):
#   asyncwebrl record-screens .wscache/screens --episodes 48 --tasks miniwob-all
#   mkdir -p .wscache/cache/models && cp -r ~/.cache/asyncwebrl/models/tiny-qwen2.5-vl .wscache/cache/models/
# then on the GPU box (carry .wscache):   bash bench/gpu_e2e_1gpu.sh OUTDIR [GPUS=1] [SHAPE=qwen2.5-vl-3b]
#   WS_SIZE=3B   also run `bench weightsync path=same_device` at that size first ('' = skip)
#   MODES=sync MODE_DIR=.gpu-halves-1gpu   one half per call (copy $OUT/halves back, carry it, then MODES=async)
#   MODES=none   weightsync only
# GPUS=0 SHAPE=qwen2.5-vl-tiny WS_SIZE=135M STEPS=2 rehearses the same script on a CPU with the venv.
# Others may be editing the tree: run it from a snapshot of HEAD (git archive HEAD | tar -x -C .wscache/src),
# with SCREENS, ASYNCWEBRL_CACHE and WHL pointing back at the carried folders.
set -x
OUTD=${1:-$OUT}; GPUS=${2:-1}; SHAPE=${3:-qwen2.5-vl-3b}; STEPS=${STEPS:-12}; WS_SIZE=${WS_SIZE-3B}
SCREENS=${SCREENS:-.wscache/screens}; SHARE=${SHARE:-0.15}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export ASYNCWEBRL_CACHE=${ASYNCWEBRL_CACHE:-$PWD/.wscache/cache} ASYNCWEBRL_BENCH_DIR=$OUTD PYTHONUNBUFFERED=1
if [ "$GPUS" != 0 ]; then
  WHL=${WHL:-.whl}
  if ls $WHL/*.whl >/dev/null 2>&1; then  # wheels carried to a box without a registry (pydantic)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $WHL/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
  fi
  nvidia-smi -L
  PY=${PY:-python3}; DEV=cuda
else
  PY=${PY:-.venv/bin/python}; DEV=cpu
fi
T0=$(date +%s)
if [ -n "$WS_SIZE" ]; then
  $PY -m asyncwebrl.cli bench weightsync path=same_device device=$DEV sizes=$WS_SIZE repeats=${WS_REPEATS:-3} \
    tokenizer=tiny-qwen2.5-vl bucket_mb=${WS_BUCKETS:-1024,4096} out=${WS_OUT:-weightsync_1gpu} > $OUTD/weightsync.log 2>&1 \
    || { echo "weightsync failed"; tail -n 40 $OUTD/weightsync.log; }
  echo "weightsync done after $(( $(date +%s) - T0 )) s"
fi
[ "${MODES:-}" = none ] && exit 0
if [ ! -f /tmp/awrl-model/.shape-$SHAPE ]; then  # a warm box keeps it from the previous call
  rm -rf /tmp/awrl-model
  $PY -c "from asyncwebrl.bench.inference import make_random_model as m; m('$SHAPE', '/tmp/awrl-model', 'bfloat16')" || exit 1
  touch /tmp/awrl-model/.shape-$SHAPE
fi
echo "model ready after $(( $(date +%s) - T0 )) s"
# E2E_TIMEOUT (s, 0 = none) ends a half that runs too long; the newest run's timeline and metrics are
# copied out either way, so a half that did not finish still shows how far it got and where its time went
timeout ${E2E_TIMEOUT:-0} $PY -m asyncwebrl.cli bench e2e workload=web-shaped scheduler=local gpus=$GPUS model=/tmp/awrl-model steps=$STEPS \
  batch=8 n_samples=8 max_new_tokens=16 eta=1 out=${OUTNAME:-e2e-1gpu} modes=${MODES:-sync,async} mode_dir=${MODE_DIR:-} \
  fileroot=${FILEROOT:-/tmp/awrl-runs} \
  "extra=allocation_mode=hf[rollout]:d1|fsdp[actor]:d1;inference.mem_fraction_static=$SHARE;inference.dtype=bfloat16;actor.dtype=float32;actor.mixed_precision=true;actor.mb_max_tokens=${MB:-4096};env.synthetic_replay_dir=$SCREENS;inference.startup_timeout_s=300;inference.max_batch_size=64;inference.max_context_len=1024"
[ -n "$MODE_DIR" ] && mkdir -p $OUTD/halves && cp $MODE_DIR/*.json $OUTD/halves/
echo "e2e done after $(( $(date +%s) - T0 )) s"
RUN=$(ls -td ${FILEROOT:-/tmp/awrl-runs}/asyncwebrl/*/ 2>/dev/null | head -n 1)
if [ -n "$RUN" ]; then
  cp $RUN/timeline.jsonl $OUTD/timeline.jsonl 2>/dev/null; cp $RUN/metrics.jsonl $OUTD/metrics.jsonl 2>/dev/null
  tail -n 30 $RUN/logs/*.log > $OUTD/servers.log 2>/dev/null
fi
true
