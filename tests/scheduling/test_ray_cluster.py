"""Runs on real Ray clusters started with `ray start` beforehand: joining one (token authentication),
a default run beside it (a private instance), and a run spanning two nodes with distinct node IPs."""

import os
import shutil

import pytest

from asyncwebrl.config import load_run_config
from asyncwebrl.scheduling.ray_cluster import RayCluster

pytestmark = pytest.mark.slow


def _train(tmp_path, name: str, extra: list[str]) -> tuple[object, str]:
    import ray

    from asyncwebrl.controller.main import Controller
    from asyncwebrl.controller.rundir import RunDir
    from asyncwebrl.controller.system import build_system

    cfg = load_run_config(None, [
        f"cluster.fileroot={tmp_path}", f"trial_name={name}", "total_train_steps=2", "actor.path=tiny-qwen2.5-vl",
        "scheduler.type=ray", "env.type=synthetic", "env.max_steps=1", "rollout.consumer_batch_size=1",
        "gconfig.n_samples=2", "test_rollout.enabled=false", "stats.progress_bar=false",
        "stats.tensorboard=false", "checkpoint.every_n_steps=0", *extra,
    ])
    run = RunDir(cfg.run_dir, keep_episodes=0, tensorboard=False)
    system = build_system(cfg, run)
    try:
        gcs = ray.get_runtime_context().gcs_address
        summary = Controller(cfg, system, run).train()
        failed = system.rollout.stats().failed_episodes
    finally:
        system.shutdown()
        run.close()
    assert not ray.is_initialized()
    assert failed == 0
    return summary, gcs


def test_trains_on_a_cluster_started_beforehand_and_a_default_run_succeeds_beside_it(tmp_path, monkeypatch):
    with RayCluster(head_resources={"awrl_test": 10.0}) as cluster:
        summary, gcs = _train(tmp_path, "joined", [f"scheduler.ray_address={cluster.address}",
                                                   f"scheduler.ray_auth_token_file={cluster.token_file}"])
        assert summary.steps == 2 and gcs == cluster.address
        # a default run with the cluster advertised in the environment still gets its own instance
        monkeypatch.setenv("RAY_ADDRESS", cluster.address)
        summary, gcs = _train(tmp_path, "beside", [])
        assert summary.steps == 2 and gcs != cluster.address


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip"), reason="needs root and iproute2 (network namespace)")
def test_training_spans_two_nodes_with_distinct_node_ips(tmp_path):
    from asyncwebrl.bench.multinode import run_multinode

    figs = run_multinode({"steps": 3, "model": "tiny-qwen2.5-vl", "env": "synthetic", "tasks": "synthetic",
                          "subnet": 77, "start_niceness": 0, "seed": 1}, tmp_path)
    assert figs.nodes == 2 and figs.distinct_node_ips == 2
    assert figs.steps == 3 and figs.trajectories == 6 and figs.failed_episodes == 0 and figs.missing_pixels == 0
    # the servers run on the other node and are dialled at its address, the trainer on the head
    (rollout_ip,) = set(figs.node_ips) - {figs.trainer_node_ip}
    assert figs.server_node_ips == [rollout_ip]
    assert all(a.startswith(f"http://{rollout_ip}:") for a in figs.server_addresses)
    assert figs.weight_version_on_servers == ["3"]
