"""The shared-device layout (issue 31): `hf[rollout]:d1|fsdp[actor]:d1` with rollout.mode=async keeps
the train-rollout server and the trainer rank resident together, both running, and trains through the
production controller; each refresh reaches the server without a network (SGLang's
/update_weights_from_tensor, shared memory on a CPU). A layout that cannot fit is refused before
anything starts, with the estimate in the message."""

from __future__ import annotations

import json
import os
import urllib.request

import pytest

from asyncwebrl.config import load_run_config
from asyncwebrl.configtree import ConfigError
from asyncwebrl.scheduling.placement import local_device_assignment, plan_roles

SHARED = "allocation_mode=hf[rollout]:d1|fsdp[actor]:d1"


def _get(url: str, key: str) -> dict:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def _tiny() -> str:
    from pathlib import Path

    from asyncwebrl.models.prepare import resolve_model_path

    return str(Path(resolve_model_path("default")).parent / "tiny-qwen2.5-vl")


@pytest.mark.slow
@pytest.mark.parametrize("trainer_process", ["controller", "own"])
def test_shared_device_async_layout_trains_through_the_controller(tmp_path, trainer_process):
    """Both local hosts of the trainer rank: inside the controller process, and in a process of its own
    (the GPU default under async, where rollout threads would otherwise share its interpreter lock)."""
    from asyncwebrl.controller.main import Controller
    from asyncwebrl.controller.rundir import RunDir, read_jsonl
    from asyncwebrl.controller.system import build_system

    steps = 3
    cfg = load_run_config(None, [
        SHARED, "rollout.mode=async", "scheduler.type=local", f"cluster.fileroot={tmp_path}",
        f"total_train_steps={steps}", "rollout.consumer_batch_size=1", "gconfig.n_samples=2", "env.type=synthetic",
        "env.max_steps=2", "test_rollout.enabled=false", "test_rollout.heldout_tasks=''", "checkpoint.every_n_steps=0",
        "stats.progress_bar=false", f"actor.path={_tiny()}", "gconfig.max_new_tokens=4", "actor.mb_max_tokens=2048",
        f"scheduler.trainer_process={trainer_process}",
    ])
    run = RunDir(cfg.run_dir, keep_episodes=2, tensorboard=False)
    system = build_system(cfg, run)
    try:
        summary = Controller(cfg, system, run).train()
        assert summary.steps == steps and summary.version == steps
        [addr] = system.server_addresses
        served = _get(addr + "/weights_checksum", system.api_key)
        want = system.trainer.weights_checksum()
        if trainer_process == "own":  # the rank answers from its own process
            assert system.trainer.ranks[0].pid() != os.getpid()
        assert served["weight_version"] == str(steps) and served["sha256"] == want
        events = _get(addr + "/server_info", system.api_key)["control_events"]
        assert events.count("/update_weights_from_tensor") >= steps  # the same-device path, every step
        assert "/init_weights_update_group" not in events and "/update_weights_from_distributed" not in events
        stats = system.rollout.stats()
        assert stats.mode == "async" and stats.consumed_groups == steps and stats.lost_rollouts == 0
        train = [r for r in read_jsonl(run.root / "metrics.jsonl") if r["kind"] == "train"]
        assert [r["version"] for r in train] == list(range(1, steps + 1))
    finally:
        system.shutdown()
        run.close()


def test_shared_layout_puts_server_and_trainer_rank_on_one_gpu_and_plus_keeps_them_apart():
    shared = load_run_config(None, ["allocation_mode=sglang[rollout]:d2|fsdp[actor]:d2", "cluster.n_gpus_per_node=2",
                                    "scheduler.type=ray", "test_rollout.enabled=false"])
    plans = plan_roles(shared)
    assert [p.gpus for p in plans] == [0.5, 0.5]  # each asks half a GPU: the pair fits one device
    assert local_device_assignment(plans, 2) == {"rollout": ["cuda:0", "cuda:1"], "actor": ["cuda:0", "cuda:1"]}
    apart = load_run_config(None, ["allocation_mode=sglang[rollout]:d1+fsdp[actor]:d1", "cluster.n_gpus_per_node=2",
                                   "test_rollout.enabled=false"])
    assert local_device_assignment(plan_roles(apart), 2) == {"rollout": ["cuda:0"], "actor": ["cuda:1"]}


def test_layout_that_cannot_fit_is_refused_before_start_with_the_estimate():
    base = [SHARED, "rollout.mode=async", "cluster.n_gpus_per_node=1", f"actor.path={_tiny()}",
            "test_rollout.enabled=false", "scheduler.type=local"]
    # a 2 GiB device: two CUDA contexts alone exceed it, so no share fits
    with pytest.raises(ConfigError) as e:
        load_run_config(None, base + ["cluster.device_memory_gb=2"])
    msg = str(e.value)
    for part in ("do not fit", "server", "KV cache", "trainer", "optimizer", "activations at mb_max_tokens",
                 "device 2.0 GiB", "no share fits"):
        assert part in msg, (part, msg)
    # a share that leaves the trainer too little: refused, and the message says which shares fit
    with pytest.raises(ConfigError, match=r"set inference.mem_fraction_static between 0\.\d\d and 0\.\d\d"):
        load_run_config(None, base + ["cluster.device_memory_gb=16", "inference.mem_fraction_static=0.95"])
    ok = load_run_config(None, base + ["cluster.device_memory_gb=16", "inference.mem_fraction_static=0.4"])
    assert ok.inference.mem_fraction_static == 0.4
