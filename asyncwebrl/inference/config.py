"""Config of the train-rollout inference servers (SPEC section 3)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from asyncwebrl.inference.admission import CostLimits


@dataclass(kw_only=True)
class InferenceConfig:
    host: str = "node"
    """bind address of the servers: 'node' = the node's address (loopback on one machine, Ray's node
    IP when the Ray cluster spans nodes), or a literal address such as 0.0.0.0 (advertised as the node's)"""
    base_port: int = 0
    """port of the first server on its node, the next ones counting up (train rollout, then test
    rollout); 0 = free ports picked at start"""
    api_key: str | None = None
    """when set, every request but /health must carry 'Authorization: Bearer <key>'; when unset, the run
    makes a random one (control endpoints always need a key); it reaches servers through their environment"""
    max_batch_size: int = 32
    """embedded hf backend: most sequences decoded together (continuous batching)"""
    max_context_len: int = 4096
    """longest prompt + generation a server accepts (hf: --max-context-len, sglang: --context-length);
    the launcher lets servers clamp max_new_tokens to what is left (--allow-auto-truncate)"""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """embedded hf backend: parameter dtype"""
    mem_fraction_static: float = 0.8
    """sglang backend: fraction of GPU memory for weights + KV cache"""
    startup_timeout_s: float = 300.0
    """a server that is not healthy after this long is an error"""
    weight_sync_timeout_s: float = 120.0
    """embedded hf backend: joining the broadcast group and each broadcast time out after this
    (env ASYNCWEBRL_WEIGHT_SYNC_TIMEOUT_S of the server process)"""
    cpu_threads: int = 0
    """embedded hf backend on CPU: torch threads per server (0 = 1, since servers share cores with
    browsers and the trainer; env ASYNCWEBRL_CPU_THREADS of the server process)"""
    cost: CostLimits = field(default_factory=CostLimits)
    """embedded hf backend: what one /generate request, and all of them together, may cost
    (inference/admission.py; `asyncwebrl serve --cost KEY=VALUE`, env ASYNCWEBRL_COST_LIMITS of the
    server process)"""

    def validate(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError("inference.max_batch_size must be >= 1")
        if self.weight_sync_timeout_s <= 0:
            raise ValueError("inference.weight_sync_timeout_s must be > 0")
        if not 0 <= self.base_port <= 65535:
            raise ValueError("inference.base_port must be in 0..65535 (0 = pick free ports)")
        if self.cpu_threads < 0:
            raise ValueError("inference.cpu_threads must be >= 0 (0 = one thread per CPU server)")
        try:
            self.cost.validate()
        except ValueError as e:
            raise ValueError(f"inference.cost: {e}") from None
