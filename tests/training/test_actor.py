"""The FSDP actor: 2 gloo ranks give the single-process update, resume after a kill continues the
loss curve exactly, the model families train, missing pixels are dropped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from programs import TINY, make_samples, resume_from, train_and_report, uninterrupted, zero_advantage_steps
from ranks import run_ranks

from asyncwebrl.training.checkpoint import latest_complete_checkpoint

HERE = str(Path(__file__).parent)
CFG = dict(path=TINY, lr=1e-3, mb_max_tokens=200)


@pytest.mark.slow
def test_fsdp_two_ranks_match_single_process_update():
    one = run_ranks(train_and_report, 1, (CFG, 6, 2), timeout_s=300)
    two = run_ranks(train_and_report, 2, (CFG, 6, 2), timeout_s=300)
    for a, b in zip(one[0]["metrics"], two[0]["metrics"], strict=False):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-6)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
        assert b["n_tokens"] == a["n_tokens"]
    # every rank reports the metrics of the whole global batch
    assert two[0]["metrics"][0]["loss"] == pytest.approx(two[1]["metrics"][0]["loss"])
    assert two[0]["metrics"][0]["n_tokens"] == two[1]["metrics"][0]["n_tokens"]
    p1, p2 = one[0]["params"], two[0]["params"]
    assert p1.keys() == p2.keys()
    from asyncwebrl.models.vlm import load_model

    init = dict(load_model(TINY).named_parameters())
    moved = max((p1[k] - init[k]).abs().max().item() for k in p1)
    diff = max((p1[k] - p2[k]).abs().max().item() for k in p1)
    assert moved > 1e-4  # the update did something
    assert diff < moved * 1e-2


@pytest.mark.slow
def test_resume_after_kill_continues_with_the_same_loss(tmp_path):
    # uninterrupted: 2 steps, checkpoint, 2 steps
    ref = run_ranks(uninterrupted, 1, (CFG, str(tmp_path / "ref"), 2, 2), timeout_s=300)[0]
    # interrupted: 2 steps, checkpoint, then killed while training on
    root = tmp_path / "killed"
    # the trainer runs through the same launcher as the reference (same thread setup), in its own
    # session so that the kill takes the launcher and its rank process together
    code = (f"import sys; sys.path.insert(0, {HERE!r}); from programs import uninterrupted; "
            f"from ranks import run_ranks; "
            f"run_ranks(uninterrupted, 1, ({CFG!r}, {str(root)!r}, 2, 1000), timeout_s=600)")
    proc = subprocess.Popen([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=os.getcwd()),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while latest_complete_checkpoint(root) is None:
            assert proc.poll() is None, "trainer exited before its checkpoint"
            assert time.monotonic() < deadline, "no checkpoint within 300 s"
            time.sleep(0.2)
        time.sleep(1.0)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    resumed = run_ranks(resume_from, 1, (CFG, str(root), 2), timeout_s=300)[0]
    assert resumed["losses"] == pytest.approx(ref["losses"], rel=1e-6, abs=1e-9)
    assert resumed["version"] == ref["version"] == 4
    # the same checkpoint resumed on 2 FSDP ranks (sharded optimizer state) continues the same way
    resumed2 = run_ranks(resume_from, 2, (CFG, str(root), 2), timeout_s=300)[0]
    assert resumed2["losses"] == pytest.approx(ref["losses"], rel=1e-4, abs=1e-6)


def _family_path(name: str) -> str:
    from asyncwebrl.models.prepare import resolve_model_path

    return resolve_model_path("default") if name == "default" else str(Path(TINY).parent / name)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["default", "tiny-qwen3-vl"])
def test_model_families_train_and_checkpoint_loads_with_load_model(family, tmp_path):
    from asyncwebrl.models.vlm import load_model
    from asyncwebrl.pixelstore.store import InProcessPixelStore
    from asyncwebrl.training.actor import FSDPActor
    from asyncwebrl.training.config import ActorConfig

    torch.manual_seed(0)
    actor = FSDPActor(ActorConfig(path=_family_path(family), lr=1e-4 if family == "default" else 1e-3,
                                  mb_max_tokens=256))
    store = InProcessPixelStore()
    samples = make_samples(actor.adapter, 4, out_len=3)
    for s in samples:  # screenshots travel by key, as in store transport
        s.pixel_keys, s.pixels = store.put_batch(s.pixels), None
    store.free(samples[-1].pixel_keys)  # one sample's screenshot was lost
    pix0 = store.get(samples[0].pixel_keys)
    before = actor.compute_logprobs(samples[:1], [pix0])[0]
    m = actor.train_step(samples, store, free_pixels=True)
    assert m["n_dropped_missing_pixels"] == 1 and m["n_samples"] == 4
    assert m["version"] == 1 and torch.isfinite(torch.tensor(m["loss"])) and m["grad_norm"] > 0
    assert store.stats()["items"] == 0  # the step freed what it consumed
    if family != "default":  # same code path for every family; the 0.5 GB default write is slow on CPU
        path = actor.save_checkpoint(tmp_path, {"pos": 3})
        reloaded = dict(load_model(str(path)).named_parameters())
        for name, t in actor.full_named_parameters():
            assert torch.equal(reloaded[name], t), name
    # the update moved the policy: the same tokens now have different logprobs
    after = actor.compute_logprobs(samples[:1], [pix0])[0]
    assert len(after) == len(before) == 3
    assert max(abs(a - b) for a, b in zip(after, before, strict=False)) > 1e-6


@pytest.mark.slow
def test_loglinear_and_metrics_prox_methods_and_coupled_mode_run():
    from asyncwebrl.training.actor import FSDPActor
    from asyncwebrl.training.config import ActorConfig

    results = {}
    for name, kw in {"loglinear": dict(prox_logp_method="loglinear"),
                     "metrics": dict(prox_logp_method="metrics", ppo_n_minibatches=2),
                     "coupled": dict(use_decoupled_loss=False)}.items():
        torch.manual_seed(0)
        actor = FSDPActor(ActorConfig(**CFG, **kw))
        results[name] = actor.train_step(make_samples(actor.adapter, 4))
    # one minibatch: log-linear prox is exact (alpha = 1), so there is no clipping and r = 1
    assert results["loglinear"]["clip_rate"] == 0.0
    assert results["loglinear"]["approx_kl"] == pytest.approx(0.0, abs=1e-9)
    # with 2 minibatches the second sees moved weights: the approximation error is measured, nonzero
    assert results["metrics"]["prox_approx_abs_err"] > 0
    # coupled PPO: the clip rate IS the coupled clip rate
    assert results["coupled"]["clip_rate"] == results["coupled"]["clip_rate_coupled"]


@pytest.mark.slow
def test_activation_checkpointing_gives_the_same_update_and_bf16_autocast_trains():
    from asyncwebrl.training.actor import FSDPActor
    from asyncwebrl.training.config import ActorConfig

    out = {}
    for name, kw in {"plain": {}, "ckpt": dict(gradient_checkpointing=True), "bf16": dict(mixed_precision=True)}.items():
        torch.manual_seed(0)
        actor = FSDPActor(ActorConfig(**CFG, **kw))
        out[name] = actor.train_step(make_samples(actor.adapter, 3))
    assert out["ckpt"]["loss"] == pytest.approx(out["plain"]["loss"], rel=1e-5)
    assert out["ckpt"]["grad_norm"] == pytest.approx(out["plain"]["grad_norm"], rel=1e-4)
    # bf16 compute: same objective to bf16 precision, finite gradients
    assert out["bf16"]["loss"] == pytest.approx(out["plain"]["loss"], rel=0.1, abs=1e-3)
    assert 0 < out["bf16"]["grad_norm"] < float("inf")


def test_bad_actor_config_is_rejected_before_any_model_loads():
    from asyncwebrl.training.actor import FSDPActor
    from asyncwebrl.training.config import ActorConfig

    with pytest.raises(ValueError, match="recompute_logprob"):
        FSDPActor(ActorConfig(path=TINY, prox_logp_method="metrics", recompute_logprob=False))
    with pytest.raises(ValueError, match="mb_max_tokens"):
        FSDPActor(ActorConfig(path=TINY, mb_max_tokens=0))


def test_lr_warmup_ramps_the_first_steps_and_resumes_from_the_step_count(tmp_path):
    from asyncwebrl.training.actor import FSDPActor
    from asyncwebrl.training.config import ActorConfig

    torch.manual_seed(0)
    actor = FSDPActor(ActorConfig(**{**CFG, "lr": 1e-4}, lr_warmup_steps=3))
    lrs = [actor.train_step(make_samples(actor.adapter, 2, seed=s))["lr"] for s in range(2)]
    assert lrs == pytest.approx([1e-4 / 3, 2e-4 / 3])
    path = actor.save_checkpoint(tmp_path)
    back = FSDPActor(ActorConfig(**{**CFG, "lr": 1e-4}, lr_warmup_steps=3))
    back.load_checkpoint(path)
    # the third and fourth steps of the run: the end of the ramp, then the full rate
    assert [back.train_step(make_samples(back.adapter, 2, seed=s))["lr"] for s in (2, 3)] == pytest.approx([1e-4, 1e-4])
    with pytest.raises(ValueError, match="lr_warmup_steps"):
        FSDPActor(ActorConfig(path=TINY, lr_warmup_steps=-1))


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_lr_decays_after_the_warm_up_to_its_floor_and_holds(schedule):
    from asyncwebrl.training.config import ActorConfig

    cfg = ActorConfig(path=TINY, lr=1e-4, lr_warmup_steps=2, lr_schedule=schedule, lr_decay_steps=12,
                      min_lr_ratio=0.1)
    cfg.validate()
    lrs = [cfg.lr_at(k) for k in range(1, 16)]
    assert lrs[:2] == pytest.approx([5e-5, 1e-4])  # the ramp, then the full rate at the end of it
    assert all(a >= b for a, b in zip(lrs[1:], lrs[2:], strict=False))  # never rises after the warm-up
    assert lrs[6] == pytest.approx(1e-4 * (0.1 + 0.9 * 0.5))  # half way (step 7 of 2..12), either shape
    assert lrs[11:] == pytest.approx([1e-5] * 4)  # the floor from lr_decay_steps on
    if schedule == "cosine":
        assert lrs[3] > 1.05 * 1e-4 * (0.1 + 0.9 * 0.8)  # a cosine stays near the top longer than a line
    # a run shorter than its ramp (a smoke run of the default config): the ramp, then the floor
    short = ActorConfig(path=TINY, lr=1e-4, lr_warmup_steps=5, lr_schedule=schedule, lr_decay_steps=3,
                        min_lr_ratio=0.1)
    short.validate()
    assert [short.lr_at(k) for k in (3, 5, 6)] == pytest.approx([6e-5, 1e-4, 1e-5])
    with pytest.raises(ValueError, match="lr_decay_steps"):
        ActorConfig(path=TINY, lr_schedule=schedule, lr_decay_steps=0).validate()
    with pytest.raises(ValueError, match="min_lr_ratio"):
        ActorConfig(path=TINY, lr_schedule=schedule, lr_decay_steps=10, min_lr_ratio=1.5).validate()



@pytest.mark.slow
def test_entropy_bonus_raises_the_policy_entropy_where_the_advantages_are_zero():
    """A batch whose advantages are all zero (every GRPO group solved or failed alike) teaches the PPO
    term nothing; with `entropy_coef` the update still spreads the policy out, without it it does not."""
    from asyncwebrl.training.actor import FSDPActor
    from asyncwebrl.training.config import ActorConfig

    entropies = {}
    for coef in (0.0, 0.5):
        torch.manual_seed(0)
        # a low temperature makes the random tiny model's distribution peaked (at T=1 it is near uniform)
        actor = FSDPActor(ActorConfig(**{**CFG, "lr": 1e-4}, entropy_coef=coef, weight_decay=0.0, temperature=0.05))
        samples = make_samples(actor.adapter, 3, stale=False)
        for s in samples:
            s.advantage = 0.0
        entropies[coef] = [actor.train_step(samples)["entropy"] for _ in range(3)]
    flat, bonus = entropies[0.0], entropies[0.5]
    assert flat[-1] == pytest.approx(flat[0], rel=1e-4)  # zero advantages, no bonus: nothing moves
    assert bonus[0] == pytest.approx(flat[0], rel=1e-4)  # the same policy before the first update
    assert bonus[-1] > bonus[0] * 1.5  # measured: 0.26 -> 0.58 -> 1.01


@pytest.mark.slow
def test_entropy_target_stops_the_bonus_once_the_entropy_is_above_it():
    from asyncwebrl.training.actor import FSDPActor
    from asyncwebrl.training.config import ActorConfig

    out = {}
    for target in (0.2, 10.0):  # measured start: 0.26 at temperature 0.05
        torch.manual_seed(0)
        actor = FSDPActor(ActorConfig(**{**CFG, "lr": 1e-4}, entropy_coef=0.5, entropy_target=target,
                                      weight_decay=0.0, temperature=0.05))
        samples = make_samples(actor.adapter, 3, stale=False)
        for s in samples:
            s.advantage = 0.0
        out[target] = [actor.train_step(samples)["entropy"] for _ in range(3)]
    assert out[0.2][-1] == pytest.approx(out[0.2][0], rel=1e-4)  # already above the floor: no push
    assert out[10.0][-1] > out[10.0][0] * 1.5  # below it: the bonus acts as without a target
    with pytest.raises(ValueError, match="entropy_target"):
        FSDPActor(ActorConfig(path=TINY, entropy_coef=0.1, entropy_target=0.0))


def test_kl_term_starts_at_zero_and_holds_the_policy_near_the_reference():
    """actor.kl_coef: the reference pass equals the policy at step 1 (kl_ref 0); with a large lr the
    policy drifts from it, and a strong KL term keeps the drift smaller than no term does."""
    from asyncwebrl.training.actor import FSDPActor
    from asyncwebrl.training.config import ActorConfig

    def drift(kl_coef: float) -> list[float]:
        torch.manual_seed(0)
        cfg = ActorConfig(path=TINY, lr=3e-3, mb_max_tokens=4096, kl_coef=kl_coef)
        actor = FSDPActor(cfg, device="cpu")
        probe = make_samples(actor.adapter, 4, seed=9)
        out = []
        for k in range(4):
            m = actor.train_step(make_samples(actor.adapter, 6, seed=k))
            if kl_coef:
                out.append(m["kl_ref"])
        # the policy's distance from the reference on held-out samples, measured the same way either run
        ref = FSDPActor(ActorConfig(path=TINY, mb_max_tokens=4096), device="cpu")
        a, b = actor.compute_logprobs(probe), ref.compute_logprobs(probe)
        actor.close()
        ref.close()
        return out, sum(abs(x - y) for u, v in zip(a, b, strict=True) for x, y in zip(u, v, strict=True))

    kls, far = drift(0.0)
    assert kls == []
    kls, near = drift(5.0)
    assert kls[0] == pytest.approx(0.0, abs=1e-6)  # the first step's policy is the reference
    assert kls[-1] > 0
    assert near < 0.8 * far


def test_after_a_warm_start_the_kl_reference_is_the_warm_started_policy():
    """RL after behaviour cloning is held near where it starts: once `reset_reference` has run (the
    warm start's last act), the first PPO step's KL to the reference is zero; without it the
    reference is still the model before the demonstrations."""
    from asyncwebrl.training.actor import FSDPActor
    from asyncwebrl.training.config import ActorConfig

    def first_kl(reset: bool) -> float:
        torch.manual_seed(0)
        actor = FSDPActor(ActorConfig(path=TINY, mb_max_tokens=4096, kl_coef=1.0), device="cpu")
        opt = actor.new_bc_optimizer(3e-3)
        for k in range(3):
            actor.bc_step(make_samples(actor.adapter, 6, seed=20 + k), optimizer=opt)
        if reset:
            actor.reset_reference()
        kl = actor.train_step(make_samples(actor.adapter, 6, seed=1))["kl_ref"]
        actor.close()
        return kl

    assert first_kl(reset=True) == pytest.approx(0.0, abs=1e-6)
    assert first_kl(reset=False) > 1e-4


def test_bf16_cloning_passes_keep_fp32_weights_and_follow_the_fp32_update():
    """`bc_step(bf16=True)` (warm_start.bf16) runs the passes under bf16 autocast: the parameters,
    their gradients and the optimizer state stay fp32, the NLL it reports is the fp32 one to bf16
    precision, the update moves the weights the same way, and the actor is back in fp32 afterwards."""
    from asyncwebrl.training.actor import FSDPActor
    from asyncwebrl.training.config import ActorConfig

    def run(bf16: bool):
        torch.manual_seed(0)
        actor = FSDPActor(ActorConfig(path=TINY, mb_max_tokens=4096), device="cpu")
        before = {n: p.detach().clone() for n, p in actor.module.named_parameters() if p.requires_grad}
        opt = actor.new_bc_optimizer(1e-3)
        samples = make_samples(actor.adapter, 6, seed=30)
        stats = [actor.bc_step(samples, optimizer=opt, bf16=bf16) for _ in range(3)]
        assert not actor.autocast
        params = dict(actor.module.named_parameters())
        assert all(params[n].dtype == torch.float32 for n in before)
        assert all(s.dtype == torch.float32 for st in opt.state.values() for s in st.values() if s.dim())
        delta = torch.cat([(params[n].detach() - before[n]).flatten() for n in before])
        lp = actor.compute_logprobs(samples)
        actor.close()
        return stats, delta, lp

    fp32, d32, lp32 = run(False)
    bf16, d16, lp16 = run(True)
    assert bf16[0].nll != fp32[0].nll  # the passes did run in bf16
    assert bf16[0].nll == pytest.approx(fp32[0].nll, rel=0.05)
    # it learns as much: the NLL falls over the three updates by about what the fp32 passes take off
    drop32, drop16 = fp32[0].nll - fp32[-1].nll, bf16[0].nll - bf16[-1].nll
    assert drop32 > 0.1 and drop16 == pytest.approx(drop32, rel=0.3), (drop32, drop16)
    cos = torch.nn.functional.cosine_similarity(d32, d16, dim=0)
    assert cos > 0.9, cos
    # the next fp32 pass (RL's) sees the same model to within what three bf16 updates change
    nll32 = -sum(map(sum, lp32)) / sum(map(len, lp32))
    nll16 = -sum(map(sum, lp16)) / sum(map(len, lp16))
    assert nll16 == pytest.approx(nll32, rel=0.2)


def test_zero_gradient_steps_leave_the_weights_when_asked():
    """All-zero advantages give a zero gradient; AdamW still moves the weights along its momentum
    unless actor.skip_zero_grad_steps, which leaves them (and counts the skipped update). The version
    and the lr schedule advance either way."""
    off = run_ranks(zero_advantage_steps, 1, (CFG,), timeout_s=300)[0]
    on = run_ranks(zero_advantage_steps, 1, (dict(CFG, skip_zero_grad_steps=True),), timeout_s=300)[0]
    assert all(m["grad_norm"] == 0.0 for m in off["metrics"] + on["metrics"])
    assert off["moved"] > 1e-5  # momentum carried the weights on
    assert [m["skipped_updates"] for m in off["metrics"]] == [0.0, 0.0]
    assert on["moved"] == 0.0
    assert [m["skipped_updates"] for m in on["metrics"]] == [1.0, 1.0]
    assert on["version"] == off["version"] == 3
