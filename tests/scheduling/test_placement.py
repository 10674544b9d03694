"""Role placement from allocation_mode: on a simulated multi-node GPU cluster and on CPU slices."""

import pytest

from asyncwebrl.config import load_run_config
from asyncwebrl.configtree import ConfigError
from asyncwebrl.scheduling.placement import local_device_assignment, plan_roles


def _cfg(*ov):
    return load_run_config(None, list(ov))


def test_cpu_machine_gets_fractional_slices_for_three_groups():
    plans = {p.role: p for p in plan_roles(_cfg("allocation_mode=hf[rollout]:d2+fsdp[actor]:d2",
                                                "test_rollout.enabled=true"))}
    assert set(plans) == {"rollout", "actor", "test-rollout"}
    assert plans["rollout"].n == 2 and plans["actor"].n == 2 and plans["test-rollout"].n == 1
    assert all(p.gpus == 0 and 0 < p.cpus < 1 for p in plans.values())


def test_local_assignment_never_shares_a_gpu():
    cfg = _cfg("allocation_mode=hf[rollout]:d2+fsdp[actor]:d1", "cluster.n_gpus_per_node=4",
               "test_rollout.enabled=true", "test_rollout.n_gpus=1")
    devs = local_device_assignment(plan_roles(cfg), 4)
    assert devs == {"rollout": ["cuda:0", "cuda:1"], "actor": ["cuda:2"], "test-rollout": ["cuda:3"]}
    with pytest.raises(ConfigError, match="needs more GPUs"):
        local_device_assignment(plan_roles(cfg), 3)


def test_too_few_gpus_is_rejected_at_config_time():
    with pytest.raises(ConfigError, match="need 5 devices"):
        _cfg("allocation_mode=sglang[rollout]:d2+fsdp[actor]:d2", "cluster.n_gpus_per_node=4",
             "test_rollout.enabled=true", "test_rollout.n_gpus=1")


@pytest.mark.slow
def test_multi_node_cluster_places_roles_on_separate_gpus():
    import ray
    from ray.cluster_utils import Cluster

    from asyncwebrl.scheduling.ray_scheduler import RayScheduler

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0})
    nodes = [cluster.add_node(num_cpus=4, num_gpus=4) for _ in range(2)]
    try:
        ray.init(address=cluster.address, include_dashboard=False)
        cluster.wait_for_nodes()
        cfg = _cfg("allocation_mode=sglang[rollout]:d4+fsdp[actor]:d3", "cluster.n_nodes=2",
                   "cluster.n_gpus_per_node=4", "test_rollout.enabled=true", "test_rollout.n_gpus=1")
        sched = RayScheduler(plan_roles(cfg), ready_timeout_s=60)

        @ray.remote
        class Probe:
            def where(self):
                return ray.get_runtime_context().get_node_id(), tuple(ray.get_gpu_ids())

        seen = {}
        for role, n in (("rollout", 4), ("actor", 3), ("test-rollout", 1)):
            handles = [sched.start(role, Probe, index=i) for i in range(n)]
            seen[role] = ray.get([h.where.remote() for h in handles])
        devices = [(node, gpu) for locs in seen.values() for node, gpus in locs for gpu in gpus]
        assert len(devices) == 8 and len(set(devices)) == 8, seen  # no device shared across roles
        gpu_nodes = {n.node_id for n in nodes}
        assert {node for locs in seen.values() for node, _ in locs} <= gpu_nodes
        # PACK keeps the 4 rollout servers on one node
        assert len({node for node, _ in seen["rollout"]}) == 1
        sched.shutdown()
    finally:
        ray.shutdown()
        cluster.shutdown()
