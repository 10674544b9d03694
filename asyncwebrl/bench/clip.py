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
scheduler, coupled (run the coupled arm at the largest eta), decoupled (run the decoupled arms), extra (';'-separated config overrides),
out (result name), fileroot.
"""

from __future__ import annotations

from typing import Any

from asyncwebrl.bench.arms import ArmResult, run_arm
from asyncwebrl.bench.common import parse_overrides, print_table
from asyncwebrl.results import write_result

DEFAULTS = {
    "steps": 3,
    "batch": 2,
    "n_samples": 4,
    "max_steps": 1,
    "tasks": "miniwob-easy",
    "etas": "1,2,4",
    "minibatches": 2,
    "lr": 3.0e-6,
    "scheduler": "ray",
    "coupled": True,
    "decoupled": True,
    "extra": "",
    "out": "clip",
    "fileroot": "/tmp/asyncwebrl-bench",
}


def _overrides(knobs: dict[str, Any], eta: int, decoupled: bool) -> list[str]:
    ovs = [f"total_train_steps={knobs['steps']}", f"rollout.consumer_batch_size={knobs['batch']}",
           f"gconfig.n_samples={knobs['n_samples']}", f"env.max_steps={knobs['max_steps']}",
           f"env.tasks={knobs['tasks']}", f"rollout.max_head_offpolicyness={eta}",
           f"actor.ppo_n_minibatches={knobs['minibatches']}", f"actor.lr={knobs['lr']}",
           f"actor.use_decoupled_loss={'true' if decoupled else 'false'}", f"scheduler.type={knobs['scheduler']}",
           "test_rollout.enabled=false", "checkpoint.every_n_steps=0", "stats.tensorboard=false",
           "env.task_sampling.mode=uniform"]  # the same task stream for every arm
    return ovs + [o for o in str(knobs["extra"]).split(";") if o.strip()]


def main(overrides: list[str] | None = None) -> int:
    knobs = parse_overrides(overrides, DEFAULTS)
    etas = [int(e) for e in str(knobs["etas"]).split(",") if str(e).strip()]
    if not etas or min(etas) < 0:
        raise SystemExit("bench clip: etas must be a comma list of integers >= 0, e.g. etas=1,2,4")
    top = max(etas)
    # the eta = max pair first (decoupled and coupled: the success-per-second comparison), then the other
    # etas; the record is rewritten after every arm, so a run cut short still leaves what it measured
    plan = ([("decoupled", top)] if knobs["decoupled"] else []) + ([("coupled", top)] if knobs["coupled"] else [])
    plan += [("decoupled", e) for e in sorted(etas) if e != top and knobs["decoupled"]]
    if not plan:
        raise SystemExit("bench clip: decoupled=false and coupled=false leave nothing to run")
    arms: list[tuple[str, int, ArmResult]] = []
    for loss, eta in plan:
        tag = "dec" if loss == "decoupled" else "coup"
        arms.append((loss, eta, run_arm(f"clip-{tag}-eta{eta}", _overrides(knobs, eta, loss == "decoupled"),
                                        knobs["fileroot"])))
        if len(arms) < len(plan):
            write_result(knobs["out"], knobs, {"partial": f"{len(arms)} of {len(plan)} arms finished",
                                         **_figures(knobs, arms, top)})
    figures = _figures(knobs, arms, top)
    write_result(knobs["out"], knobs, figures)
    rows = [{"loss": loss, "eta": eta, "clip(decoupled r)": a.clip_rate, "clip(coupled ratio)": a.clip_rate_coupled,
             "succ/s": a.successes_per_s, "steps": len(a.steps), "wall_s": a.wall_s} for loss, eta, a in arms]
    per_eta = figures["clip_by_eta"]
    ratios = ", ".join(f"eta={e}: {v['coupled_over_decoupled']:.2f}x" if v["coupled_over_decoupled"] else f"eta={e}: n/a"
                       for e, v in per_eta.items())
    print_table(rows, f"clip rate coupled/decoupled on the same batches: {ratios}")
    return 0


def _figures(knobs: dict[str, Any], arms: list[tuple[str, int, ArmResult]], top: int) -> dict[str, Any]:
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
    dec_top = next((a for loss, e, a in arms if loss == "decoupled" and e == top), None)
    coup_top = next((a for loss, e, a in arms if loss == "coupled"), None)
    sps_dec = dec_top.successes_per_s if dec_top else None
    sps_coup = coup_top.successes_per_s if coup_top else None
    figures = {
        "clip_by_eta": per_eta,
        "success_per_s_at_eta": top,
        "success_per_s_decoupled": sps_dec,
        "success_per_s_coupled": sps_coup,
        "success_per_s_ratio_decoupled_over_coupled": sps_dec / sps_coup if sps_dec is not None and sps_coup else None,
        "clip_rate_of_coupled_run": coup_top.clip_rate if coup_top else None,
        "anchor": "seed claim: decoupled PPO roughly halves the clip rate relative to the coupled formulation",
        "loss_tokens_per_arm": [int(sum(s.n_tokens for s in a.steps)) for _, _, a in arms],
        "budget_note": (f"{knobs['steps']} training steps per arm x {knobs['batch']} groups x {knobs['n_samples']} "
                        "episodes on the machine named here (shared, heavily loaded): a small budget. Each rate "
                        "is a count over the loss tokens listed in loss_tokens_per_arm, so one clipped token "
                        "moves it by 1/that; success per second over so few steps is mostly the starting "
                        "policy's success; staleness reaches at most steps-1 versions"),
        "arms": [{"loss": loss, "eta": eta, **a.brief()} for loss, eta, a in arms],
    }
    return figures


def _sum_hist(a: ArmResult) -> dict[str, int]:
    out: dict[str, int] = {}
    for s in a.steps:
        for k, v in s.staleness_hist.items():
            out[k] = out.get(k, 0) + v
    return dict(sorted(out.items(), key=lambda kv: int(kv[0])))
