"""Runs on real Ray clusters started with `ray start` beforehand: joining one (token authentication),
a default run beside it (a private instance), and a run spanning two nodes with distinct node IPs."""

import os
import shutil
import subprocess
import sys

import pytest

from asyncwebrl.scheduling.ray_cluster import RayCluster

pytestmark = pytest.mark.slow


TRAIN = ["total_train_steps=2", "actor.path=tiny-qwen2.5-vl", "env.type=synthetic", "env.max_steps=1",
         "rollout.consumer_batch_size=1", "gconfig.n_samples=2", "test_rollout.enabled=false",
         "stats.progress_bar=false", "stats.tensorboard=false", "checkpoint.every_n_steps=0"]


def _train_cli(tmp_path, name: str, extra: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """`asyncwebrl train` as a user starts it: a process of its own. (In one pytest process, Ray keeps the
    first cluster's auth token and GCS client around, and a later cluster refuses the driver.)"""
    return subprocess.run([sys.executable, "-m", "asyncwebrl", "train", f"cluster.fileroot={tmp_path}",
                           f"trial_name={name}", *TRAIN, *extra], env=env, capture_output=True, text=True,
                          timeout=1200)


def test_trains_on_a_cluster_started_beforehand_and_a_default_run_succeeds_beside_it(tmp_path):
    with RayCluster(head_resources={"awrl_test": 10.0}, start_niceness=-10) as cluster:
        base = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN")}
        joined = _train_cli(tmp_path, "joined", [f"scheduler.ray_address={cluster.address}",
                                                 f"scheduler.ray_auth_token_file={cluster.token_file}"], base)
        assert joined.returncode == 0, joined.stderr[-3000:]
        assert "steps / version    2 / 2" in joined.stdout and ", 0 failed," in joined.stdout
        # the run really joined the cluster: it ran on the cluster's GCS, not a private instance
        port = cluster.address.rsplit(":", 1)[1]
        assert f":{port}" in joined.stderr + joined.stdout, "the joined run never mentions the cluster's GCS"
        # a default `asyncwebrl train` beside it, with the cluster advertised in its environment, runs
        # on a private instance of its own
        beside = _train_cli(tmp_path, "beside", [], dict(base, RAY_ADDRESS=cluster.address))
        assert beside.returncode == 0, beside.stderr[-3000:]
        assert "steps / version    2 / 2" in beside.stdout  # (before: "When connecting to an existing cluster ...")
        assert "Started a local Ray instance" in beside.stderr + beside.stdout


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip"), reason="needs root and iproute2 (network namespace)")
def test_training_spans_two_nodes_with_distinct_node_ips(tmp_path):
    """`asyncwebrl bench multinode` in a process of its own; its typed record comes back from its file."""
    import json

    from asyncwebrl.bench.multinode import MultinodeFigures

    out = tmp_path / "results"
    r = subprocess.run([sys.executable, "-m", "asyncwebrl", "bench", "multinode", "steps=3", "env=synthetic",
                        "tasks=synthetic", "start_niceness=-10", "seed=1"],
                       env=dict(os.environ, ASYNCWEBRL_BENCH_DIR=str(out)), capture_output=True, text=True,
                       timeout=1500)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    figs = MultinodeFigures(**json.loads((out / "multinode.json").read_text())["figures"])
    assert figs.nodes == 2 and figs.distinct_node_ips == 2
    assert figs.steps == 3 and figs.trajectories == 6 and figs.failed_episodes == 0 and figs.missing_pixels == 0
    # the servers run on the other node and are dialled at its address, the trainer on the head
    (rollout_ip,) = set(figs.node_ips) - {figs.trainer_node_ip}
    assert figs.server_node_ips == [rollout_ip]
    assert all(a.startswith(f"http://{rollout_ip}:") for a in figs.server_addresses)
    assert figs.weight_version_on_servers == ["3"]


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip"), reason="needs root and iproute2 (network namespace)")
def test_clusters_beside_each_other_never_share_a_veth_subnet():
    """Two runs on one host (a CI job beside a session's test run) each take a subnet of their own; one
    that names a held subnet is told so instead of sending its packets into the other's veth."""
    a, b, c = RayCluster(worker_resources={}), RayCluster(worker_resources={}), None
    try:
        ip_a, ip_b = a._make_netns(), b._make_netns()
        assert a.subnet != b.subnet and ip_a != ip_b
        c = RayCluster(worker_resources={}, subnet=a.subnet)
        with pytest.raises(RuntimeError, match=f"10.231.{a.subnet}.0/24 is (in use|held)"):
            c._make_netns()
        # a port on the head's side of the veth is reachable from inside the second node's namespace
        import socket

        with socket.create_server((ip_a, 0)) as srv:
            port = srv.getsockname()[1]
            dial = subprocess.run(["ip", "netns", "exec", a._netns, sys.executable, "-c",
                                   f"import socket; socket.create_connection(({ip_a!r}, {port}), timeout=5).close()"],
                                  capture_output=True, text=True, timeout=30)
            assert dial.returncode == 0, dial.stderr
    finally:
        for cl in (a, b, c):
            if cl is not None:
                cl.stop()
    routes = subprocess.run(["ip", "-4", "route", "show"], capture_output=True, text=True).stdout
    assert f"10.231.{a.subnet}.0/24" not in routes and f"10.231.{b.subnet}.0/24" not in routes
