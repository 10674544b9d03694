"""The `ray` scheduler: one placement group per role, role workers as Ray actors in their bundles.

Invariant: every role's workers run inside that role's placement group (one bundle each), so in
disaggregated mode roles never share a device; the test-rollout group is its own placement group,
apart from both others. Without GPUs the bundles are fractional CPU slices.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncwebrl.scheduling.placement import RolePlan

log = logging.getLogger(__name__)

_saved_env: dict[str, str | None] = {}
"""environment init_ray changed for a token-authenticated cluster, restored by `restore_ray_env`"""


def _reload_ray_config() -> None:
    """Ray reads RAY_AUTH_MODE into its C++ config when first imported; re-read it (what Ray's own
    token set-up does after changing the mode)."""
    from ray._raylet import Config

    Config.initialize("")


def restore_ray_env() -> None:
    for k, v in _saved_env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    if _saved_env:
        _reload_ray_config()
    _saved_env.clear()


def init_ray(address: str | None = None, num_cpus: int | None = None, auth_token_file: str | None = None,
             **kwargs) -> bool:
    """Join the Ray cluster at `address` ('auto' or HOST:PORT), or start a private local instance
    (address None) whatever else runs on the machine: no $RAY_ADDRESS nor a `ray start` cluster is
    picked up by accident. True when this call started or joined Ray (and so should shut it down).
    `auth_token_file`: the token of a cluster that uses Ray's token authentication."""
    import ray

    if ray.is_initialized():
        return False
    env = {"env_vars": {"TOKENIZERS_PARALLELISM": "false", "RAY_DEDUP_LOGS": "0"}}
    if address:
        if auth_token_file:
            path = Path(auth_token_file).expanduser()
            if not path.is_file():
                raise FileNotFoundError(f"scheduler.ray_auth_token_file {path} does not exist")
            _saved_env.update({k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH")})
            os.environ["RAY_AUTH_MODE"] = "token"
            os.environ["RAY_AUTH_TOKEN_PATH"] = str(path.resolve())
            _reload_ray_config()
        # the cluster's own resources count: num_cpus/num_gpus may not be given when joining
        ray.init(address=address, runtime_env=env, **kwargs)
    else:
        # Ray 2.60 gives its raylet a fixed 30 s to register; on a loaded machine that can pass, and a
        # fresh attempt then succeeds: try up to three times before giving up
        # Ray starts workers at niceness 15 by default, the trainer rank below the browsers it shares
        # the cores with; the roles set their own priorities (scheduling/budget.py)
        system_config = {"worker_niceness": 0, **kwargs.pop("_system_config", {})}
        for attempt in range(3):
            try:
                ray.init(address="local", num_cpus=num_cpus or os.cpu_count(), include_dashboard=False,
                         runtime_env=env, log_to_driver=True, _system_config=system_config, **kwargs)
                break
            except Exception as e:  # noqa: BLE001 - Ray raises a bare Exception for this
                if "timed out during startup" not in str(e) or attempt == 2:
                    raise
                log.warning("local Ray instance did not start in time (attempt %d of 3): %s", attempt + 1, e)
                ray.shutdown()
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

    def __init__(self, plans: list[RolePlan], address: str | None = None, ready_timeout_s: float = 120.0,
                 auth_token_file: str | None = None):
        import ray
        from ray.util.placement_group import placement_group

        from asyncwebrl.net import ray_spans_nodes

        self.owns_ray = init_ray(address, auth_token_file=auth_token_file)
        self.spans_nodes = ray_spans_nodes()
        """the cluster has several nodes: roles bind and advertise their node's IP, not loopback"""
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

    def bundle_address_and_port(self, role: str, index: int = 0) -> tuple[str, int]:
        """(node address, a port free there) of bundle `index` of `role`: a rendezvous address that
        the role's workers on other nodes can reach."""
        import ray

        from asyncwebrl.net import free_port, node_address

        multi = self.spans_nodes

        @ray.remote(num_cpus=0)
        def probe() -> tuple[str, int]:
            addr = node_address(multi)
            return addr, free_port(addr)

        return ray.get(probe.options(scheduling_strategy=self.groups[role].strategy(index)).remote(), timeout=120)

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
            restore_ray_env()
            self.owns_ray = False


def _server_host_class():
    import ray

    @ray.remote(max_restarts=0)
    class ServerHost:
        """Owns one inference server process inside a role bundle (Ray sets CUDA_VISIBLE_DEVICES)."""

        def __init__(self, kwargs: dict):
            from asyncwebrl.scheduling.servers import launch_server

            # binds this node's address when the cluster spans nodes (kwargs carry multi_node)
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


def start_servers(sched: RayScheduler, role: str, server_kwargs: dict, base_port: int = 0) -> list[Any]:
    """One server per bundle of `role`, on port base_port + i when base_port is set; returns the host
    actor handles (addresses via .address())."""
    host_cls = _server_host_class()
    kw = dict(server_kwargs, multi_node=sched.spans_nodes)
    return [sched.start(role, host_cls, dict(kw, port=base_port + i if base_port else 0), index=i)
            for i in range(sched.groups[role].plan.n)]
