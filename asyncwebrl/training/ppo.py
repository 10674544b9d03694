"""The decoupled PPO objective (SPEC section 6), readable top to bottom.

Per generated token t, with logp = log pi_theta (current, differentiable), prox = log pi_prox (policy
snapshot at the start of this update, constant) and behave = log pi_behave (from the server):

    r_t  = exp(logp - prox)                       the only factor that is clipped
    w_t  = exp(prox - behave)                     behaviour (staleness) weight, capped, never clipped
    pg_t = max(-A_t r_t, -A_t clip(r_t, 1 - eps, 1 + eps_high)) * w_t
    L    = sum_t mask_t pg_t / N_global           N_global = loss tokens of the whole global batch

Coupled PPO (`use_decoupled_loss=false`) is the same formula with r_t = exp(logp - behave), w_t = 1.

The optional entropy term (`entropy_coef` c > 0; H_t = entropy of the temperature-scaled policy at the
position that predicts token t) completes the objective the trainer minimises:

    bonus (entropy_target None):   L_total = L - c * sum_t H_t / N_global
    floor (entropy_target = H*):   the bonus of a micro-batch counts only while its own token-mean
                                   entropy is below H* (zero above it: no overshoot)

The optional KL term (`kl_coef` beta > 0) keeps the policy near a frozen reference pi_ref (the
model the run started from), with ref_t = log pi_ref of token t (constant) and d_t = ref_t - logp_t:

    k1_t = -d_t                        log-ratio; unbiased for KL(theta || ref), high variance
    k3_t = exp(d_t) - d_t - 1          >= 0, unbiased, low variance (Schulman's k3)
    L_total += beta * sum_t k_t / N_global

So the whole objective is L_total = L - c * entropy term + beta * KL term, and
`micro_batch_loss` is what one micro-batch backpropagates: every term of the loss is in this module.

Invariant: `ppo_loss_sum` returns a SUM over the micro-batch's loss tokens, divided by the global token
count the caller passes in; adding the values of every micro-batch on every rank gives L exactly, no
matter how the batch was split. Statistics are returned as sums too (`PPOStats`), so they aggregate the
same way and are turned into rates only once, by `PPOStats.finalize`.

The log-linear proximal approximation (`prox_logp_method=loglinear`)
--------------------------------------------------------------------
Assume log pi is roughly linear in the parameters along the short path the trainer walks, and the
parameters move by about one optimizer step per version. The policy at version v then satisfies
    log pi_v ~ log pi_{v_b} + (v - v_b) / (v_theta - v_b) * (log pi_{v_theta} - log pi_{v_b})
for any v between the behaviour version v_b (the token's version tag) and the current one v_theta.
Putting v = v_prox gives  prox ~ behave + alpha (logp - behave)  with
    alpha = (v_prox - v_b) / (v_theta - v_b), clipped to [0, 1].
v_prox is the trainer version at the start of the update; with n PPO minibatches, minibatch j sees
parameters about j/n of a step past it, so v_theta = v_prox + j/n. For j = 0 (including the usual
single-minibatch update) alpha = 1 and prox = logp exactly (the snapshot IS the current policy); for
v_theta == v_b (nothing moved) alpha = 1 as well. The approximation is detached: prox is a constant.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

PROX_METHODS = ("recompute", "loglinear", "metrics")
KL_ESTIMATORS = ("k1", "k3")


@dataclass(kw_only=True)
class PPOParams:
    """The knobs of the objective, copied out of ActorConfig (so the math has no config import)."""

    eps_clip: float = 0.2
    """lower clip epsilon"""
    eps_clip_higher: float | None = None
    """upper clip epsilon (None = eps_clip)"""
    use_decoupled_loss: bool = True
    """decoupled (prox-clipped, behaviour-weighted) or coupled PPO"""
    behave_imp_weight_cap: float = 5.0
    """cap of w = pi_prox / pi_behave"""
    behave_imp_weight_mode: str = "mask"
    """mask: tokens with w > cap contribute nothing; clamp: w is clamped to the cap"""
    entropy_coef: float = 0.0
    """c of the entropy term (0 = none; the entropy is then a statistic only)"""
    entropy_target: float | None = None
    """with entropy_coef > 0: the term acts only on a micro-batch whose token-mean entropy is below this"""
    kl_coef: float = 0.0
    """beta of the KL term to the reference policy (0 = none)"""
    kl_estimator: str = "k3"
    """per-token estimator of the KL term: k1 or k3 (module doc)"""


@dataclass
class PPOStats:
    """Additive statistics of one or more micro-batches (sums and counts, and one max)."""

    n_tokens: float = 0.0
    """loss tokens seen (before behaviour-weight masking)"""
    loss_sum: float = 0.0
    """sum of mask * pg (unnormalized)"""
    n_clipped: float = 0.0
    """tokens where the clipped branch of the objective was active"""
    n_clipped_coupled: float = 0.0
    """same, had the ratio been pi_theta / pi_behave (the coupled objective) on this batch"""
    w_sum: float = 0.0
    """sum of the raw behaviour weights pi_prox / pi_behave"""
    w_max: float = 0.0
    """largest raw behaviour weight"""
    n_capped: float = 0.0
    """tokens whose behaviour weight exceeded the cap"""
    approx_kl_sum: float = 0.0
    """sum of the k3 estimator of KL(prox || theta): (r - 1) - log r"""
    entropy_sum: float = 0.0
    """sum of per-token policy entropy (when the caller supplies it)"""
    prox_err_sum: float = 0.0
    """sum of |loglinear prox - recomputed prox| (prox_logp_method=metrics only)"""
    adv_sum: float = 0.0
    """sum of per-token advantages"""
    kl_ref_sum: float = 0.0
    """sum of the k3 estimate of KL(theta || ref) (reported whichever estimator the loss uses)"""
    n_kl_tokens: float = 0.0
    """tokens with a reference logprob (the KL term on)"""
    extra: dict[str, float] = field(default_factory=dict)

    def add(self, other: PPOStats) -> None:
        for f in fields(self):
            if f.name == "extra":
                for k, v in other.extra.items():
                    self.extra[k] = self.extra.get(k, 0.0) + v
            elif f.name == "w_max":
                self.w_max = max(self.w_max, other.w_max)
            else:
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def as_tensor(self) -> torch.Tensor:
        return torch.tensor([getattr(self, f.name) for f in fields(self) if f.name != "extra"], dtype=torch.float64)

    @classmethod
    def from_tensor(cls, t: torch.Tensor, w_max: float) -> PPOStats:
        names = [f.name for f in fields(cls) if f.name != "extra"]
        s = cls(**{n: float(v) for n, v in zip(names, t.tolist(), strict=False)})
        s.w_max = w_max
        return s

    def finalize(self) -> dict[str, float]:
        """Rates and means over loss tokens, as logged."""
        n = max(self.n_tokens, 1.0)
        return {
            "loss": self.loss_sum / n,
            "n_tokens": self.n_tokens,
            "clip_rate": self.n_clipped / n,
            "clip_rate_coupled": self.n_clipped_coupled / n,
            "behave_weight_mean": self.w_sum / n,
            "behave_weight_max": self.w_max,
            "behave_weight_capped_frac": self.n_capped / n,
            "approx_kl": self.approx_kl_sum / n,
            "entropy": self.entropy_sum / n,
            "prox_approx_abs_err": self.prox_err_sum / n,
            "adv_mean": self.adv_sum / n,
            **({"kl_ref": self.kl_ref_sum / max(self.n_kl_tokens, 1.0)} if self.n_kl_tokens else {}),
            **self.extra,
        }


def loglinear_alpha(versions: torch.Tensor, v_prox: float, v_theta: float) -> torch.Tensor:
    """alpha = (v_prox - v_b) / (v_theta - v_b) clipped to [0, 1]; 1 where v_theta == v_b (module doc)."""
    v_b = versions.to(torch.float64)
    denom = v_theta - v_b
    safe = torch.where(denom.abs() > 1e-9, denom, torch.ones_like(denom))
    alpha = torch.where(denom.abs() > 1e-9, (v_prox - v_b) / safe, torch.ones_like(denom))
    return alpha.clamp(0.0, 1.0)


def loglinear_prox(logp: torch.Tensor, behave: torch.Tensor, versions: torch.Tensor,
                   v_prox: float, v_theta: float) -> torch.Tensor:
    """log pi_prox ~ behave + alpha (logp - behave), detached (module doc for the derivation)."""
    alpha = loglinear_alpha(versions, v_prox, v_theta).to(logp.dtype)
    return (behave + alpha * (logp.detach() - behave)).detach()


def ppo_loss_sum(
    logp: torch.Tensor,
    prox: torch.Tensor,
    behave: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    params: PPOParams,
    global_n_tokens: float,
) -> tuple[torch.Tensor, PPOStats]:
    """This micro-batch's share of L (sum of mask * pg / global_n_tokens) and its statistics.

    All tensors have one entry per generated token (any shape, the same for all); `mask` is 1 for
    tokens that carry loss. `prox` is ignored for the coupled objective.
    """
    mask = mask.to(torch.bool)
    prox = prox.detach()
    behave = behave.detach()
    eps_low = params.eps_clip
    eps_high = params.eps_clip if params.eps_clip_higher is None else params.eps_clip_higher

    # the behaviour weight, capped: over the cap a token is masked out or clamped
    w_raw = torch.exp(prox - behave)
    over_cap = w_raw > params.behave_imp_weight_cap
    if not params.use_decoupled_loss:
        w = torch.ones_like(w_raw)
        ratio = torch.exp(logp - behave)
    else:
        if params.behave_imp_weight_mode == "mask":
            w = torch.where(over_cap, torch.zeros_like(w_raw), w_raw)
        else:
            w = w_raw.clamp(max=params.behave_imp_weight_cap)
        ratio = torch.exp(logp - prox)

    # the clipped surrogate: the pessimistic of the plain and the clipped ratio
    pg_plain = -advantages * ratio
    pg_clipped = -advantages * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    pg = torch.maximum(pg_plain, pg_clipped) * w

    # token-level mean over the GLOBAL batch: the caller's denominator, not this micro-batch's
    loss = torch.where(mask, pg, torch.zeros_like(pg)).sum() / max(float(global_n_tokens), 1.0)

    with torch.no_grad():
        m = mask
        coupled_ratio = torch.exp(logp.detach() - behave)
        coupled_clipped = (-advantages * coupled_ratio.clamp(1.0 - eps_low, 1.0 + eps_high)) > (-advantages * coupled_ratio)
        log_r = (logp.detach() - (prox if params.use_decoupled_loss else behave))
        stats = PPOStats(
            n_tokens=float(m.sum()),
            loss_sum=float(torch.where(m, pg.detach(), torch.zeros_like(pg)).sum()),
            n_clipped=float(((pg_clipped.detach() > pg_plain.detach()) & m).sum()),
            n_clipped_coupled=float((coupled_clipped & m).sum()),
            w_sum=float(torch.where(m, w_raw, torch.zeros_like(w_raw)).sum()),
            w_max=float(w_raw[m].max()) if m.any() else 0.0,
            n_capped=float((over_cap & m).sum()),
            approx_kl_sum=float(torch.where(m, torch.expm1(log_r) - log_r, torch.zeros_like(log_r)).sum()),
            adv_sum=float(torch.where(m, advantages, torch.zeros_like(advantages)).sum()),
        )
    return loss, stats


def entropy_term_sum(entropy: torch.Tensor, params: PPOParams, global_n_tokens: float) -> torch.Tensor:
    """This micro-batch's share of the entropy term: -c * sum_t H_t / N_global, or zero while the floor
    (entropy_target) is met by the micro-batch's token-mean entropy (module doc)."""
    if params.entropy_coef <= 0:
        return entropy.sum() * 0.0
    if params.entropy_target is not None and float(entropy.detach().mean()) >= params.entropy_target:
        return entropy.sum() * 0.0
    return -params.entropy_coef * entropy.sum() / max(float(global_n_tokens), 1.0)


def kl_per_token(logp: torch.Tensor, ref: torch.Tensor, estimator: str) -> torch.Tensor:
    """k1 or k3 of each token (module doc); differentiable in logp, ref is a constant."""
    d = ref.detach() - logp
    if estimator == "k1":
        return -d
    if estimator == "k3":
        return torch.expm1(d) - d
    raise ValueError(f"unknown KL estimator {estimator!r}; one of {', '.join(KL_ESTIMATORS)}")


def kl_term_sum(logp: torch.Tensor, ref: torch.Tensor, params: PPOParams, global_n_tokens: float) -> torch.Tensor:
    """This micro-batch's share of the KL term: beta * sum_t k_t / N_global."""
    return params.kl_coef * kl_per_token(logp, ref, params.kl_estimator).sum() / max(float(global_n_tokens), 1.0)


def micro_batch_loss(
    logp: torch.Tensor,
    prox: torch.Tensor,
    behave: torch.Tensor,
    advantages: torch.Tensor,
    entropy: torch.Tensor,
    params: PPOParams,
    global_n_tokens: float,
    ref: torch.Tensor | None = None,
) -> tuple[torch.Tensor, PPOStats]:
    """Everything one micro-batch backpropagates: its share of the PPO term plus the entropy term and
    (with `ref`, the reference policy's logprobs, and kl_coef > 0) the KL term, with the statistics
    of each (every generated token carries loss)."""
    loss, stats = ppo_loss_sum(logp, prox, behave, advantages, torch.ones_like(behave, dtype=torch.bool), params,
                               global_n_tokens)
    if params.entropy_coef > 0:
        loss = loss + entropy_term_sum(entropy, params, global_n_tokens)
    stats.entropy_sum = float(entropy.detach().sum())
    if params.kl_coef > 0:
        if ref is None:
            raise ValueError("kl_coef > 0 needs the reference policy's logprobs of the micro-batch")
        loss = loss + kl_term_sum(logp, ref, params, global_n_tokens)
        with torch.no_grad():
            stats.kl_ref_sum = float(kl_per_token(logp.detach(), ref, "k3").sum())
            stats.n_kl_tokens = float(ref.numel())
    return loss, stats
