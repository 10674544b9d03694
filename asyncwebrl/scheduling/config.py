"""Config of process placement (SPEC section 1)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(kw_only=True)
class SchedulerConfig:
    type: Literal["local", "ray"] = "ray"
    """ray = placement groups on a (local or remote) Ray cluster; local = subprocesses, no Ray"""
    ray_address: str | None = None
    """None = a private local Ray instance for this run (whatever else runs on the machine);
    'auto' = join the cluster `ray start` runs on this machine (or $RAY_ADDRESS); 'HOST:PORT' = join it"""
    ray_auth_token_file: str | None = None
    """joining a cluster with Ray token authentication: the file holding its token (None = Ray's own
    lookup: $RAY_AUTH_TOKEN, $RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token)"""
    role_resources: dict[str, str] = field(default_factory=dict)
    """role -> custom Ray node resource its workers need (pins roles to nodes), e.g.
    {actor: trainer_node, rollout: rollout_node}; roles: actor, rollout (servers and rollout workers), test-rollout"""
    cpus_per_role: float = 0.2
    """CPU share of one role process on machines without GPUs (fractional Ray bundles)"""
    rollout_niceness: int | None = None
    """priority of inference servers and rollout workers (and the browsers they start) beside the
    trainer: None = automatic (10 on a machine without GPUs, where the roles share cores, so the
    trainer keeps its cores and rollout fills their idle time; 0 with GPUs); 0 = normal priority"""

    trainer_process: Literal["auto", "own", "controller"] = "auto"
    """where scheduler.type=local hosts the trainer rank: own = a process of its own (its own
    interpreter lock, so rollout threads never stall its kernel launches and compiles); controller =
    inside the controller process (the tests reach the actor directly); auto = own when rollout is
    async on GPUs (the shared-device layout), controller otherwise"""

    def validate(self) -> None:
        if self.rollout_niceness is not None and not 0 <= self.rollout_niceness <= 19:
            raise ValueError(f"scheduler.rollout_niceness must be in 0..19 (or null = automatic), got "
                             f"{self.rollout_niceness}")
        bad = set(self.role_resources) - {"actor", "rollout", "test-rollout"}
        if bad:
            raise ValueError(f"scheduler.role_resources has unknown roles {sorted(bad)} (actor, rollout, test-rollout)")
        if self.role_resources and self.type != "ray":
            raise ValueError("scheduler.role_resources pins roles to Ray nodes; it needs scheduler.type=ray")
        if self.trainer_process == "controller" and self.type == "ray":
            raise ValueError("scheduler.trainer_process=controller is for scheduler.type=local (Ray hosts every "
                             "trainer rank in an actor process of its own)")
        if self.ray_address is not None and self.type != "ray":
            raise ValueError("scheduler.ray_address joins a Ray cluster; it needs scheduler.type=ray")
        if self.ray_auth_token_file is not None and self.ray_address is None:
            raise ValueError("scheduler.ray_auth_token_file is for joining a cluster: set scheduler.ray_address too")


@dataclass(kw_only=True)
class ClusterConfig:
    n_nodes: int = 1
    """nodes of the cluster"""
    n_gpus_per_node: int = 0
    """GPUs per node (0 = CPU-only machine)"""
    n_inference_servers: int | None = None
    """train-rollout inference servers. >0: rollout runs async on that many dedicated inference
    workers, never colocated with training (with GPUs: one per rollout device of allocation_mode);
    0: no dedicated workers, rollout and training take turns (rollout.mode=sync); None: one server per
    rollout device of allocation_mode, either mode"""
    fileroot: str = "runs"
    """root of run directories (checkpoints, logs, metrics)"""
    device_memory_gb: float | None = None
    """memory of one GPU (GiB) for the shared-device layout's fit check before start (None = read from
    the first GPU this process sees; without one the check runs where the roles start)"""

    def validate(self) -> None:
        if self.n_nodes < 1 or self.n_gpus_per_node < 0 or (self.n_inference_servers or 0) < 0:
            raise ValueError("cluster.n_nodes must be >= 1, n_gpus_per_node and n_inference_servers >= 0")
