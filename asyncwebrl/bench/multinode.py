"""`asyncwebrl bench multinode`: a short training run on a Ray cluster of two nodes with distinct
node IPs, on one machine.

The second node runs in a Linux network namespace joined by a veth pair (`scheduling/ray_cluster.py`):
its loopback is not the head's, so any role that advertised or dialled 127.0.0.1 across nodes would
fail the run. Custom node resources pin the roles: the trainer rank on the head node, the rollout
servers, the rollout worker (browsers, episode loops) and its PixelStore on the other. The cluster
uses Ray's token authentication and is joined through `scheduler.ray_address`.

Figures: `nodes`, `distinct_node_ips`, where each role ran, `steps`, `trajectories`,
`failed_episodes` (rollout statistics). Needs root (network namespace).
"""

from __future__ import annotations

import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from asyncwebrl.bench.common import parse_overrides, print_table
from asyncwebrl.results import write_result

DEFAULTS: dict[str, Any] = {
    "steps": 3,
    "model": "tiny-qwen2.5-vl",
    "env": "miniwob",
    "tasks": "click-test,click-button",
    "subnet": 0,
    "start_niceness": 0,
    "seed": 1,
}

TRAINER_RESOURCE, ROLLOUT_RESOURCE = "awrl_trainer_node", "awrl_rollout_node"


@dataclass
class MultinodeFigures:
    nodes: int
    distinct_node_ips: int
    node_ips: list[str]
    trainer_node_ip: str
    server_node_ips: list[str]
    server_addresses: list[str]
    pixelstore_prefixes: list[str]
    steps: int
    trajectories: int
    failed_episodes: int
    missing_pixels: int
    """screenshots the trainer asked a store for and did not get"""
    weight_version_on_servers: list[str] = field(default_factory=list)


def run_multinode(knobs: dict[str, Any], root: Path) -> MultinodeFigures:
    import json
    import urllib.request

    import ray

    from asyncwebrl.config import load_run_config
    from asyncwebrl.controller.main import Controller
    from asyncwebrl.controller.rundir import RunDir
    from asyncwebrl.controller.system import build_system
    from asyncwebrl.scheduling.ray_cluster import RayCluster

    with RayCluster(head_resources={TRAINER_RESOURCE: 100.0}, worker_resources={ROLLOUT_RESOURCE: 100.0},
                    subnet=int(knobs["subnet"]), start_niceness=int(knobs["start_niceness"])) as cluster:
        cfg = load_run_config(None, [
            f"cluster.fileroot={root}", f"total_train_steps={int(knobs['steps'])}", f"actor.path={knobs['model']}",
            "cluster.n_nodes=2", "scheduler.type=ray", f"scheduler.ray_address={cluster.address}",
            f"scheduler.ray_auth_token_file={cluster.token_file}",
            f"scheduler.role_resources.actor={TRAINER_RESOURCE}", f"scheduler.role_resources.rollout={ROLLOUT_RESOURCE}",
            f"env.type={knobs['env']}", f"env.tasks={knobs['tasks']}", "env.max_steps=2",
            "rollout.consumer_batch_size=1", "gconfig.n_samples=2", "test_rollout.enabled=false",
            "stats.progress_bar=false", "stats.tensorboard=false",
            "checkpoint.every_n_steps=0", f"seed={int(knobs['seed'])}",
        ])
        run = RunDir(cfg.run_dir, keep_episodes=2, tensorboard=False, seed=cfg.seed)
        system = build_system(cfg, run)
        try:
            alive = [n for n in ray.nodes() if n.get("Alive")]
            ip_of = {n["NodeID"]: n["NodeManagerAddress"] for n in alive}
            trainer_ip = ip_of[system.scheduler.bundle_nodes("actor")[0]]
            server_ips = [ip_of[ray.get(h.node_id.remote(), timeout=60)] for h in system.server_handles]
            summary = Controller(cfg, system, run).train()
            rstats = system.rollout.stats()
            store = system.pixel_store.stats()
            versions = []
            for a in system.server_addresses:
                req = urllib.request.Request(a + "/weights_checksum",
                                             headers={"Authorization": f"Bearer {system.api_key}"})
                with urllib.request.urlopen(req, timeout=60) as r:
                    versions.append(str(json.loads(r.read()).get("weight_version")))
        finally:
            system.shutdown()
            run.close()
    ips = sorted(ip_of.values())
    return MultinodeFigures(
        nodes=len(alive), distinct_node_ips=len(set(ips)), node_ips=ips, trainer_node_ip=trainer_ip,
        server_node_ips=server_ips, server_addresses=list(system.server_addresses),
        pixelstore_prefixes=sorted(store.get("stores", {})), steps=summary.steps,
        trajectories=summary.trajectories, failed_episodes=rstats.failed_episodes,
        missing_pixels=int(store.get("missing", 0)), weight_version_on_servers=versions,
    )


def main(overrides: list[str]) -> int:
    knobs = parse_overrides(overrides, DEFAULTS)
    with tempfile.TemporaryDirectory(prefix="multinode-") as d:
        figs = run_multinode(knobs, Path(d))
    ok = figs.nodes == 2 and figs.distinct_node_ips == 2 and figs.steps >= 3 and figs.failed_episodes == 0
    path = write_result("multinode", knobs, asdict(figs))
    print_table([{"role": "trainer", "node_ip": figs.trainer_node_ip}]
                + [{"role": f"server {a}", "node_ip": ip} for a, ip in zip(figs.server_addresses, figs.server_node_ips,
                                                                           strict=True)],
                f"{figs.nodes} nodes ({figs.distinct_node_ips} distinct IPs), {figs.steps} steps, "
                f"{figs.trajectories} trajectories, {figs.failed_episodes} failed -> {path}")
    return 0 if ok else 1
