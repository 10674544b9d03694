"""PixelStore: screenshots out of trajectories (SPEC section 8).

`make_pixel_store(cfg, scheduler_type, run_name)` gives the store client a run uses:
- `ray`: one named, restartable Ray actor per node (`ray_store.PixelStoreClient`);
- `local`: a loopback server process (`local_store.LocalPixelStoreClient`), no Ray needed;
- `inprocess`: the bare `store.PixelStore` (single-process tests and benchmarks).
All three serve put / put_batch / get / free / retain / count_missing / stats.
"""

from __future__ import annotations

from typing import Any


def make_pixel_store(cfg: Any, scheduler_type: str, run_name: str) -> Any:
    """The PixelStore client for `scheduler_type` (ray | local | inprocess), sized by `cfg` (PixelStoreConfig)."""
    capacity = int(cfg.capacity_mb * 2**20)
    max_age = float(getattr(cfg, "max_age_s", 0.0))
    if scheduler_type == "ray":
        from asyncwebrl.pixelstore.ray_store import PixelStoreClient, launch_ray_stores

        handles = launch_ray_stores(run_name, capacity, cfg.put_timeout_s, max_age)
        return PixelStoreClient(run_name, handles, put_timeout_s=cfg.put_timeout_s)
    if scheduler_type == "local":
        from asyncwebrl.pixelstore.local_store import start_local_store

        return start_local_store(capacity, cfg.put_timeout_s, prefix="local", max_age_s=max_age)
    if scheduler_type == "inprocess":
        from asyncwebrl.pixelstore.store import PixelStore

        return PixelStore(capacity, cfg.put_timeout_s, prefix="mem")
    raise ValueError(f"unknown scheduler type {scheduler_type!r} for the PixelStore (ray | local | inprocess)")
