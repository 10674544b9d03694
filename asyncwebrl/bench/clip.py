"""`asyncwebrl bench clip`: the seed's claim "decoupled PPO roughly halves the clip rate relative to the
coupled formulation", measured (SPEC sections 6, 11).

The same workload is trained with the decoupled loss at eta = 1, 2, 4 (one run each, same seed). Every
PPO minibatch records, on the SAME tokens, two clip rates: the decoupled one (clipped branch of
r = pi_theta / pi_prox active) and the one the coupled ratio pi_theta / pi_behave would have had
(`PPOStats.n_clipped` / `n_clipped_coupled`). Rates are token-weighted over the run. One more run
trains with the coupled loss at eta = 4, so success per wall-clock second of both losses at eta = 4
is compared side by side.

`actor.ppo_n_minibatches` defaults to 2 here: with a single minibatch pi_prox IS pi_theta at the only
forward pass (r = 1 exactly, nothing can clip), so the decoupled clip rate would be zero by
construction; from the second minibatch on, r measures how far this update moved the policy.

Knobs (key=value): steps, batch, n_samples, max_steps, tasks, etas (comma list), minibatches, lr,
scheduler, extra (';'-separated config overrides), fileroot.
"""

from __future__ import annotations

from typing import Any

from asyncwebrl.bench.arms import ArmResult, run_arm
from asyncwebrl.bench.common import parse_overrides, print_table, write_result

DEFAULTS = {
    "steps": 4,
    "batch": 2,
    "n_samples": 4,
    "max_steps": 1,
    "tasks": "miniwob-easy",
    "etas": "1,2,4",
    "minibatches": 2,
    "lr": 3.0e-6,
    "scheduler": "ray",
    "extra": "",
    "fileroot": "/tmp/asyncwebrl-bench",
}


def _overrides(knobs: dict[str, Any], eta: int, decoupled: bool) -> list[str]:
    ovs = [f"total_train_steps={knobs['steps']}", f"rollout.consumer_batch_size={knobs['batch']}",
           f"gconfig.n_samples={knobs['n_samples']}", f"env.max_steps={knobs['max_steps']}",
           f"env.tasks={knobs['tasks']}", f"rollout.max_head_offpolicyness={eta}",
           f"actor.ppo_n_minibatches={knobs['minibatches']}", f"actor.lr={knobs['lr']}",
           f"actor.use_decoupled_loss={'true' if decoupled else 'false'}", f"scheduler.type={knobs['scheduler']}",
           "test_rollout.enabled=false", "checkpoint.every_n_steps=0", "stats.tensorboard=false"]
    return ovs + [o for o in str(knobs["extra"]).split(";") if o.strip()]


def main(overrides: list[str] | None = None) -> int:
    knobs = parse_overrides(overrides, DEFAULTS)
    etas = [int(e) for e in str(knobs["etas"]).split(",") if str(e).strip()]
    if not etas or min(etas) < 0:
        raise SystemExit("bench clip: etas must be a comma list of integers >= 0, e.g. etas=1,2,4")
    arms: list[tuple[str, int, ArmResult]] = []
    for eta in etas:
        arms.append(("decoupled", eta, run_arm(f"clip-dec-eta{eta}", _overrides(knobs, eta, True), knobs["fileroot"])))
    top = max(etas)
    arms.append(("coupled", top, run_arm(f"clip-coup-eta{top}", _overrides(knobs, top, False), knobs["fileroot"])))

    per_eta = {}
    for loss, eta, a in arms:
        if loss != "decoupled":
            continue
        per_eta[str(eta)] = {
            "clip_rate_decoupled": a.clip_rate,
            "clip_rate_coupled_same_batches": a.clip_rate_coupled,
            "coupled_over_decoupled": a.clip_rate_coupled / a.clip_rate if a.clip_rate > 0 else None,
            "staleness_hist": _sum_hist(a),
        }
    dec_top = next(a for loss, e, a in arms if loss == "decoupled" and e == top)
    coup_top = arms[-1][2]
    figures = {
        "clip_by_eta": per_eta,
        "success_per_s_at_eta": top,
        "success_per_s_decoupled": dec_top.successes_per_s,
        "success_per_s_coupled": coup_top.successes_per_s,
        "success_per_s_ratio_decoupled_over_coupled": (dec_top.successes_per_s / coup_top.successes_per_s
                                                        if coup_top.successes_per_s > 0 else None),
        "clip_rate_of_coupled_run": coup_top.clip_rate,
        "anchor": "seed claim: decoupled PPO roughly halves the clip rate relative to the coupled formulation",
        "budget_note": (f"{knobs['steps']} training steps per arm x {knobs['batch']} groups x {knobs['n_samples']} "
                        "episodes, on the machine named here; a small budget: rates carry sampling noise of a "
                        "few hundred loss tokens per arm, and success per second over so few steps is mostly "
                        "the starting policy's success"),
        "arms": [{"loss": loss, "eta": eta, **a.brief()} for loss, eta, a in arms],
    }
    write_result("clip", knobs, figures)
    rows = [{"loss": loss, "eta": eta, "clip(decoupled r)": a.clip_rate, "clip(coupled ratio)": a.clip_rate_coupled,
             "succ/s": a.successes_per_s, "steps": len(a.steps), "wall_s": a.wall_s} for loss, eta, a in arms]
    ratios = ", ".join(f"eta={e}: {v['coupled_over_decoupled']:.2f}x" if v["coupled_over_decoupled"] else f"eta={e}: n/a"
                       for e, v in per_eta.items())
    print_table(rows, f"clip rate coupled/decoupled on the same batches: {ratios}")
    return 0


def _sum_hist(a: ArmResult) -> dict[str, int]:
    out: dict[str, int] = {}
    for s in a.steps:
        for k, v in s.staleness_hist.items():
            out[k] = out.get(k, 0) + v
    return dict(sorted(out.items(), key=lambda kv: int(kv[0])))
