"""The controller: the PPO trainer loop that drives every other component (SPEC section 2).

Per step: prepare_batch (rollout keeps generating meanwhile) -> the task curriculum observes the
consumed groups and pushes new sampling weights down to the rollout workers (adaptive sampling) ->
PPO update on the actor (pi_prox recompute, advantages, decoupled loss) -> the refresh bracket of
`asyncwebrl.weights.bracket` (pause rollout and servers, xccl broadcast or disk, advance the version,
continue) -> checkpoint every N steps (or when test rollout asks; the loop blocks only for its
snapshot, the write runs behind it) -> metrics.

Before the first step of a fresh run with `warm_start.enabled`, the trainer ranks clone oracle (or
recorded) demonstrations (`training.warm_start`) and the refresh bracket publishes the result as
version 0, before rollout starts; a resumed run never repeats it.

Invariants: the version the rollout side tags tokens with is set only after the servers hold the
new weights; a checkpoint is written only between steps (a self-consistent snapshot, with the task
sampler position, staleness seed and curriculum tracker beside the weights), and `recover=auto` resumes from the newest
complete one with the version numbering continued.

The loop keeps no version of its own: it reads the run's one owner (`System.version`, a
`weights.version.PolicyVersion`), which only the refresh bracket advances; every train step tells the
trainer the owner's value (the trainer raises `VersionDrift` if the weights it holds differ), and a
resume checks that the checkpoint's version is the one the system was built at (`find_resume` read it).
"""

from __future__ import annotations

import json
import logging
import queue
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncwebrl.config import RunConfig, save_resolved
from asyncwebrl.controller.records import EvalPoint, RunSummary, StepRecord, as_figures
from asyncwebrl.controller.rundir import RunDir, set_aside_previous
from asyncwebrl.controller.supervisor import Supervisor

log = logging.getLogger("asyncwebrl")


@dataclass
class LoopState:
    step: int = 0
    t_start: float = field(default_factory=time.monotonic)
    waited_s: float = 0.0
    trained_s: float = 0.0
    synced_s: float = 0.0
    trajectories: int = 0
    tokens: int = 0
    successes: list[float] = field(default_factory=list)
    """per-step training success rate"""
    checkpoint_stall_s: float = 0.0
    """the longest time one checkpoint blocked the loop (its snapshot, and waiting for the previous
    background write, if one was still in flight)"""
    seen_ids: set[str] = field(default_factory=set)
    duplicates: int = 0


def make_curriculum(cfg: RunConfig):
    """The run's task curriculum over the training tasks (uniform mode: tracking only)."""
    from asyncwebrl.rollout.curriculum import TaskCurriculum
    from asyncwebrl.web.tasks import make_task_sampler

    return TaskCurriculum(make_task_sampler(cfg.env).task_ids, cfg.env.task_sampling)


def batch_figures(groups) -> dict[str, Any]:
    trajs = [t for g in groups for t in g.trajectories]
    ok = [t for t in trajs if not t.failed]
    n = max(1, len(ok))
    steps = sum(len(t.steps) for t in ok)
    return {
        "n_trajectories": len(trajs),
        "failed_trajectories": len(trajs) - len(ok),
        "reward_mean": sum(t.reward for t in ok) / n,
        "success_rate": sum(1.0 for t in ok if t.success) / n,
        "episode_len_mean": steps / n,
        "invalid_rate": sum(t.n_invalid for t in ok) / max(1, steps),
        "no_effect_rate": sum(t.n_no_effect for t in ok) / max(1, steps),
        "slow_steps": sum(int(t.info.get("n_slow_steps", 0)) for t in trajs),  # failed episodes too
        "generated_tokens": sum(t.n_tokens for t in trajs),
    }


def staleness_hist(groups, version: int) -> dict[str, int]:
    c = Counter(version - g.head_version for g in groups if g.head_version >= 0)
    return {str(k): v for k, v in sorted(c.items())}


class Controller:
    """Owns the loop; the components are built by `asyncwebrl.controller.system.build_system`."""

    def __init__(self, cfg: RunConfig, system, run: RunDir):
        self.cfg = cfg
        self.sys = system
        self.run = run
        self.state = LoopState()
        self.clock = system.version
        """the run's one weight-version owner (read here; the refresh bracket advances it)"""
        self.ckpt_root = run.root / "checkpoints"
        self.supervisor = Supervisor(system, restart_dead_servers=cfg.rollout.restart_dead_servers)
        self._control = None
        self._control_for: list[str] = []
        self.curriculum = make_curriculum(cfg)
        self.zero_adv_groups = 0
        """consumed groups whose advantages were all zero (wasted rollout), whole run"""
        self.skipped_groups = 0
        """groups rollout.dynamic_sampling drew but did not train on (all-zero advantages), whole run"""
        self.history: list[StepRecord] = []
        """every step's record, in order (benchmarks read them by attribute)"""
        self.step_hooks: list[Any] = []
        """callables hook(controller) run at the start of every step (fault injection, probes)"""
        self.warm_start = None
        """the `WarmStartReport` of this run's warm start (None: off, or a resumed run)"""
        self._evals: queue.SimpleQueue = queue.SimpleQueue()
        """evaluation figures from the test-rollout thread, folded into the curriculum's priors"""
        if system.test_rollout is not None and cfg.env.task_sampling.prior == "eval":
            system.test_rollout.subscribe(self._evals.put)

    # ---- resume -------------------------------------------------------------------------------
    def maybe_resume(self, ckpt: Path | None) -> None:
        """Load the trainer from `ckpt` (found before the system was built, see `find_resume`) and make
        the servers serve its weights before any rollout is tagged with its version."""
        if ckpt is None:
            return
        extra = self.sys.trainer.load_checkpoint(str(ckpt)) or {}  # step/version are on disk
        if extra.get("curriculum"):
            self.curriculum.load_state_dict(extra["curriculum"])
        meta = json.loads((ckpt / "trainer_state.json").read_text())
        self.clock.check(int(meta["version"]), f"checkpoint {ckpt.name}")  # built at find_resume's version
        self.state.step = int(meta["step"])
        self._push_weights(advance=False)  # the servers serve the checkpoint's weights, at its version
        self.run.log_metrics("resume", self.state.step, {"version": self.clock.value, "checkpoint": ckpt.name})
        log.info("resumed from %s at step %d, version %d", ckpt.name, self.state.step, self.clock.value)

    # ---- warm start ---------------------------------------------------------------------------
    def maybe_warm_start(self) -> None:
        """With warm_start.enabled, on a fresh run only: behaviour cloning on demonstrations on the
        trainer ranks, then the refresh bracket hands those weights to the servers as version 0 (the
        version does not advance), all before rollout starts, so no token is generated by the weights
        before it. A resumed run never redoes it: its checkpoint holds the warm-started weights."""
        if not self.cfg.warm_start.enabled:
            return
        from asyncwebrl.controller.warm_start import run_warm_start
        from asyncwebrl.rollout.workflow import cached_adapter

        t0 = self.run.now()
        rep = run_warm_start(self.cfg, self.sys.trainer, cached_adapter(self.sys.model_path))
        for e in rep.epochs:
            self.run.log_metrics("warm_start", e.epoch, dict(e.as_log(), demos=rep.demos, samples=rep.samples,
                                                            collect_s=rep.collect_s))
        self._push_weights(advance=False)
        self.run.log_phase(0, "warm_start", t0, self.run.now())
        self.warm_start = rep
        log.info("warm start: NLL %.3f -> %.3f over %d epochs on %d demonstrations (%d steps), %.0f s",
                 rep.nll_first, rep.nll_last, len(rep.epochs), rep.demos, rep.samples, rep.collect_s + rep.train_s)

    # ---- one step -----------------------------------------------------------------------------
    def _bracket(self):
        """The refresh bracket over the live train-rollout servers (rebuilt when the set changes)."""
        from asyncwebrl.weights.bracket import RefreshBracket
        from asyncwebrl.weights.control import ControlChannel

        live = [a for a in self.sys.server_addresses if a not in self.supervisor.dropped]
        if self._control is None or self._control_for != live:
            if self._control is not None:
                self._control.close()
            self._control = ControlChannel(live, self.sys.api_key, self.cfg.actor.weight_update_timeout_s) \
                if live else None
            self._control_for = live
        return RefreshBracket(self.sys.rollout, self._control, self.cfg.actor.weight_pause_mode)

    def _push_weights(self, advance: bool = True):
        """The one refresh bracket (`asyncwebrl.weights.bracket`): pause rollout and servers, move the
        weights, advance the version (not on resume), continue. Returns its `RefreshReport`."""
        bracket = self._bracket()
        if self.cfg.actor.weight_update_mode == "xccl":
            def transfer():
                return self.sys.trainer.broadcast_weights()
        else:
            transfer = bracket.disk_transfer(  # flush_cache false: the bracket flushes, where SGLang can
                lambda: self.sys.trainer.save_checkpoint(str(self.ckpt_root), self._extra_state(),
                                                         self.cfg.checkpoint.keep_last),
                timeout_s=max(600.0, self.cfg.actor.weight_update_timeout_s))
        report, _ = bracket.refresh(transfer, advance)
        return report

    def _extra_state(self) -> dict[str, Any]:
        return {"task_sampler": self.sys.task_sampler_state(), "staleness_version": self.clock.value,
                "curriculum": self.curriculum.state_dict()}

    def _push_task_weights(self) -> None:
        if self.curriculum.adaptive:
            self.sys.rollout.set_task_weights(self.curriculum.weights())

    def _fold_evals(self, wait_s: float = 0.0) -> bool:
        """Fold the evaluations that arrived into the curriculum's priors (waiting up to `wait_s` for
        the first); True when one was folded in."""
        folded = False
        timeout = wait_s
        while True:
            try:
                figs = self._evals.get(timeout=timeout) if timeout > 0 else self._evals.get_nowait()
            except queue.Empty:
                return folded
            timeout = 0.0
            n = self.curriculum.observe_eval(figs.get("per_task") or {})
            folded = folded or n > 0
            log.info("curriculum: priors of %d tasks from the evaluation of version %s", n, figs.get("version"))

    def _keep_episodes(self, groups) -> None:
        store = self.sys.pixel_store
        for g in groups:
            for t in g.trajectories:
                def fetch(t=t):
                    out = []
                    for s in t.steps:
                        if s.pixels:
                            out.append(s.pixels[-1])
                        elif s.pixel_keys and store is not None:
                            out.append(store.get([s.pixel_keys[-1]])[0])
                        else:
                            out.append(None)
                    return out
                self.run.keep_episode(t, g.head_version, fetch)

    def _track_ids(self, groups) -> None:
        for g in groups:
            for t in g.trajectories:
                if t.traj_id in self.state.seen_ids:
                    self.state.duplicates += 1
                self.state.seen_ids.add(t.traj_id)

    def _draw_batch(self, B: int) -> tuple[list, list]:
        """(every group drawn this step, the groups to train on). Without rollout.dynamic_sampling both
        are the one batch of B groups; with it, groups whose advantages are all zero are set aside and
        more are drawn until B carry a signal or dynamic_sampling_max_draws * B were drawn (then the
        step trains on those with a signal, or on the last batch drawn when none had one)."""
        rc = self.cfg.rollout
        batch = self.sys.rollout.prepare_batch(B)
        if not rc.dynamic_sampling:
            return batch, batch
        from asyncwebrl.rollout.curriculum import zero_advantage

        drawn, keep = list(batch), [g for g in batch if not zero_advantage(g)]
        while len(keep) < B and len(drawn) < rc.dynamic_sampling_max_draws * B:
            # the fallback is only ever the newest batch, so this one's groups without a signal are out:
            # their staleness budget goes back BEFORE the next draw, or the pool would stop at eta
            self._skip([g for g in batch if zero_advantage(g)])
            batch = self.sys.rollout.prepare_batch(B - len(keep))
            drawn += batch
            keep += [g for g in batch if not zero_advantage(g)]
        groups = keep if keep else batch
        trained = {id(g) for g in groups}
        self._skip([g for g in batch if id(g) not in trained])
        return drawn, groups

    def _skip(self, groups) -> None:
        """Groups drawn but not trained on: the viewer may keep their episodes (before the screenshots
        go), then the rollout side takes back their staleness budget and frees their screenshots."""
        if groups:
            self._keep_episodes(groups)
            self.sys.rollout.discard(groups)

    def step(self) -> StepRecord:
        cfg, st, run = self.cfg, self.state, self.run
        B = cfg.rollout.consumer_batch_size
        for hook in self.step_hooks:
            hook(self)
        t0 = run.now()
        version = self.clock.value
        drawn, groups = self._draw_batch(B)
        t1 = run.now()
        run.log_phase(st.step, "rollout_wait", t0, t1)
        self._track_ids(drawn)
        figs = batch_figures(drawn)
        self._fold_evals()
        zero_adv = self.curriculum.observe(drawn)  # every drawn group flows back into task sampling
        self.zero_adv_groups += zero_adv
        skipped = len(drawn) - len(groups)
        self.skipped_groups += skipped
        self._push_task_weights()
        cur = self.curriculum.record()
        run.log_metrics("curriculum", st.step + 1, cur.flat())
        hist = staleness_hist(groups, version)
        self._keep_episodes(groups)  # skipped groups were offered to the viewer when they were set aside
        metrics = self.sys.trainer.train_step(groups, self.sys.pixel_store, version)
        t2 = run.now()
        run.log_phase(st.step, "train", t1, t2)
        server_events = self.supervisor.check(st.step)  # no broadcast to a dead server
        sync_info = self._push_weights()
        t3 = run.now()
        run.log_phase(st.step, "weight_sync", t2, t3)
        st.step += 1
        ckpt_s = 0.0
        every = cfg.checkpoint.every_n_steps
        tr = self.sys.test_rollout
        if (every and st.step % every == 0) or st.step == cfg.total_train_steps or (tr and tr.wants_checkpoint):
            if cfg.actor.weight_update_mode == "xccl" or st.step == cfg.total_train_steps:
                # the loop blocks only for the snapshot; the write and its atomic publish run behind it
                self.sys.trainer.save_checkpoint(str(self.ckpt_root), self._extra_state(), cfg.checkpoint.keep_last,
                                                 background=True)
            if tr:
                tr.checkpoint_written()
            t4 = run.now()
            run.log_phase(st.step - 1, "checkpoint", t3, t4)
            ckpt_s = t4 - t3
        st.waited_s += t1 - t0
        st.trained_s += t2 - t1
        st.synced_s += t3 - t2
        st.checkpoint_stall_s = max(st.checkpoint_stall_s, ckpt_s)
        st.trajectories += figs["n_trajectories"]
        st.tokens += figs["generated_tokens"]
        st.successes.append(figs["success_rate"])
        elapsed = max(1e-9, time.monotonic() - st.t_start)
        rstats = self.sys.rollout.stats()
        rec = StepRecord(
            step=st.step,
            version=self.clock.value,
            **figs,
            staleness_hist=hist,
            n_groups=len(drawn),
            zero_adv_groups=zero_adv,
            zero_adv_frac=zero_adv / max(1, len(drawn)),
            skipped_groups=skipped,
            tasks_in_zone=cur.in_zone,
            dropped_stale=rstats.dropped_stale,
            failed_episodes=rstats.failed_episodes,
            failed_rollouts=rstats.failed_rollouts,
            rollout_idle_frac=rstats.rollout_idle_fraction,
            trainer_idle_frac=st.waited_s / elapsed,
            trajectories_per_s=st.trajectories / elapsed,
            tokens_per_s=st.tokens / elapsed,
            step_time_s=t3 - t0,
            wait_s=t1 - t0,
            train_s=t2 - t1,
            weight_sync_s=t3 - t2,
            checkpoint_s=ckpt_s,
            wall_time_s=elapsed,
            duplicates=st.duplicates,
            servers_restarted=sum(e.action == "restarted" for e in self.supervisor.events),
            servers_dropped=len(self.supervisor.dropped),
            server_recovery_s=max((e.recovery_s for e in server_events), default=0.0),
            trainer=as_figures(metrics),
            sync=as_figures(sync_info),
        )
        run.log_metrics("train", st.step, rec.as_log())
        self.history.append(rec)
        return rec

    def train(self, resume_from: Path | None = None) -> RunSummary:
        cfg = self.cfg
        self.maybe_resume(resume_from)
        if resume_from is None:
            self.maybe_warm_start()
        wrote_v0 = self.warm_start is not None and cfg.actor.weight_update_mode == "disk"  # the refresh wrote it
        if (self.sys.test_rollout is not None or self.warm_start is not None) and resume_from is None and not wrote_v0:
            # version 0 on disk, so evaluation has the starting point to compare every later version with
            # (and a warm-started run that stops before its first checkpoint resumes without redoing it)
            self.sys.trainer.save_checkpoint(str(self.ckpt_root), self._extra_state(), cfg.checkpoint.keep_last,
                                                 background=True)
        ts = cfg.env.task_sampling
        if (self.curriculum.adaptive and ts.prior == "eval" and ts.prior_wait_s > 0 and resume_from is None
                and self.sys.test_rollout is not None):
            # the curriculum's first choice from the evaluation of version 0 rather than blind: the
            # evaluation has the machine to itself for a minute, then rollout starts informed
            self.sys.start_test_rollout()
            t0 = time.monotonic()
            got = self._fold_evals(wait_s=ts.prior_wait_s)
            self.run.log_metrics("curriculum_prior", 0, {"wait_s": time.monotonic() - t0, "folded": float(got)})
        self.sys.start_rollout()
        self._push_task_weights()  # after start: a Ray worker answers calls once it is constructed
        bar = None
        if cfg.stats.progress_bar:
            from tqdm import tqdm

            bar = tqdm(total=cfg.total_train_steps, initial=self.state.step, desc="train", dynamic_ncols=True)
        try:
            while self.state.step < cfg.total_train_steps:
                m = self.step()
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(v=m.version, succ=f"{m.success_rate:.2f}", r=f"{m.reward_mean:.2f}",
                                    idle=f"{m.trainer_idle_frac:.2f}", sync=f"{m.weight_sync_s:.2f}s")
                else:
                    log.info("step %d v%d success %.2f reward %.2f", m.step, m.version, m.success_rate, m.reward_mean)
        finally:
            if bar is not None:
                bar.close()
            if self._control is not None:
                self._control.close()
                self._control = None
        self.sys.trainer.flush_checkpoints()  # the last background write is published before the run ends
        return self.summary()

    def summary(self) -> RunSummary:
        s = self.state.successes
        w = max(1, min(5, len(s) // 3 or 1))
        first = sum(s[:w]) / w if s else 0.0
        last = sum(s[-w:]) / w if s else 0.0
        rstats = self.sys.rollout.stats()
        elapsed = time.monotonic() - self.state.t_start
        return RunSummary(
            steps=self.state.step,
            version=self.clock.value,
            wall_time_s=elapsed,
            window=w,
            success_first=first,
            success_last=last,
            success_gain=last - first,
            trajectories=self.state.trajectories,
            duplicates=self.state.duplicates,
            dropped_stale=rstats.dropped_stale,
            failed_episodes=rstats.failed_episodes,
            failed_rollouts=rstats.failed_rollouts,
            lost_rollouts=rstats.lost_rollouts,
            trainer_idle_frac=self.state.waited_s / max(1e-9, elapsed),
            checkpoint_stall_s=self.state.checkpoint_stall_s,
            task_sampling=self.curriculum.cfg.mode,
            zero_adv_groups=self.zero_adv_groups,
            skipped_groups=self.skipped_groups,
            task_success_ema=self.curriculum.record().success,
            task_share=self.curriculum.record().share,
            warm_start_demos=self.warm_start.demos if self.warm_start else 0,
            warm_start_nll_first=self.warm_start.nll_first if self.warm_start else None,
            warm_start_nll_last=self.warm_start.nll_last if self.warm_start else None,
            warm_start_s=(self.warm_start.collect_s + self.warm_start.train_s) if self.warm_start else 0.0,
        )


def run_training(cfg: RunConfig, record: str | None = None) -> RunSummary:
    """`asyncwebrl train`: build the system, run the loop, write the summary into the run directory,
    tear everything down. With `record` (`train --record NAME`) the summary is also written to
    bench/results/NAME.json, the one way a training run reaches the committed results."""
    from asyncwebrl.controller.system import build_system

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from asyncwebrl.configtree import to_dict

    if cfg.recover == "off":
        prev = set_aside_previous(cfg.run_dir)
        if prev is not None:
            log.warning("recover=off: the earlier run in %s was moved to %s (one earlier run is kept; "
                        "recover=auto resumes instead)", cfg.run_dir, prev)
    run = RunDir(cfg.run_dir, keep_episodes=cfg.stats.keep_episodes, tensorboard=cfg.stats.tensorboard, seed=cfg.seed,
                 wandb_project=cfg.stats.wandb_project, config=to_dict(cfg))
    save_resolved(cfg, run.root)
    resume_from, resume_version = find_resume(cfg, run.root)
    t0 = time.monotonic()
    system = build_system(cfg, run, resume_version=resume_version)
    setup_s = time.monotonic() - t0
    try:
        ctl = Controller(cfg, system, run)
        summary = ctl.train(resume_from)
        summary.setup_s = setup_s
        if system.test_rollout is not None:
            system.test_rollout.evaluate_latest_blocking(timeout_s=600)
            summary.eval = sorted(_eval_records(run.root), key=lambda r: r.version)
            if summary.eval:
                summary.eval_first = summary.eval[0].success_rate
                summary.eval_last = summary.eval[-1].success_rate
                summary.eval_gain = summary.eval_last - summary.eval_first
            held = [r for r in summary.eval if r.heldout_success_rate is not None]
            if held:
                summary.heldout_eval_first = held[0].heldout_success_rate
                summary.heldout_eval_last = held[-1].heldout_success_rate
            based = [r for r in summary.eval if r.shortcut_baseline is not None]
            if based:
                last = based[-1]
                summary.shortcut_baseline, summary.shortcut_policy = last.shortcut_baseline, last.shortcut_policy
                summary.heldout_shortcut_baseline = last.heldout_shortcut_baseline
                summary.gain_over_shortcut = summary.eval_last - last.shortcut_baseline
        run.write_summary(summary.as_dict())
        run.log_metrics("summary", ctl.state.step,
                        {k: v for k, v in summary.as_dict().items() if not isinstance(v, list)})
    finally:
        system.shutdown()
        run.close()
    if record:
        from asyncwebrl.results import write_result

        write_result(record, to_dict(cfg), dict(summary.as_dict(), run_time_s=summary.run_time_s,
                                                run_dir=str(run.root)))
    _print_summary(cfg, run.root, summary)
    return summary


def find_resume(cfg: RunConfig, root: Path) -> tuple[Path | None, int]:
    """With recover=auto: the newest complete checkpoint of this trial and its version."""
    if cfg.recover != "auto":
        return None, 0
    from asyncwebrl.training.checkpoint import latest_complete_checkpoint

    ckpt = latest_complete_checkpoint(root / "checkpoints")
    if ckpt is None:
        log.info("recover=auto: no complete checkpoint under %s, starting fresh", root / "checkpoints")
        return None, 0
    meta = json.loads((ckpt / "trainer_state.json").read_text())
    return ckpt, int(meta["version"])


def _eval_records(root: Path) -> list[EvalPoint]:
    from asyncwebrl.controller.rundir import read_jsonl

    return [EvalPoint(version=int(r["version"]), success_rate=float(r["success_rate"]),
                      heldout_success_rate=r.get("heldout_success_rate"), per_task=r.get("per_task") or {},
                      heldout_per_task=r.get("heldout_per_task") or {},
                      shortcut_baseline=r.get("shortcut_baseline"), shortcut_policy=r.get("shortcut_policy"),
                      gain_over_shortcut=r.get("gain_over_shortcut"),
                      heldout_shortcut_baseline=r.get("heldout_shortcut_baseline"))
            for r in read_jsonl(root / "metrics.jsonl") if r.get("kind") == "eval"]


def _print_summary(cfg: RunConfig, root: Path, summary: RunSummary) -> None:
    print()
    print(f"run directory      {root}")
    print(f"steps / version    {summary.steps} / {summary.version}  in {summary.wall_time_s:.0f} s")
    if summary.warm_start_demos:
        print(f"warm start         {summary.warm_start_demos} demonstrations, NLL {summary.warm_start_nll_first:.3f} "
              f"-> {summary.warm_start_nll_last:.3f}, {summary.warm_start_s:.0f} s (its result is version 0)")
    print(f"success (train)    first {summary.window} steps {summary.success_first:.3f} -> "
          f"last {summary.window} steps {summary.success_last:.3f}  (gain {summary.success_gain:+.3f})")
    print(f"episodes           {summary.trajectories} trained on, {summary.failed_episodes} failed, "
          f"{summary.dropped_stale} groups dropped stale")
    for r in summary.eval:
        held = f"   held-out {r.heldout_success_rate:.3f}" if r.heldout_success_rate is not None else ""
        print(f"eval               version {r.version}: success {r.success_rate:.3f}{held}")
    if summary.shortcut_baseline is not None:
        t = cfg.test_rollout.temperature
        how = "greedy eval" if t <= 0 else f"eval at temperature {t:g}"
        print(f"shortcut baseline  {summary.shortcut_baseline:.3f} ({summary.shortcut_policy}); {how} "
              f"gains {summary.gain_over_shortcut:+.3f} over it")
    print(f"logs and plots     {root / 'metrics.jsonl'}, {root / 'summary.json'}, "
          f"tensorboard --logdir {root / 'tb'}, asyncwebrl view {root}")
