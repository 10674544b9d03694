"""The `ray` scheduler: one placement group per role, role workers as Ray actors in their bundles.

Invariant: every role's workers run inside that role's placement group (one bundle each), so in
disaggregated mode roles never share a device; the test-rollout group is its own placement group,
apart from both others. Without GPUs the bundles are fractional CPU slices.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from asyncwebrl.scheduling.placement import RolePlan


def init_ray(address: str | None = None, num_cpus: int | None = None, **kwargs) -> bool:
    """Connect to (or start) Ray; True when this call started or joined it (and so should shut it down)."""
    import ray

    if ray.is_initialized():
        return False
    env = {"env_vars": {"TOKENIZERS_PARALLELISM": "false", "RAY_DEDUP_LOGS": "0"}}
    if address:
        ray.init(address=address, runtime_env=env, **kwargs)
    else:
        ray.init(num_cpus=num_cpus or os.cpu_count(), include_dashboard=False, runtime_env=env,
                 log_to_driver=True, **kwargs)
    return True


@dataclass
class RoleGroup:
    plan: RolePlan
    pg: Any
    actors: list[Any] = field(default_factory=list)

    def strategy(self, index: int):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(placement_group=self.pg, placement_group_bundle_index=index,
                                                placement_group_capture_child_tasks=True)


class RayScheduler:
    """Creates the per-role placement groups and starts role actors inside them."""

    def __init__(self, plans: list[RolePlan], address: str | None = None, ready_timeout_s: float = 120.0):
        import ray
        from ray.util.placement_group import placement_group

        self.owns_ray = init_ray(address)
        self.groups: dict[str, RoleGroup] = {}
        for p in plans:
            # STRICT_SPREAD is impossible on one node; PACK keeps a role's devices together.
            pg = placement_group(p.bundles(), strategy="PACK", name=f"asyncwebrl-{p.role}-{os.getpid()}")
            ready, _ = ray.wait([pg.ready()], timeout=ready_timeout_s)
            if not ready:
                raise RuntimeError(
                    f"Ray could not place role '{p.role}' ({p.n} x {p.bundles()[0]}) within {ready_timeout_s:.0f} s: "
                    f"cluster resources are {ray.cluster_resources()}"
                )
            self.groups[p.role] = RoleGroup(p, pg)

    def start(self, role: str, actor_cls, *args, index: int = 0, **kwargs):
        """Start one actor of `actor_cls` (a @ray.remote class) in bundle `index` of `role`."""
        g = self.groups[role]
        opts = {"num_cpus": g.plan.cpus, "scheduling_strategy": g.strategy(index)}
        if g.plan.gpus:
            opts["num_gpus"] = g.plan.gpus
        handle = actor_cls.options(**opts).remote(*args, **kwargs)
        g.actors.append(handle)
        return handle

    def bundle_nodes(self, role: str) -> list[str]:
        """Node id of each bundle of a role (for placement checks and per-node stores)."""
        from ray.util import placement_group_table

        table = placement_group_table(self.groups[role].pg)
        return [table["bundles_to_node_id"][i] for i in range(len(table["bundles"]))]

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for g in self.groups.values():
            for a in g.actors:
                try:
                    ray.kill(a)
                except Exception:
                    pass
            try:
                remove_placement_group(g.pg)
            except Exception:
                pass
        self.groups.clear()
        if self.owns_ray:
            ray.shutdown()
            self.owns_ray = False


def _server_host_class():
    import ray

    @ray.remote(max_restarts=0)
    class ServerHost:
        """Owns one inference server process inside a role bundle (Ray sets CUDA_VISIBLE_DEVICES)."""

        def __init__(self, kwargs: dict):
            from asyncwebrl.scheduling.servers import launch_server

            gpu_ids = ray.get_gpu_ids()
            device = "cuda:0" if gpu_ids else "cpu"
            # Ray narrowed CUDA_VISIBLE_DEVICES to this bundle's GPU; the child inherits it.
            kwargs = dict(kwargs, device=device)
            if device == "cuda:0":
                kwargs["device"] = "cuda:" + os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
            self.server = launch_server(**kwargs)

        def address(self) -> str:
            return self.server.address

        def pid(self) -> int | None:
            return self.server.pid

        def node_id(self) -> str:
            return ray.get_runtime_context().get_node_id()

        def alive(self) -> bool:
            return self.server.alive()

        def stop(self) -> None:
            self.server.stop()

    return ServerHost


def start_servers(sched: RayScheduler, role: str, server_kwargs: dict) -> list[Any]:
    """One server per bundle of `role`; returns the host actor handles (addresses via .address())."""
    host_cls = _server_host_class()
    return [sched.start(role, host_cls, server_kwargs, index=i) for i in range(sched.groups[role].plan.n)]
