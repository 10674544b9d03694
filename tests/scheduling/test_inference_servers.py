"""cluster.n_inference_servers (SPEC section 1): validated against allocation_mode and rollout.mode
before anything starts, and it sets how many train-rollout servers start (on inference.base_port up)."""

import json
import socket
import urllib.request

import pytest

from asyncwebrl.config import load_run_config
from asyncwebrl.configtree import ConfigError
from asyncwebrl.net import LOOPBACK, free_port


@pytest.mark.parametrize("overrides, says", [
    (["cluster.n_inference_servers=2", "rollout.mode=sync"], "rollout.mode=sync contradicts"),
    (["cluster.n_inference_servers=0"], "which is rollout.mode=sync"),
    (["cluster.n_inference_servers=1", "allocation_mode=hf[rollout]:d1|fsdp[actor]:d1"], "colocates the rollout role"),
    (["cluster.n_inference_servers=3", "cluster.n_gpus_per_node=8", "allocation_mode=sglang[rollout]:d2+fsdp[actor]:d1"],
     "make them agree"),
    (["inference.base_port=70000"], "inference.base_port"),
    (["pixelstore.encoding=png"], "unknown config key 'pixelstore.encoding'"),
])
def test_contradictions_fail_before_start(overrides, says):
    with pytest.raises(ConfigError, match=says.replace("(", r"\(").replace(".", r"\.")):
        load_run_config(None, overrides)


def test_sync_pool_without_dedicated_servers_and_async_with_them_are_accepted():
    assert load_run_config(None, ["cluster.n_inference_servers=0", "rollout.mode=sync"]).n_rollout_servers == 1
    assert load_run_config(None, ["cluster.n_inference_servers=3"]).n_rollout_servers == 3
    assert load_run_config(None, []).n_rollout_servers == 1  # null: one per rollout device


def _two_free_ports() -> int:
    """A port p with p and p + 1 both free a moment ago (the servers take base_port + i): free_port()
    alone leaves p + 1 to chance, and an ephemeral port another process holds there fails the start."""
    for _ in range(50):
        base = free_port()
        with socket.socket() as a, socket.socket() as b:
            try:
                a.bind((LOOPBACK, base))
                b.bind((LOOPBACK, base + 1))
            except OSError:
                continue
        return base
    raise RuntimeError("no two consecutive free ports on loopback in 50 tries")


@pytest.mark.slow
def test_n_inference_servers_changes_what_starts(tmp_path):
    from asyncwebrl.controller.main import Controller
    from asyncwebrl.controller.rundir import RunDir
    from asyncwebrl.controller.system import build_system

    base = _two_free_ports()
    cfg = load_run_config(None, [
        f"cluster.fileroot={tmp_path}", "total_train_steps=1", "actor.path=tiny-qwen2.5-vl",
        "scheduler.type=local", "cluster.n_inference_servers=2", f"inference.base_port={base}",
        "env.type=synthetic", "env.max_steps=1", "rollout.consumer_batch_size=1", "gconfig.n_samples=2",
        "test_rollout.enabled=false", "stats.progress_bar=false",
        "stats.tensorboard=false", "checkpoint.every_n_steps=0",
    ])
    run = RunDir(cfg.run_dir, keep_episodes=0, tensorboard=False)
    system = build_system(cfg, run)
    try:
        assert [a.rsplit(":", 1)[1] for a in system.server_addresses] == [str(base), str(base + 1)]
        assert len({h.pid for h in system.server_handles}) == 2
        Controller(cfg, system, run).train()
        for a in system.server_addresses:  # both servers are in the weight group and got version 1
            req = urllib.request.Request(a + "/weights_checksum", headers={"Authorization": f"Bearer {system.api_key}"})
            with urllib.request.urlopen(req, timeout=60) as r:
                assert json.loads(r.read())["weight_version"] == "1"
    finally:
        system.shutdown()
        run.close()
