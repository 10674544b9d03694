"""The warm start, end to end (issue 19): collect demonstrations on this process's browsers
(`rollout.demonstrations`), clone them on the trainer ranks, and report what happened. The caller
publishes the result to the inference servers as version 0."""

from __future__ import annotations

import logging
import time

from asyncwebrl.rollout.demonstrations import collect_demonstrations
from asyncwebrl.training.warm_start import WarmStartReport
from asyncwebrl.web.tasks import resolve_task_names

log = logging.getLogger(__name__)


def warm_start_tasks(cfg) -> list[str]:
    """The MiniWoB task names the warm start demonstrates: warm_start.tasks, '' = env.tasks."""
    return resolve_task_names(cfg.warm_start.tasks or cfg.env.tasks)


def run_warm_start(cfg, trainer, adapter) -> WarmStartReport:
    """Collect the demonstrations (here, on this process's browsers) and clone them on the trainer
    ranks (`trainer.warm_start`, a TrainerGroup). The caller publishes the weights as version 0."""
    ws = cfg.warm_start
    demos = collect_demonstrations(cfg.env, adapter, warm_start_tasks(cfg), cfg.gconfig.max_new_tokens,
                                   source=ws.source, n_demos=ws.n_demos, seed=ws.seed, concurrency=ws.concurrency,
                                   episodes_dir=ws.episodes_dir)
    log.info("warm start: %d demonstrations (%d steps) from %d episodes in %.1f s; %s", demos.episodes,
             len(demos.samples), demos.attempts, demos.collect_s, demos.per_task)
    t0 = time.monotonic()
    epochs = trainer.warm_start(demos.samples, ws)
    return WarmStartReport(source=ws.source, demos=demos.episodes, samples=len(demos.samples),
                           attempts=demos.attempts, dropped_steps=demos.dropped_steps, per_task=demos.per_task,
                           epochs=epochs, collect_s=demos.collect_s, train_s=time.monotonic() - t0)
