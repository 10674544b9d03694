"""The one place an environment is built from `env.type`, so rollout, evaluation and the gym wrapper
construct environments the same way (browser kinds share the event loop's browser pool)."""

from __future__ import annotations

from typing import Any

from asyncwebrl.web.base import Env
from asyncwebrl.web.config import EnvConfig


def make_env(env_cfg: EnvConfig, pool: Any = None, **kwargs: Any) -> Env:
    """An environment of `env_cfg.type`; browser kinds share `pool` (default: the loop's shared pool)."""
    if env_cfg.type == "miniwob":
        from asyncwebrl.web.miniwob import MiniWoBEnv

        return MiniWoBEnv(env_cfg, pool=pool)
    if env_cfg.type == "webgym":
        from asyncwebrl.web.webgym import WebGymEnv

        return WebGymEnv(env_cfg, pool=pool, **kwargs)
    if env_cfg.type == "synthetic":
        from asyncwebrl.web.synthetic import SyntheticWebEnv  # written by the rollout engineer

        return SyntheticWebEnv(env_cfg, **kwargs)
    raise ValueError(f"unknown env.type '{env_cfg.type}' (miniwob, webgym, synthetic)")
