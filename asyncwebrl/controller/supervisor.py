"""The controller's supervisor: health checks of the train-rollout servers once per step, before weights move.

A dead inference server is noticed here (its process is gone, or `/health` does not answer within
`health_timeout_s`). Rollout requests have already failed over to the surviving servers (the
inference client does that on its own); what the supervisor fixes is the weight path:

- with `rollout.restart_dead_servers=true` the dead server is started again on the same address (so
  every rollout client finds it again once its failure cool-down ends), then the weight-update group
  is rebuilt (destroy + init for all servers through the trainer's WeightBroadcaster) and the
  controller's next weight push brings it to the current version;
- otherwise the group is rebuilt over the surviving servers only and training continues on them.

Invariant: after `check()` returns, every server in the weight-update group answers `/health`, so the
weight broadcast that follows never waits on a dead peer. Every fault is recorded in `events` with
its detection and recovery times.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from asyncwebrl.net import answers_health

log = logging.getLogger(__name__)


@dataclass
class ServerEvent:
    """One dead server the supervisor handled."""

    address: str
    step: int
    action: str
    """restarted | dropped"""
    detected_at: float
    recovery_s: float
    """detection -> server healthy again (or dropped) and the weight group rebuilt"""
    error: str = ""


@dataclass
class Supervisor:
    system: Any
    """the System of `asyncwebrl.controller.system.build_system`"""
    restart_dead_servers: bool = False
    health_timeout_s: float = 5.0
    events: list[ServerEvent] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    """addresses taken out of the weight group for good (not restarted)"""

    # ---- health --------------------------------------------------------------------------------
    def _process_alive(self, index: int) -> bool:
        from asyncwebrl.scheduling.servers import ServerProcess

        h = self.system.server_handles[index]
        if isinstance(h, ServerProcess):
            return h.alive()
        import ray

        try:
            return bool(ray.get(h.alive.remote(), timeout=self.health_timeout_s))
        except Exception:  # the host actor itself is gone
            return False

    def dead_servers(self) -> list[int]:
        """Indices (into system.server_handles) of train-rollout servers that are down."""
        return [i for i, a in enumerate(self.system.server_addresses)
                if a not in self.dropped and not (self._process_alive(i) and answers_health(a, self.system.api_key, self.health_timeout_s))]

    # ---- recovery ------------------------------------------------------------------------------
    def _restart(self, index: int) -> None:
        from asyncwebrl.controller.system import _server_kwargs

        s = self.system
        cfg = s.cfg
        old = s.server_handles[index]
        address = s.server_addresses[index]
        port = int(address.rsplit(":", 1)[1])
        kw = dict(_server_kwargs(cfg, s.run, s.model_path, cfg.allocation.rollout.backend, s.api_key,
                                   s.trainer_addresses), port=port)
        from asyncwebrl.scheduling.servers import ServerProcess

        if not isinstance(old, ServerProcess):
            import ray

            from asyncwebrl.scheduling.ray_scheduler import _server_host_class

            try:
                ray.get(old.stop.remote(), timeout=30)
            except Exception:
                pass
            ray.kill(old)
            # the same bundle of the rollout placement group, once Ray has released the old actor's slice
            kw["multi_node"] = s.scheduler.spans_nodes  # it binds its node's address again
            new = s.scheduler.start("rollout", _server_host_class(), kw, index=index)
            got = ray.get(new.address.remote(), timeout=cfg.inference.startup_timeout_s + 60)
        else:
            from asyncwebrl.scheduling.servers import launch_server

            old.stop()
            new = launch_server(device=old.device, name=f"rollout{index}-restart", **kw)
            got = new.address
        if got != address:
            raise RuntimeError(f"restarted server came up at {got}, not at its old address {address}")
        s.server_handles[index] = new

    def _rebuild_weight_group(self) -> None:
        s = self.system
        if s.cfg.actor.weight_update_mode != "xccl":
            return  # disk mode: the next push reloads from disk on every listed server
        live = [a for a in s.server_addresses if a not in self.dropped]
        s.trainer.init_weight_group(live, s.api_key)

    def check(self, step: int) -> list[ServerEvent]:
        """Find dead train-rollout servers; restart or drop them; rebuild the weight group if anything died."""
        dead = self.dead_servers()
        if not dead:
            return []
        t0 = time.monotonic()
        new_events = []
        for i in dead:
            addr = self.system.server_addresses[i]
            log.warning("inference server %s is down at step %d", addr, step)
            action, err = "dropped", ""
            if self.restart_dead_servers:
                try:
                    self._restart(i)
                    action = "restarted"
                except Exception as e:  # could not bring it back: keep training on the others
                    err = f"{type(e).__name__}: {e}"
                    log.error("restart of %s failed (%s); dropping it", addr, err)
            if action == "dropped":
                self.dropped.append(addr)
            new_events.append(ServerEvent(addr, step, action, t0, 0.0, err))
        if len(self.dropped) >= len(self.system.server_addresses):
            raise RuntimeError(f"every train-rollout server is down ({self.dropped}); cannot continue training")
        self._rebuild_weight_group()
        for e in new_events:
            e.recovery_s = time.monotonic() - e.detected_at
            log.warning("server %s %s; recovered in %.1f s", e.address, e.action, e.recovery_s)
        self.events += new_events
        return new_events

    def figures(self) -> dict[str, Any]:
        return {"server_events": [asdict(e) for e in self.events], "servers_dropped": list(self.dropped)}
