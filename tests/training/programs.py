"""Rank programs and sample builders shared by the trainer tests (importable by spawned ranks)."""

from __future__ import annotations

import io
import os
from pathlib import Path

import torch
from PIL import Image

from asyncwebrl.models.prepare import resolve_model_path
from asyncwebrl.records import TrainSample
from asyncwebrl.training.config import ActorConfig

TINY = os.environ.get("ASYNCWEBRL_TINY_MODEL") or str(Path(resolve_model_path("default")).parent / "tiny-qwen2.5-vl")


def png(color: tuple[int, int, int], size: tuple[int, int] = (56, 56)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, "PNG")
    return buf.getvalue()


def make_samples(adapter, n: int, seed: int = 0, out_len: int = 6, stale: bool = True) -> list[TrainSample]:
    """n one-screenshot samples with inline pixels, random outputs, and behaviour logprobs that are
    off-policy (so the behaviour weight and clipping are exercised)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        color = tuple(int(x) for x in torch.randint(0, 255, (3,), generator=g))
        img = png(color)
        text = adapter.chat_text([{"role": "user", "content": [
            {"type": "image"}, {"type": "text", "text": f"Click button {i} " + "please " * (i % 3)}]}])
        from asyncwebrl.models.vlm import decode_image

        ids = adapter.encode(text, [decode_image(img)]).input_ids
        k = out_len + (i % 3)
        output = torch.randint(10, 2000, (k,), generator=g).tolist()
        behave = (-torch.rand(k, generator=g) * 8 - 1).tolist() if stale else [0.0] * k
        out.append(TrainSample(prompt_ids=ids, output_ids=output, behave_logprobs=behave,
                               versions=[0] * k, advantage=float(torch.randn(1, generator=g)), pixels=[img]))
    return out


def train_and_report(rank: int, world_size: int, addr: str, port: int, cfg_kwargs: dict, n_samples: int,
                     n_steps: int, device: str = "cpu") -> dict:
    """Build an actor, run n_steps train steps on the same samples, return metrics and (rank 0) the
    full parameters (on the CPU). device="cuda" puts rank r on cuda:r (NCCL)."""
    from asyncwebrl.training.actor import FSDPActor

    torch.manual_seed(0)
    dev = f"cuda:{rank}" if device == "cuda" else device
    actor = FSDPActor(ActorConfig(**cfg_kwargs), rank, world_size, addr, port, device=dev)
    samples = make_samples(actor.adapter, n_samples)
    metrics = [actor.train_step(samples) for _ in range(n_steps)]
    params = {n: t.detach().cpu().clone() for n, t in actor.full_named_parameters()}
    actor.close()
    return {"metrics": metrics, "params": params if rank == 0 else None}


def checkpoint_then_steps(rank: int, world_size: int, addr: str, port: int, cfg_kwargs: dict, root: str,
                          n_before: int, n_after: int, resume: bool) -> dict:
    """Either train n_before steps, checkpoint, train n_after more (uninterrupted run), or resume from
    the newest checkpoint under root and train n_after steps. Data of step s is make_samples(seed=s)."""
    from asyncwebrl.training.actor import FSDPActor
    from asyncwebrl.training.checkpoint import latest_complete_checkpoint

    torch.manual_seed(0)
    actor = FSDPActor(ActorConfig(**cfg_kwargs), rank, world_size, addr, port)
    if resume:
        extra = actor.load_checkpoint(latest_complete_checkpoint(root))
        start = extra["next_data_seed"]
    else:
        for s in range(n_before):
            actor.train_step(make_samples(actor.adapter, 4, seed=s))
        actor.save_checkpoint(root, {"next_data_seed": n_before}, keep_last=2)
        start = n_before
    losses = []
    for s in range(start, start + n_after):
        losses.append(actor.train_step(make_samples(actor.adapter, 4, seed=s))["loss"])
    version = actor.version
    actor.close()
    return {"losses": losses, "version": version}


def resume_from(rank: int, world_size: int, addr: str, port: int, cfg_kwargs: dict, root: str, n_after: int) -> dict:
    return checkpoint_then_steps(rank, world_size, addr, port, cfg_kwargs, root, 0, n_after, True)


def uninterrupted(rank: int, world_size: int, addr: str, port: int, cfg_kwargs: dict, root: str,
                  n_before: int, n_after: int) -> dict:
    return checkpoint_then_steps(rank, world_size, addr, port, cfg_kwargs, root, n_before, n_after, False)


def train_then_broadcast(rank: int, world_size: int, addr: str, port: int, cfg_kwargs: dict, server: str,
                         version: int, api_key: str | None = None) -> dict:
    """Train one step on FSDP ranks, then the production refresh: every rank runs the per-parameter
    gather as rank 0's sender fills each bucket (`TrainerRank.broadcast_weights`), inside the refresh
    bracket; returns the full parameters (rank 0) and the transfer report."""
    from asyncwebrl.scheduling.trainer_host import TrainerRank
    from asyncwebrl.weights.bracket import RefreshBracket
    from asyncwebrl.weights.control import ControlChannel
    from asyncwebrl.weights.version import PolicyVersion

    torch.manual_seed(0)
    trainer = TrainerRank(ActorConfig(**cfg_kwargs), rank, world_size, addr, port)
    actor = trainer.actor
    actor.train_step(make_samples(actor.adapter, 4))
    trainer.init_weight_group([server], api_key)
    report = None
    if rank == 0:
        control = ControlChannel([server], api_key, 120)
        try:
            clock = PolicyVersion(version - 1)  # the owner: this refresh publishes `version`
            _, report = RefreshBracket(None, control, clock=clock).refresh(trainer.broadcast_weights)
        finally:
            control.close()
    else:
        trainer.broadcast_weights()
    params = actor.full_named_parameters()
    trainer.close()
    return {"params": {n: t.clone() for n, t in params} if rank == 0 else None, "report": report}


def bc_and_report(rank: int, world_size: int, addr: str, port: int, cfg_kwargs: dict, n_samples: int,
                  n_steps: int) -> dict:
    """n_steps behaviour-cloning updates (`FSDPActor.bc_step`, one warm-start AdamW) on the same samples;
    per-step stats and (rank 0) the full parameters."""
    from asyncwebrl.training.actor import FSDPActor

    torch.manual_seed(0)
    actor = FSDPActor(ActorConfig(**cfg_kwargs), rank, world_size, addr, port)
    samples = make_samples(actor.adapter, n_samples)
    opt = actor.new_bc_optimizer(1e-3)
    stats = [actor.bc_step(samples, optimizer=opt) for _ in range(n_steps)]
    params = {n: t.detach().cpu().clone() for n, t in actor.full_named_parameters()}
    out = {"stats": stats, "params": params if rank == 0 else None, "version": actor.version}
    actor.close()
    return out


def zero_advantage_steps(rank: int, world_size: int, addr: str, port: int, cfg_kwargs: dict) -> dict:
    """One train step on samples with advantages, then two on the same samples with every advantage 0:
    how far the zero-advantage steps moved the weights (max abs), and what they reported."""
    from asyncwebrl.training.actor import FSDPActor

    torch.manual_seed(0)
    actor = FSDPActor(ActorConfig(**cfg_kwargs), rank, world_size, addr, port)
    samples = make_samples(actor.adapter, 4)
    actor.train_step(samples)
    before = {n: t.detach().cpu().clone() for n, t in actor.full_named_parameters()}
    for s in samples:
        s.advantage = 0.0
    metrics = [actor.train_step(samples) for _ in range(2)]
    after = {n: t.detach().cpu().clone() for n, t in actor.full_named_parameters()}
    version = actor.version
    actor.close()
    moved = max((after[n] - before[n]).abs().max().item() for n in before)
    return {"moved": moved, "metrics": metrics, "version": version}
