"""The warm start's update: behaviour cloning on demonstration samples before the first RL step.

The samples come from `rollout.demonstrations` (played through the rollout's episode loop); this module
only receives them. The update is `FSDPActor.bc_step` (token-mean NLL over the global batch, every rank
the same batch), with its own AdamW; it never changes the weight version: its result is version 0.
"""

from __future__ import annotations

import dataclasses
import random
import time
from dataclasses import dataclass
from typing import Any

import torch

from asyncwebrl.records import TrainSample
from asyncwebrl.training.config import WarmStartConfig


@dataclass
class WarmStartEpoch:
    """One pass over the demonstrations (logged as metrics kind "warm_start", step = epoch)."""

    epoch: int
    nll: float
    """token-mean NLL of the demonstrated tokens over the epoch (each minibatch measured before its update)"""
    n_updates: int
    n_tokens: int
    grad_norm: float
    """mean over the epoch's updates"""
    time_s: float
    bf16: bool
    """the passes ran under bf16 autocast (warm_start.bf16)"""

    def as_log(self) -> dict[str, float]:
        return dataclasses.asdict(self)


@dataclass
class WarmStartReport:
    """What the warm start did (the controller logs it; the summary and `bench warmstart` read it)."""

    source: str
    demos: int
    """successful demonstration episodes used"""
    samples: int
    """demonstration steps (training samples)"""
    attempts: int
    dropped_steps: int
    per_task: dict[str, int]
    epochs: list[WarmStartEpoch]
    collect_s: float
    train_s: float

    @property
    def nll_first(self) -> float:
        return self.epochs[0].nll

    @property
    def nll_last(self) -> float:
        return self.epochs[-1].nll



# ---- the update ---------------------------------------------------------------------------------
def native_bf16(device: torch.device) -> bool:
    """Whether `device` multiplies bf16 at speed: a CUDA device that supports it, or a CPU for which
    torch's oneDNN reports bf16 kernels (AVX-512 and newer; older CPUs emulate bf16, slower than fp32)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
        return bool(probe()) if probe is not None else False
    return False


def bc_epochs(actor: Any, samples: list[TrainSample], ws: WarmStartConfig) -> list[WarmStartEpoch]:
    """`ws.epochs` passes of `FSDPActor.bc_step` over `samples` in shuffled minibatches of ws.batch_size
    (the shuffle is seeded: every rank draws the same minibatches), with a fresh AdamW at ws.lr that is
    dropped afterwards; the result becomes the KL term's reference. Collective: every rank calls it with
    the same samples."""
    bf16 = ws.bf16 if ws.bf16 is not None else native_bf16(actor.device)
    opt = actor.new_bc_optimizer(ws.lr)
    rng = random.Random(ws.seed)
    order = list(range(len(samples)))
    out: list[WarmStartEpoch] = []
    for e in range(ws.epochs):
        t0 = time.perf_counter()
        rng.shuffle(order)
        stats = [actor.bc_step([samples[i] for i in order[j:j + ws.batch_size]], optimizer=opt, bf16=bf16)
                 for j in range(0, len(order), ws.batch_size)]
        tokens = sum(st.n_tokens for st in stats)
        out.append(WarmStartEpoch(epoch=e + 1, nll=sum(st.nll * st.n_tokens for st in stats) / max(1, tokens),
                                  n_updates=len(stats), n_tokens=tokens,
                                  grad_norm=sum(st.grad_norm for st in stats) / len(stats),
                                  time_s=time.perf_counter() - t0, bf16=bf16))
    del opt
    actor.reset_reference()  # a KL term (actor.kl_coef) holds RL near the warm-started policy
    return out
