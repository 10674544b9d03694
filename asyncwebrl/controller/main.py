"""The controller: the PPO trainer loop that drives every other component (SPEC section 2).

Per step: prepare_batch (rollout keeps generating meanwhile) -> PPO update on the actor (pi_prox
recompute, advantages, decoupled loss) -> pause rollout -> weight update (xccl broadcast or disk)
-> version += 1 -> resume -> checkpoint every N steps (or when test rollout asks) -> metrics.

Invariants: the version the rollout side tags tokens with is set only after the servers hold the
new weights; a checkpoint is written only between steps (a self-consistent snapshot, with the task
sampler position and staleness seed beside the weights), and `recover=auto` resumes from the newest
complete one with the version numbering continued.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncwebrl.config import RunConfig, save_resolved
from asyncwebrl.controller.rundir import RunDir
from asyncwebrl.controller.supervisor import Supervisor

log = logging.getLogger("asyncwebrl")


@dataclass
class StepTimes:
    wait: float = 0.0
    train: float = 0.0
    sync: float = 0.0
    ckpt: float = 0.0


@dataclass
class LoopState:
    step: int = 0
    version: int = 0
    t_start: float = field(default_factory=time.monotonic)
    waited_s: float = 0.0
    trained_s: float = 0.0
    synced_s: float = 0.0
    trajectories: int = 0
    tokens: int = 0
    successes: list[float] = field(default_factory=list)
    """per-step training success rate"""
    lost: int = 0
    seen_ids: set[str] = field(default_factory=set)
    duplicates: int = 0
    checkpoint_stall_s: float = 0.0
    """the longest time one checkpoint blocked the loop (snapshot + waiting for the previous write)"""
    checkpoint_flush_s: float = 0.0
    """waiting for the last background write after the loop ended"""


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
        self.ckpt_root = run.root / "checkpoints"
        self.supervisor = Supervisor(system, restart_dead_servers=cfg.rollout.restart_dead_servers)
        self._control = None
        self._control_for: list[str] = []
        self.step_hooks: list[Any] = []
        """callables hook(controller) run at the start of every step (fault injection, probes)"""

    # ---- resume -------------------------------------------------------------------------------
    def maybe_resume(self, ckpt: Path | None) -> None:
        """Load the trainer from `ckpt` (found before the system was built, see `find_resume`) and make
        the servers serve its weights before any rollout is tagged with its version."""
        if ckpt is None:
            return
        self.sys.trainer.load_checkpoint(str(ckpt))  # returns the extra state; step/version are on disk
        meta = json.loads((ckpt / "trainer_state.json").read_text())
        self.state.version = int(meta["version"])
        self.state.step = int(meta["step"])
        self._push_weights(self.state.version)
        self.run.log_metrics("resume", self.state.step, {"version": self.state.version, "checkpoint": ckpt.name})
        log.info("resumed from %s at step %d, version %d", ckpt.name, self.state.step, self.state.version)

    # ---- one step -----------------------------------------------------------------------------
    def _bracket(self):
        """The refresh bracket over the live train-rollout servers (rebuilt when the set changes)."""
        from asyncwebrl.weights.bracket import RefreshBracket
        from asyncwebrl.weights.control import ControlChannel

        live = [a for a in self.sys.server_addresses if a not in self.supervisor.dropped]
        if self._control is None or self._control_for != live:
            if self._control is not None:
                self._control.close()
            self._control = ControlChannel(live, self.cfg.inference.api_key, self.cfg.actor.weight_update_timeout_s) \
                if live else None
            self._control_for = live
        return RefreshBracket(self.sys.rollout, self._control, self.cfg.actor.weight_pause_mode)

    def _push_weights(self, new_version: int):
        """The one refresh bracket: pause rollout and servers, move the weights, set the version, continue."""
        if self.cfg.actor.weight_update_mode == "xccl":
            transfer = lambda: self.sys.trainer.broadcast_weights(new_version)  # noqa: E731
        else:
            def transfer():
                path = self.sys.trainer.save_checkpoint(str(self.ckpt_root), self._extra_state(),
                                                        self.cfg.checkpoint.keep_last)
                self._control.call_all("/update_weights_from_disk", {"model_path": path, "abort_all_requests": False},
                                       timeout_s=max(600.0, self.cfg.actor.weight_update_timeout_s))
        report, _ = self._bracket().refresh(new_version, transfer)
        return report

    def _extra_state(self) -> dict[str, Any]:
        return {"task_sampler": self.sys.task_sampler_state(), "staleness_version": self.state.version}

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

    def step(self) -> dict[str, Any]:
        cfg, st, run = self.cfg, self.state, self.run
        B = cfg.rollout.consumer_batch_size
        for hook in self.step_hooks:
            hook(self)
        t0 = run.now()
        groups = self.sys.rollout.prepare_batch(B, st.version)
        t1 = run.now()
        run.log_phase(st.step, "rollout_wait", t0, t1)
        self._track_ids(groups)
        figs = batch_figures(groups)
        hist = staleness_hist(groups, st.version)
        self._keep_episodes(groups)
        metrics = self.sys.trainer.train_step(groups, self.sys.pixel_store)
        t2 = run.now()
        run.log_phase(st.step, "train", t1, t2)
        server_events = self.supervisor.check(st.step)  # no broadcast to a dead server
        sync_info = self._push_weights(st.version + 1)
        t3 = run.now()
        run.log_phase(st.step, "weight_sync", t2, t3)
        st.version += 1
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
            st.checkpoint_stall_s = max(st.checkpoint_stall_s, ckpt_s)
        st.waited_s += t1 - t0
        st.trained_s += t2 - t1
        st.synced_s += t3 - t2
        st.trajectories += figs["n_trajectories"]
        st.tokens += figs["generated_tokens"]
        st.successes.append(figs["success_rate"])
        elapsed = max(1e-9, time.monotonic() - st.t_start)
        rstats = self.sys.rollout.stats()
        out = {
            **figs,
            **{k: v for k, v in (metrics or {}).items() if isinstance(v, (int, float, str, dict, list))},
            "version": st.version,
            "staleness_hist": hist,
            "dropped_stale": rstats.get("dropped_stale", 0),
            "rollout_idle_frac": rstats.get("rollout_idle_frac", rstats.get("idle_fraction", 0.0)),
            "trainer_idle_frac": st.waited_s / elapsed,
            "trajectories_per_s": st.trajectories / elapsed,
            "tokens_per_s": st.tokens / elapsed,
            "step_time_s": t3 - t0 + ckpt_s,
            "wait_s": t1 - t0,
            "train_s": t2 - t1,
            "weight_sync_s": t3 - t2,
            "checkpoint_s": ckpt_s,
            "checkpoint_stall_s": ckpt_s,
            "duplicates": st.duplicates,
            "wall_time_s": elapsed,
            "servers_restarted": sum(e.action == "restarted" for e in self.supervisor.events),
            "servers_dropped": len(self.supervisor.dropped),
            "server_recovery_s": max((e.recovery_s for e in server_events), default=0.0),
        }
        out.update(sync_info.metrics())
        run.log_metrics("train", st.step, out)
        return out

    def train(self, resume_from: Path | None = None) -> dict[str, Any]:
        cfg = self.cfg
        self.maybe_resume(resume_from)
        if self.sys.test_rollout is not None and resume_from is None:
            # version 0 on disk, so evaluation has the starting point to compare every later version with
            self.sys.trainer.save_checkpoint(str(self.ckpt_root), self._extra_state(), cfg.checkpoint.keep_last,
                                             background=True)
        self.sys.start_rollout()
        bar = None
        if cfg.stats.progress_bar:
            from tqdm import tqdm

            bar = tqdm(total=cfg.total_train_steps, initial=self.state.step, desc="train", dynamic_ncols=True)
        try:
            while self.state.step < cfg.total_train_steps:
                m = self.step()
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(v=m["version"], succ=f"{m['success_rate']:.2f}", r=f"{m['reward_mean']:.2f}",
                                    idle=f"{m['trainer_idle_frac']:.2f}", sync=f"{m['weight_sync_s']:.2f}s")
                else:
                    log.info("step %d v%d success %.2f reward %.2f", self.state.step, m["version"],
                             m["success_rate"], m["reward_mean"])
        finally:
            if bar is not None:
                bar.close()
            if self._control is not None:
                self._control.close()
                self._control = None
            t0 = time.monotonic()
            self.sys.trainer.flush_checkpoints()  # the last write is published before the run ends
            self.state.checkpoint_flush_s = time.monotonic() - t0
        return self.summary()

    def summary(self) -> dict[str, Any]:
        s = self.state.successes
        w = max(1, min(5, len(s) // 3 or 1))
        first = sum(s[:w]) / w if s else 0.0
        last = sum(s[-w:]) / w if s else 0.0
        rstats = self.sys.rollout.stats()
        return {
            "steps": self.state.step,
            "version": self.state.version,
            "wall_time_s": time.monotonic() - self.state.t_start,
            "window": w,
            "success_first": first,
            "success_last": last,
            "success_gain": last - first,
            "trajectories": self.state.trajectories,
            "duplicates": self.state.duplicates,
            "dropped_stale": rstats.get("dropped_stale", 0),
            "failed_episodes": rstats.get("failed", rstats.get("failed_episodes", 0)),
            "trainer_idle_frac": self.state.waited_s / max(1e-9, time.monotonic() - self.state.t_start),
            "checkpoint_stall_s": self.state.checkpoint_stall_s,
            "checkpoint_flush_s": self.state.checkpoint_flush_s,
        }


def run_training(cfg: RunConfig) -> dict[str, Any]:
    """`asyncwebrl train`: build the system, run the loop, write the summary, tear everything down."""
    from asyncwebrl.controller.system import build_system

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from asyncwebrl.configtree import to_dict

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
        summary["setup_s"] = setup_s
        if system.test_rollout is not None:
            system.test_rollout.evaluate_latest_blocking(timeout_s=600)
            evals = sorted(_eval_records(run.root), key=lambda r: r["version"])
            summary["eval"] = evals
            if evals:
                summary["eval_first"] = evals[0]["success_rate"]
                summary["eval_last"] = evals[-1]["success_rate"]
                summary["eval_gain"] = summary["eval_last"] - summary["eval_first"]
        run.write_summary(summary)
        run.log_metrics("summary", ctl.state.step, {k: v for k, v in summary.items() if not isinstance(v, list)})
    finally:
        system.shutdown()
        run.close()
    if cfg.stats.results_name:
        from asyncwebrl.bench.common import write_result

        figures = dict(summary, run_time_s=summary["wall_time_s"] + summary["setup_s"], run_dir=str(run.root))
        write_result(cfg.stats.results_name, to_dict(cfg), figures)
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


def _eval_records(root: Path) -> list[dict[str, Any]]:
    from asyncwebrl.controller.rundir import read_jsonl

    return [{"version": r.get("version"), "success_rate": r.get("success_rate")}
            for r in read_jsonl(root / "metrics.jsonl") if r.get("kind") == "eval"]


def _print_summary(cfg: RunConfig, root: Path, summary: dict[str, Any]) -> None:
    print()
    print(f"run directory      {root}")
    print(f"steps / version    {summary['steps']} / {summary['version']}  in {summary['wall_time_s']:.0f} s")
    print(f"success (train)    first {summary['window']} steps {summary['success_first']:.3f} -> "
          f"last {summary['window']} steps {summary['success_last']:.3f}  (gain {summary['success_gain']:+.3f})")
    for r in summary.get("eval", []):
        print(f"eval               version {r['version']}: success {r['success_rate']:.3f}")
    print(f"logs and plots     {root / 'metrics.jsonl'}, tensorboard --logdir {root / 'tb'}, asyncwebrl view {root}")
    print(json.dumps({k: v for k, v in summary.items() if k != 'eval'}))
