"""Config of the PixelStore (SPEC section 8)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(kw_only=True)
class PixelStoreConfig:
    capacity_mb: int = 512
    """memory cap of one store; put blocks (back-pressure) when full"""
    encoding: Literal["png", "webp", "raw"] = "png"
    """how screenshots are held: encoded bytes or raw uint8"""
    put_timeout_s: float = 60.0
    """a put blocked by back-pressure longer than this raises"""

    def validate(self) -> None:
        if self.capacity_mb < 1:
            raise ValueError("pixelstore.capacity_mb must be >= 1")
