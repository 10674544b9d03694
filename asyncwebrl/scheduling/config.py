"""Config of process placement (SPEC section 1)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(kw_only=True)
class SchedulerConfig:
    type: Literal["local", "ray"] = "ray"
    """ray = placement groups on a (local or remote) Ray cluster; local = subprocesses, no Ray"""
    ray_address: str | None = None
    """Ray cluster to join (None = start a local one)"""
    cpus_per_role: float = 0.2
    """CPU share of one role process on machines without GPUs (fractional Ray bundles)"""


@dataclass(kw_only=True)
class ClusterConfig:
    n_nodes: int = 1
    """nodes of the cluster"""
    n_gpus_per_node: int = 0
    """GPUs per node (0 = CPU-only machine)"""
    n_inference_servers: int = 1
    """dedicated inference servers for train rollout (>0 = async, disaggregated)"""
    fileroot: str = "runs"
    """root of run directories (checkpoints, logs, metrics)"""

    def validate(self) -> None:
        if self.n_nodes < 1 or self.n_gpus_per_node < 0 or self.n_inference_servers < 0:
            raise ValueError("cluster.n_nodes must be >= 1, n_gpus_per_node and n_inference_servers >= 0")
