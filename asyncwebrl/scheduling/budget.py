"""Thread budgets and priorities of the roles when they share CPU cores (issue 31).

On a machine without GPUs the trainer rank, the train-rollout server and the rollout workers (episode
loops and their Chromium processes) run on the same cores. Left alone, every role takes every core:
the trainer's intra-op threads then lose their time slices to page rendering and decoding, and a
step that took 14 s alone took 26 s beside rollout (bench/results/e2e.json before this module), so
the async pool lost to the synchronous one.

The budget keeps the trainer whole and lets rollout fill the cores' idle time:
- the trainer rank uses every core at normal priority (its step is the critical path once rollout
  runs ahead, eta >= 1);
- the embedded server decodes with a few threads (a quarter of the cores, at least one);
- the server and the rollout workers (and every process they start: Chromium, Playwright's driver)
  run at a lower priority (`niceness`), so the scheduler hands them the cores whenever the trainer
  waits (Python between kernels, pixel decoding, the weight refresh) and takes them back at once.

Two defaults worked against this and are undone here: Ray starts every worker process at niceness 15
(its `worker_niceness`), the trainer rank included, below the driver; and Chromium, when it runs as
root, raises its own browser and GPU-process threads to niceness -8 and 0 (seen here: the trainer at
15, the browser's main threads at -8). A private Ray instance starts its workers at 0
(`ray_scheduler.init_ray`), and a rollout thread drops CAP_SYS_NICE from its capability bounding set,
so nothing it starts can raise itself above the trainer.

Invariant: a budget never changes what is computed, only who gets a core first; every number can be
overridden (actor.cpu_threads, inference.cpu_threads, scheduler.rollout_niceness). With GPUs the
roles do not share cores' work in this way and the budget leaves everything as the config says.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass

log = logging.getLogger(__name__)

AUTO_ROLLOUT_NICENESS = 10
"""niceness of rollout roles beside a CPU trainer: a nice-10 thread gets ~10% of a core a nice-0
thread wants (Linux CFS weights 110 vs 1024), so rollout keeps moving but never stalls a step"""


@dataclass(frozen=True)
class CoreBudget:
    """Threads and priorities of each role on this machine (see the module docstring)."""

    cores: int
    shared: bool
    """roles share the CPU cores (no GPUs): the budget applies"""
    trainer_threads: int | None
    """torch intra-op threads of a CPU trainer rank (None = leave torch's default: a GPU trainer)"""
    server_threads: int
    """torch threads of an embedded CPU inference server (0 = the server's own default)"""
    rollout_niceness: int
    """niceness of inference servers and rollout workers (0 = normal priority)"""


def core_budget(cfg, cores: int | None = None) -> CoreBudget:
    """The budget of a RunConfig on a machine with `cores` cores (default: this machine's)."""
    cores = cores or os.cpu_count() or 1
    shared = cfg.cluster.n_gpus_per_node == 0
    if not shared:
        return CoreBudget(cores=cores, shared=False, trainer_threads=None,
                          server_threads=cfg.inference.cpu_threads,
                          rollout_niceness=max(0, cfg.scheduler.rollout_niceness or 0))
    nice = cfg.scheduler.rollout_niceness
    return CoreBudget(
        cores=cores, shared=True,
        trainer_threads=cfg.actor.cpu_threads or cores,
        server_threads=cfg.inference.cpu_threads or max(1, cores // 4),
        rollout_niceness=AUTO_ROLLOUT_NICENESS if nice is None else nice,
    )


def lower_priority(niceness: int, whole_process: bool) -> None:
    """Run at `niceness` from now on: this thread (and whatever it starts), or every thread of this
    process. Linux keeps a niceness per thread and new threads and children inherit their creator's,
    so renicing the threads that exist covers everything started later. Never raises: a priority is
    an optimisation, and a platform without per-thread niceness keeps the default."""
    if niceness <= 0:
        return
    try:
        if whole_process and os.path.isdir("/proc/self/task"):
            tids = [int(t) for t in os.listdir("/proc/self/task")]
        else:
            tids = [threading.get_native_id()]
        for tid in tids:
            try:
                if os.getpriority(os.PRIO_PROCESS, tid) < niceness:
                    os.setpriority(os.PRIO_PROCESS, tid, niceness)
            except ProcessLookupError:  # a thread that ended meanwhile
                pass
    except (OSError, AttributeError) as e:
        log.warning("could not lower the priority of rollout to niceness %d: %r", niceness, e)
    _drop_cap_sys_nice()


PR_CAPBSET_DROP, CAP_SYS_NICE = 24, 23


def _drop_cap_sys_nice() -> None:
    """Programs this thread starts from now on cannot raise their priority (Chromium does, as root).
    A no-op where the thread may not change its capabilities (an ordinary user: nothing to drop)."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_CAPBSET_DROP, CAP_SYS_NICE, 0, 0, 0)
    except (OSError, AttributeError):
        pass


class NicedEnvFactory:
    """Picklable env factory of the rollout workers: lowers the calling worker's priority (the whole
    worker process under Ray, only the executor's thread when it shares the trainer's process), then
    makes the env, so the browser it launches inherits the priority."""

    def __init__(self, niceness: int, whole_process: bool):
        self.niceness, self.whole_process = niceness, whole_process

    def __call__(self, env_cfg):
        from asyncwebrl.web.env_factory import make_env

        lower_priority(self.niceness, self.whole_process)
        return make_env(env_cfg)
