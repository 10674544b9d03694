"""Cores shared by every role (no GPU): the trainer keeps every core at normal priority, the server
decodes with a quarter of them, and rollout (with every process it starts, such as a browser) runs at a
lower priority; each number can be overridden, and with GPUs nothing changes."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

from asyncwebrl.config import load_run_config
from asyncwebrl.scheduling.budget import AUTO_ROLLOUT_NICENESS, core_budget, lower_priority


def test_budget_from_the_core_count_and_its_overrides():
    cfg = load_run_config(None, [])
    b = core_budget(cfg, cores=8)
    assert (b.shared, b.trainer_threads, b.server_threads, b.rollout_niceness) == (True, 8, 2, AUTO_ROLLOUT_NICENESS)
    assert core_budget(cfg, cores=2).server_threads == 1
    over = load_run_config(None, ["actor.cpu_threads=3", "inference.cpu_threads=4", "scheduler.rollout_niceness=0"])
    b = core_budget(over, cores=8)
    assert (b.trainer_threads, b.server_threads, b.rollout_niceness) == (3, 4, 0)
    gpu = core_budget(load_run_config(None, ["cluster.n_gpus_per_node=2", "allocation_mode=hf[rollout]:d1+fsdp[actor]:d1",
                                             "test_rollout.enabled=false"]), cores=8)
    assert not gpu.shared and gpu.trainer_threads is None and gpu.rollout_niceness == 0


def _nice_of(pid: int) -> int:
    return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[16])


def test_lowered_thread_and_what_it_starts_run_below_the_trainer():
    seen = {}

    def rollout_thread():
        lower_priority(7, whole_process=False)
        child = subprocess.Popen(["sleep", "5"])  # a browser started by an episode loop
        seen["child"] = _nice_of(child.pid)
        seen["thread"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        child.kill()
        child.wait()

    t = threading.Thread(target=rollout_thread)
    t.start()
    t.join()
    assert seen == {"child": 7, "thread": 7}
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == 0  # the trainer's thread keeps its priority


def test_what_a_rollout_thread_starts_cannot_raise_its_priority():
    """Chromium raises its own threads to niceness -8 when it may (as root): not from a rollout thread."""
    seen = {}

    def rollout_thread():
        lower_priority(5, whole_process=False)
        probe = "import os\ntry:\n    os.setpriority(os.PRIO_PROCESS, 0, -5)\n    print('raised')\nexcept OSError:\n    print('refused')"
        seen["out"] = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout.strip()

    t = threading.Thread(target=rollout_thread)
    t.start()
    t.join()
    assert seen["out"] == "refused"
