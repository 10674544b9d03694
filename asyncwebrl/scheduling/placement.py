"""From allocation_mode + cluster to concrete per-role device requests (SPEC section 1).

Invariant: in disaggregated mode ('+') no two roles share a device; the test-rollout group gets
devices apart from both train rollout and the actor. In the shared-device layout
(`sglang[rollout]:dN|fsdp[actor]:dN`) rollout server i and trainer rank i share device i, both
resident (each asks half a GPU of Ray; the local scheduler hands them the same index), and nothing
else is placed there. On machines without GPUs every role gets fractional
CPU slices instead, so the same layout runs (slowly) on a laptop.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from asyncwebrl.configtree import ConfigError

ROLLOUT, ACTOR, TEST_ROLLOUT = "rollout", "actor", "test-rollout"
NODE_RESOURCE_SLIVER = 0.001
"""how much of a pinning resource a worker asks for: any node offering the resource fits many"""


@dataclass(frozen=True)
class RolePlan:
    """What one role needs: `n` workers, each with `gpus` GPUs and `cpus` CPUs."""

    role: str
    n: int
    gpus: float
    cpus: float
    backend: str
    node_resource: str | None = None
    """custom Ray node resource every bundle asks a sliver of (pins the role to nodes offering it)"""
    shares_with: str | None = None
    """the role whose devices this one shares ('|' in allocation_mode): worker i on that role's device i"""

    def bundles(self) -> list[dict[str, float]]:
        b = {"CPU": self.cpus}
        if self.gpus:
            b["GPU"] = self.gpus
        if self.node_resource:
            b[self.node_resource] = NODE_RESOURCE_SLIVER
        return [dict(b) for _ in range(self.n)]


def plan_roles(cfg) -> list[RolePlan]:
    """Role plans for a RunConfig: rollout servers (one per device, tp=1), actor ranks, test rollout."""
    alloc = cfg.allocation
    gpu = cfg.cluster.n_gpus_per_node > 0
    rollout, actor = alloc.rollout, alloc.actor
    if rollout.tp != 1 or rollout.pp != 1:
        raise ConfigError("train-rollout servers run with tp=1, pp=1 (one server per device); use dN only")
    from asyncwebrl.scheduling.fit import shares_device

    cpu_share = cfg.scheduler.cpus_per_role
    shared = shares_device(alloc)
    per_gpu = (0.5 if shared else 1.0) if gpu else 0.0
    plans = [
        RolePlan(ROLLOUT, cfg.n_rollout_servers, per_gpu, 1.0 if gpu else cpu_share, rollout.backend),
        RolePlan(ACTOR, actor.world_size, per_gpu, 1.0 if gpu else cpu_share, actor.backend,
                 shares_with=ROLLOUT if shared else None),
    ]
    if cfg.test_rollout.enabled:
        n_test = max(1, cfg.test_rollout.n_gpus)
        test_gpu = 1.0 if (gpu and cfg.test_rollout.n_gpus > 0) else 0.0
        test_backend = alloc.role(TEST_ROLLOUT).backend if alloc.role(TEST_ROLLOUT) else "hf"
        plans.append(RolePlan(TEST_ROLLOUT, n_test, test_gpu, 1.0 if test_gpu else cpu_share, test_backend))
    if gpu:
        total = cfg.cluster.n_nodes * cfg.cluster.n_gpus_per_node
        need = sum(p.n * p.gpus for p in plans)
        if need > total:
            raise ConfigError(f"the roles need {need:g} GPUs but the cluster has {total}")
    pins = cfg.scheduler.role_resources
    return [dataclasses.replace(p, node_resource=pins.get(p.role)) for p in plans]


def local_device_assignment(plans: list[RolePlan], n_gpus: int) -> dict[str, list[str]]:
    """For the `local` scheduler: hand out GPU indices role by role, no device shared across roles
    except a role's `shares_with` partner (worker i on its device i); CPU-only roles get 'cpu'."""
    out: dict[str, list[str]] = {}
    nxt = 0
    for p in plans:
        if p.shares_with is not None:
            partner = out[p.shares_with]
            if len(partner) != p.n:
                raise ConfigError(f"role '{p.role}' shares the devices of '{p.shares_with}' but has {p.n} workers "
                                  f"to its {len(partner)}")
            out[p.role] = list(partner)
            continue
        devs = []
        for _ in range(p.n):
            if p.gpus:
                if nxt >= n_gpus:
                    raise ConfigError(f"role '{p.role}' needs more GPUs than the {n_gpus} visible ones")
                devs.append(f"cuda:{nxt}")
                nxt += 1
            else:
                devs.append("cpu")
        out[p.role] = devs
    return out
