"""PixelStore: screenshots out of trajectories (SPEC section 8).

`make_pixel_store(cfg, scheduler_type, run_name)` gives the store a run uses; both honour the
`base.PixelStore` protocol:
- `ray`: one named, restartable Ray actor per node (`ray_store.PixelStoreClient`);
- `local`: the bare `store.InProcessPixelStore`. Under scheduler.type=local every store user lives in
  the controller process (rollout executors on threads, the one trainer rank in-process, the test
  rollout's episodes); the inference server processes never touch the store (screenshots reach them
  inside /generate), so no cross-process store is needed.
"""

from __future__ import annotations

from asyncwebrl.pixelstore.base import PixelStore
from asyncwebrl.pixelstore.config import PixelStoreConfig


def make_pixel_store(cfg: PixelStoreConfig, scheduler_type: str, run_name: str) -> PixelStore:
    """The PixelStore for `scheduler_type` (ray | local), sized by `cfg`."""
    capacity = int(cfg.capacity_mb * 2**20)
    if scheduler_type == "ray":
        from asyncwebrl.pixelstore.ray_store import PixelStoreClient, launch_ray_stores

        handles = launch_ray_stores(run_name, capacity, cfg.put_timeout_s, cfg.max_age_s)
        return PixelStoreClient(run_name, handles, put_timeout_s=cfg.put_timeout_s)
    if scheduler_type == "local":
        from asyncwebrl.pixelstore.store import InProcessPixelStore

        return InProcessPixelStore("local", capacity, cfg.put_timeout_s, cfg.max_age_s)
    raise ValueError(f"unknown scheduler type {scheduler_type!r} for the PixelStore (ray | local)")
