"""Fault injection during real training runs (`pytest -m faults`): real Chromium + MiniWoB++, embedded
inference servers, the FSDP trainer, the PixelStore. Each fault is injected into a running system and
the run must finish with nothing lost and nothing duplicated, and the damage must show in the run's
typed statistics (failed episodes counted, never silently lost). Nothing is written to bench/results.

Faults: (1) the Chromium process killed mid-episode, (2) the PixelStore Ray actor killed, (3) one of
two inference servers killed (restart + weight-group rejoin), all in one Ray run; (4) the whole
`asyncwebrl train` process SIGKILLed after a checkpoint, then `recover=auto`; (5) a checkpoint write
killed half way.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from asyncwebrl.config import load_run_config
from asyncwebrl.controller.main import Controller
from asyncwebrl.controller.rundir import RunDir, read_jsonl
from asyncwebrl.controller.system import build_system
from asyncwebrl.web.browser import browser_root_pids

pytestmark = [pytest.mark.slow, pytest.mark.browser, pytest.mark.faults]

SMALL = ["rollout.consumer_batch_size=1", "gconfig.n_samples=2", "env.max_steps=2",
         "env.tasks=click-test,click-button", "stats.progress_bar=false", "actor.mb_max_tokens=2048",
         "gconfig.max_new_tokens=8", "test_rollout.enabled=false"]
REPO = Path(__file__).resolve().parents[2]


def _get(url: str, key: str | None = None) -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30) as r:
        return json.loads(r.read())


def _browser_pids(headless_shell: str) -> set[int]:
    return set(browser_root_pids(headless_shell))


def _wait_for(pred, timeout_s: float, poll_s: float = 0.2) -> float | None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if pred():
            return time.monotonic() - t0
        time.sleep(poll_s)
    return None


def _in_flight(rollout) -> int:
    """Rollouts admitted and not yet finished, over all workers."""
    return rollout.stats().in_flight


class Injector:
    """Step hooks that kill one component at a chosen step and time its recovery on a side thread."""

    def __init__(self, system, cfg):
        self.sys, self.cfg = system, cfg
        self.figures: dict[str, dict] = {}
        self.threads: list[threading.Thread] = []

    def __call__(self, ctl: Controller) -> None:
        step = ctl.state.step
        if step == 1:
            self.kill_browser(ctl)
        elif step == 2:
            self.kill_pixel_store(ctl)
        elif step == 3:
            self.kill_server(ctl)

    def _watch(self, fn) -> None:
        t = threading.Thread(target=fn, daemon=True)
        t.start()
        self.threads.append(t)

    def kill_browser(self, ctl: Controller) -> None:
        shell = self.cfg.env.headless_shell
        rollout = ctl.sys.rollout
        consumed = rollout.stats().consumed_groups
        fig = self.figures["browser_kill"] = {}

        def kill_and_watch():
            # mid-episode: once this step's prepare_batch took its group, admission opens and new
            # episodes start (the trainer trains meanwhile); kill the browser a moment into them
            assert _wait_for(lambda: rollout.stats().consumed_groups > consumed, 300, 0.2) is not None
            assert _wait_for(lambda: _in_flight(rollout) > 0, 300, 0.1) is not None
            time.sleep(1.0)
            in_flight = _in_flight(rollout)
            before = _browser_pids(shell)
            st0 = rollout.stats()
            fig["failed_before"] = (st0.failed_episodes, st0.failed_rollouts)
            for pid in before:
                os.kill(pid, signal.SIGKILL)
            fig["killed_pids"] = len(before)
            back = _wait_for(lambda: _browser_pids(shell) - before, 180)
            fig["recovery_s"] = back
            fig["relaunched"] = back is not None and len(before) > 0
            fig["in_flight_at_kill"] = in_flight

        self._watch(kill_and_watch)

    def kill_pixel_store(self, ctl: Controller) -> None:
        import ray

        names = [n for n in ray.util.list_named_actors() if str(n).startswith("awrl-pixelstore-")]
        assert names, "no PixelStore actor to kill"
        handle = ray.get_actor(names[0])
        st0 = ctl.sys.rollout.stats()
        self.failed_at_store_kill = (st0.failed_episodes, st0.failed_rollouts)
        before = ray.get(handle.stats.remote(), timeout=30)
        ray.kill(handle, no_restart=False)
        fig = self.figures["pixelstore_kill"] = {"keys_before": before["items"]}

        def answers() -> bool:
            # the restarted actor answers, and is a new one (its counters started again from zero)
            try:
                return ray.get(handle.stats.remote(), timeout=5)["puts"] < before["puts"]
            except Exception:
                return False

        def watch():
            fig["recovery_s"] = _wait_for(answers, 120, 0.5)
            fig["restarted"] = fig["recovery_s"] is not None

        self._watch(watch)

    def kill_server(self, ctl: Controller) -> None:
        import ray

        h = ctl.sys.server_handles[1]
        pid = ray.get(h.pid.remote(), timeout=30)
        os.killpg(pid, signal.SIGKILL)
        self.figures["server_kill"] = {"address": ctl.sys.server_addresses[1], "killed_at_step": ctl.state.step}


def test_browser_pixelstore_and_server_die_during_training(tmp_path):
    steps = 5
    cfg = load_run_config(None, [
        f"cluster.fileroot={tmp_path}", f"total_train_steps={steps}", *SMALL,
        "allocation_mode=hf[rollout]:d2+fsdp[actor]:d1", "rollout.restart_dead_servers=true",
        "checkpoint.every_n_steps=100", "rollout.request_timeout_s=60", "rollout.max_retries=1",
    ])
    run = RunDir(cfg.run_dir, keep_episodes=0)
    system = build_system(cfg, run)
    try:
        ctl = Controller(cfg, system, run)
        inj = Injector(system, cfg)
        ctl.step_hooks.append(inj)
        summary = ctl.train()
        for t in inj.threads:
            t.join(200)
        stats = system.rollout.stats()
        train = [r for r in read_jsonl(run.root / "metrics.jsonl") if r["kind"] == "train"]

        # the run completed, every step's version in order, nothing lost or duplicated
        assert summary.steps == steps and summary.version == steps
        assert [r["version"] for r in train] == list(range(1, steps + 1))
        assert summary.duplicates == 0 and stats.lost_rollouts == 0
        assert stats.consumed_groups == steps * cfg.rollout.consumer_batch_size
        assert all(max(map(int, r["staleness_hist"] or {"0": 0})) <= cfg.rollout.max_head_offpolicyness
                   for r in train)

        # (1) the browser came back; the episodes it killed are reported failed, never silently lost:
        # in the statistics at the time, and in the run summary a user reads
        b = inj.figures["browser_kill"]
        assert b["relaunched"], b
        (fe0, _), (fe1, _) = b.pop("failed_before"), inj.failed_at_store_kill
        assert fe1 - fe0 >= 1, b
        assert summary.failed_episodes >= fe1 - fe0 >= 1, summary
        # (2) the PixelStore actor restarted; samples whose pixels died with it were dropped and counted
        p = inj.figures["pixelstore_kill"]
        assert p["restarted"], p
        # (3) the dead server was noticed, restarted on its address and rejoined the weight group:
        # both servers serve the final weights, bit-identical
        events = ctl.supervisor.events
        assert [e.action for e in events] == ["restarted"], ctl.supervisor.figures()
        sums = {a: _get(a + "/weights_checksum", system.api_key) for a in system.server_addresses}
        assert {v["weight_version"] for v in sums.values()} == {str(steps)}, sums
        assert len({v["sha256"] for v in sums.values()}) == 1, sums

    finally:
        system.shutdown()
        run.close()


def _train_cmd(tmp_path: Path, steps: int, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "asyncwebrl.cli", "train", f"cluster.fileroot={tmp_path}",
            f"total_train_steps={steps}", *SMALL, "scheduler.type=local", "checkpoint.every_n_steps=1",
            "checkpoint.keep_last=3", "rollout.max_head_offpolicyness=1", *extra]


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the train process and everything it started (as a dead host would take them down)."""
    try:
        kids = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        kids = []
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    for k in kids:
        try:
            k.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(kids, timeout=30)


def test_sigkilled_trainer_resumes_from_newest_complete_checkpoint(tmp_path):
    from asyncwebrl.training.checkpoint import complete_checkpoints

    steps = 4
    cmd = _train_cmd(tmp_path, steps, ["recover=auto", "env.task_sampling.mode=adaptive"])
    log1 = open(tmp_path / "first.log", "wb")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log1, stderr=subprocess.STDOUT)
    try:
        cfg = load_run_config(None, cmd[4:])
        ckroot = Path(cfg.run_dir) / "checkpoints"
        # wait for the first complete checkpoint, then SIGKILL the whole trainer process tree
        got = _wait_for(lambda: len(complete_checkpoints(ckroot)) >= 1 or proc.poll() is not None, 480, 0.1)
        assert got is not None and proc.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
        _kill_tree(proc)
    finally:
        if proc.poll() is None:
            _kill_tree(proc)
    newest = complete_checkpoints(ckroot)[-1]
    want_version = json.loads((newest / "trainer_state.json").read_text())["version"]
    assert want_version < steps

    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=480)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    records = read_jsonl(Path(cfg.run_dir) / "metrics.jsonl")
    resume = [r for r in records if r["kind"] == "resume"]
    assert resume and resume[-1]["version"] == want_version
    last_resume = max(i for i, r in enumerate(records) if r["kind"] == "resume")
    after = [r for r in records[last_resume:] if r["kind"] == "train"]
    # the version numbering continues from the checkpoint, and staleness never exceeds eta after resume
    assert [r["version"] for r in after] == list(range(want_version + 1, steps + 1))
    assert all(max(map(int, r["staleness_hist"] or {"0": 0})) <= 1 for r in after), [r["staleness_hist"] for r in after]
    assert all(r["duplicates"] == 0 for r in after)
    # the adaptive task tracker came back from the checkpoint: its group count continues, not restarts
    batch = cfg.rollout.consumer_batch_size
    cur_after = [r for r in records[last_resume:] if r["kind"] == "curriculum"]
    assert sum(v for k, v in cur_after[0].items() if k.startswith("groups.")) == (want_version + 1) * batch
    final = json.loads((complete_checkpoints(ckroot)[-1] / "trainer_state.json").read_text())
    assert final["version"] == steps


WRITER = """
import sys, time, torch
from asyncwebrl.training.checkpoint import write_checkpoint
root, version = sys.argv[1], int(sys.argv[2])
state = {"w": torch.full((64, 1024, 1024), float(version))}  # 256 MiB: a write that takes a while
print("writing", flush=True)
write_checkpoint(root, version, version, state, None, optim_state={"m": state["w"].clone()})
print("done", flush=True)
"""


def test_kill_during_checkpoint_write_keeps_previous_usable(tmp_path):
    from safetensors.torch import load_file

    from asyncwebrl.training.checkpoint import latest_complete_checkpoint, write_checkpoint

    root = tmp_path / "checkpoints"
    import torch

    write_checkpoint(root, 1, 1, {"w": torch.ones(4, 4)}, None, extra_state={"task_sampler": {"seed": 1}})
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(root), "2"], cwd=REPO, stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline().strip() == b"writing"
        # kill once the temp folder exists and holds part of the data
        seen = _wait_for(lambda: any(p.name.startswith(".tmp-") and any(p.iterdir()) for p in root.iterdir()), 60, 0.01)
        assert seen is not None and proc.poll() is None, "the write finished before the kill"
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    ckpt = latest_complete_checkpoint(root)
    assert ckpt is not None and ckpt.name.endswith("1")
    assert json.loads((ckpt / "trainer_state.json").read_text())["version"] == 1
    assert torch.equal(load_file(str(ckpt / "model.safetensors"))["w"], torch.ones(4, 4))
    # the next write succeeds and clears the half-written leftover
    write_checkpoint(root, 3, 3, {"w": torch.zeros(2)}, None, keep_last=1)
    assert latest_complete_checkpoint(root).name.endswith("3")
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp-")]
