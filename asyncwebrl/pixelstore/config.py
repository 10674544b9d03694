"""Config of the PixelStore (SPEC section 8).

The store holds screenshots as the environment encoded them (PNG from the browser); there is no
encoding knob: re-encoding would cost CPU on the rollout side for bytes the trainer decodes anyway."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True)
class PixelStoreConfig:
    capacity_mb: float = 512
    """memory cap of one store; put blocks (back-pressure) when full"""
    put_timeout_s: float = 60.0
    """a put blocked by back-pressure longer than this raises"""
    max_age_s: float = 0.0
    """evict items older than this whatever their refcount (orphans of a dead consumer); 0 = never"""

    def validate(self) -> None:
        if self.capacity_mb < 0.01:
            raise ValueError("pixelstore.capacity_mb must be >= 0.01")
        if self.put_timeout_s <= 0:
            raise ValueError("pixelstore.put_timeout_s must be > 0")
        if self.max_age_s < 0:
            raise ValueError("pixelstore.max_age_s must be >= 0 (0 = never evict by age)")
