"""Packed micro-batches (one unpadded row, per-sample varlen attention, M-RoPE per sample) give the
padded path's logprobs, loss and gradients, token for token.

Tolerances (fp32 on CPU, the tiny Qwen2.5-VL): logprobs within 1e-4 absolute, the loss within 1e-5
relative, every gradient entry within 1e-4 of the largest gradient entry of its tensor (both paths run
the same math, only the attention layout and the summation order differ)."""

from __future__ import annotations

import pytest
import torch
from programs import TINY, make_samples

from asyncwebrl.records import TrainSample
from asyncwebrl.training.actor import FSDPActor
from asyncwebrl.training.config import ActorConfig
from asyncwebrl.training.ppo import micro_batch_loss
from asyncwebrl.training.samples import micro_batches


def _actor(packing: bool) -> FSDPActor:
    torch.manual_seed(0)
    return FSDPActor(ActorConfig(path=TINY, lr=1e-3, mb_max_tokens=100_000, packing=packing))


def _loss_and_grads(actor: FSDPActor, samples: list[TrainSample]):
    """The PPO loss of all samples in one micro-batch and the gradient of every trainable tensor."""
    images = actor._images(samples, [s.pixels for s in samples])
    actor.module.train()
    actor.optimizer.zero_grad(set_to_none=True)
    fb, logp, entropy = actor._forward(samples, [images[id(s)] for s in samples])
    n = float(sum(len(s.output_ids) for s in samples))
    prox = fb.behave + 0.1
    loss, _ = micro_batch_loss(logp, prox, fb.behave, fb.advantages, entropy, actor.ppo, n)
    loss.backward()
    grads = {k: p.grad.detach().clone() for k, p in actor.hf.named_parameters() if p.grad is not None}
    actor.embed_cache.clear()
    return logp.detach(), float(loss), grads


def test_packed_path_gives_the_padded_paths_logprobs_loss_and_gradients():
    padded, packed = _actor(False), _actor(True)
    assert packed.packing and not padded.packing
    samples = make_samples(padded.adapter, 7, out_len=5)
    # a text-only sample in the middle of the packed row
    samples.insert(3, TrainSample(prompt_ids=samples[0].prompt_ids[-12:], output_ids=[11, 12, 13],
                                  behave_logprobs=[-1.0] * 3, versions=[0] * 3, advantage=0.5, pixels=[]))
    lp_a, loss_a, g_a = _loss_and_grads(padded, samples)
    lp_b, loss_b, g_b = _loss_and_grads(packed, samples)
    assert lp_a.shape == lp_b.shape == (sum(len(s.output_ids) for s in samples),)
    assert torch.allclose(lp_a, lp_b, atol=1e-4, rtol=0)
    assert loss_b == pytest.approx(loss_a, rel=1e-5, abs=1e-8)
    assert g_a.keys() == g_b.keys() and g_a
    for k in g_a:
        scale = max(float(g_a[k].abs().max()), 1e-12)
        assert float((g_a[k] - g_b[k]).abs().max()) <= 1e-4 * scale, k
    # and through the public pass: pi_prox logprobs of the same samples agree
    a, b = padded.compute_logprobs(samples), packed.compute_logprobs(samples)
    for x, y in zip(a, b, strict=True):
        assert x == pytest.approx(y, abs=1e-4)


def test_packed_micro_batches_fill_the_token_budget_without_padding():
    actor = _actor(True)
    samples = make_samples(actor.adapter, 9, out_len=4)
    lengths = sorted(s.n_tokens for s in samples)
    budget = 3 * lengths[-1]
    packed = micro_batches(samples, budget, packed=True)
    padded = micro_batches(samples, budget, packed=False)
    assert all(sum(s.n_tokens for s in mb) <= budget for mb in packed)
    assert len(packed) <= len(padded)
    assert sorted(id(s) for mb in packed for s in mb) == sorted(id(s) for s in samples)
