"""The GPU precision recipe: fp32 master weights and AdamW state with bf16 compute. One step of it
changes the weights the way the fp32 reference step does; bf16 parameters with AdamW are refused
at config time (their small updates round away)."""

from __future__ import annotations

import pytest
import torch
from programs import TINY, make_samples

from asyncwebrl.training.actor import FSDPActor
from asyncwebrl.training.config import ActorConfig

LR = 1e-5


def _one_step(device: str, **kw) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], FSDPActor]:
    torch.manual_seed(0)
    actor = FSDPActor(ActorConfig(path=TINY, lr=LR, mb_max_tokens=4096, **kw), device=device)
    before = {k: p.detach().float().cpu().clone() for k, p in actor.hf.named_parameters() if p.requires_grad}
    actor.train_step(make_samples(actor.adapter, 6))
    after = {k: p.detach().float().cpu().clone() for k, p in actor.hf.named_parameters() if p.requires_grad}
    return before, after, actor


def _check_recipe_matches_fp32(device: str) -> None:
    b0, a0, ref = _one_step(device, dtype="float32", mixed_precision=False)
    b1, a1, mp = _one_step(device, dtype="float32", mixed_precision=True)
    # master weights (everything trained) stay fp32; the frozen vision tower, with no update to keep, is
    # held in the compute dtype on one rank
    assert mp.mixed_precision
    assert all(p.dtype == torch.float32 for p in mp.hf.parameters() if p.requires_grad)
    assert mp.vision_dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in mp.hf.parameters() if not p.requires_grad)
    for k in b0:
        assert torch.equal(b0[k], b1[k])
    # Adam's first step moves (nearly) every weight by ~lr: the recipe's updates land like the reference's
    changed_ref = torch.cat([((a0[k] - b0[k]) != 0).flatten() for k in b0]).float().mean()
    changed_mp = torch.cat([((a1[k] - b1[k]) != 0).flatten() for k in b1]).float().mean()
    assert changed_ref > 0.9
    assert changed_mp > 0.9 * changed_ref
    d_ref = torch.cat([(a0[k] - b0[k]).flatten() for k in b0])
    d_mp = torch.cat([(a1[k] - b1[k]).flatten() for k in b1])
    # the same direction (bf16 compute perturbs the gradient, Adam normalizes its scale)
    cos = torch.nn.functional.cosine_similarity(d_ref, d_mp, dim=0)
    assert cos > 0.9
    assert float(d_mp.abs().mean()) == pytest.approx(float(d_ref.abs().mean()), rel=0.2)


def test_gpu_recipe_step_changes_the_weights_like_fp32_cpu():
    _check_recipe_matches_fp32("cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the GPU machine)")
def test_gpu_recipe_step_changes_the_weights_like_fp32_cuda():
    _check_recipe_matches_fp32("cuda:0")
    actor = FSDPActor(ActorConfig(path=TINY, lr=LR), device="cuda:0")
    assert actor.mixed_precision  # the default on CUDA


def test_bf16_parameters_with_adamw_are_refused_at_config_time():
    with pytest.raises(ValueError, match="round away"):
        ActorConfig(path=TINY, dtype="bfloat16").validate()
    ActorConfig(path=TINY, dtype="bfloat16", allow_low_precision_params=True).validate()
    # and the unset mixed precision resolves per device: off on CPU
    assert not FSDPActor(ActorConfig(path=TINY)).mixed_precision
