"""Run directories for the report tests, written through the real `RunDir` writer API with
`Trajectory`/`StepSample` records whose actions come from the real action grammar."""

from __future__ import annotations

from pathlib import Path

from asyncwebrl.controller.rundir import RunDir
from asyncwebrl.records import StepSample, Trajectory
from asyncwebrl.web.actions import parse_action

CHROMIUM = "/usr/lib/chromium/chromium-headless-shell"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-quic"]

PAGE_TEMPLATE = """<html><body style="margin:0;font:12px sans-serif;background:#fff">
<div style="background:#ff0;padding:4px;height:40px">{instr}</div>
<div style="padding:6px">{buttons}<br><input style="margin-top:8px;width:120px" value="{typed}"></div>
</body></html>"""


def _step(text: str, versions: list[int], reward: float = 0.0, executable: bool = True) -> StepSample:
    """A step whose action is what the real action grammar makes of `text`."""
    action = parse_action(text)
    n = len(versions)
    return StepSample(
        prompt_ids=list(range(40)), output_ids=list(range(100, 100 + n)),
        behave_logprobs=[-0.2 - 0.1 * i for i in range(n)], versions=versions, pixel_keys=[f"k{n}"],
        action_text=text, action=action, invalid=action is None or not executable, step_reward=reward,
    )


def episodes_spec() -> list[Trajectory]:
    """Six episodes over two tasks and three versions: successes, failures, invalid actions, a truncation."""
    return [
        Trajectory("ep-success-1", "miniwob/click-button", [_step("Click [30, 58]", [3, 3, 3], reward=1.0)],
                   reward=1.0, raw_reward=0.8, success=True, info={"instruction": "Click on the ONE button."}),
        Trajectory("ep-multi-2", "miniwob/enter-text", [
            _step("Click [60, 95]", [4, 4, 4]),
            _step("Type [60, 95] [hello]", [4, 4, 5, 5]),
            _step("Scroll [WINDOW] [down]", [5, 5]),
            _step("ANSWER [done]", [5], reward=1.0)],
            reward=1.0, raw_reward=0.7, success=True, info={"instruction": "Type 'hello' in the box."}),
        Trajectory("ep-invalid-3", "miniwob/click-button", [
            _step("I think I should press the second one", [4, 4, 4, 4, 4]),
            _step("click('9')", [4, 4], executable=False)],
            reward=-0.1, success=False, n_invalid=2, info={"instruction": "Click on the TWO button."}),
        Trajectory("ep-fail-4", "miniwob/click-button", [_step("mouse_click(80, 58)", [5, 5])],
                   reward=0.0, success=False, info={"instruction": "Click on the TWO button."}),
        Trajectory("ep-trunc-5", "miniwob/enter-text", [
            _step("Wait", [5]), _step("GoBack", [5]), _step("scroll(0, -200)", [5, 5])],
            reward=0.0, success=False, truncated=True, info={"instruction": "Type 'hello' in the box."}),
        Trajectory("ep-success-6", "miniwob/click-button", [_step("Click [30, 58]", [5, 5, 5], reward=1.0)],
                   reward=1.0, success=True, info={"instruction": "Click on the ONE button."}),
    ]


def write_run(root: Path, screenshots: list[bytes], n_steps: int = 12) -> RunDir:
    """A finished-looking run: config, train/eval metrics, an overlapping timeline, kept episodes."""
    rd = RunDir(root, keep_episodes=16, tensorboard=False)
    (root / "config.yaml").write_text("experiment_name: view-test\nrollout:\n  max_head_offpolicyness: 2\n")
    t = 0.0
    for step in range(n_steps):
        rd.t0 -= 6.0  # the clock of a run whose steps take about 6 s
        rd.log_phase(step, "rollout_wait", t, t + 1.0)
        rd.log_phase(step, "train", t + 1.0, t + 5.0)
        rd.log_phase(step, "weight_sync", t + 5.0, t + 5.4)
        if step % 4 == 3:
            rd.log_phase(step, "checkpoint", t + 5.4, t + 5.8)
            rd.log_phase(step, "eval", t + 5.8, t + 9.0)  # overlaps the next step: own test-rollout group
        rd.log_metrics("train", step, {
            "version": step + 1, "reward_mean": 0.2 + 0.05 * step, "success_rate": 0.25 + 0.05 * step,
            "clip_rate": 0.02, "clip_rate_coupled": 0.05, "approx_kl": 0.001 * step, "entropy": 1.5 - 0.05 * step,
            "grad_norm": 1.0, "loss": -0.01 * step, "behave_weight_mean": 1.0, "behave_weight_max": 2.5,
            "behave_weight_capped_frac": 0.0, "staleness_hist": {"0": 4, "1": 3, "2": 1}, "dropped_stale": step,
            "trajectories_per_s": 1.3, "tokens_per_s": 40.0, "trainer_idle_frac": 0.15, "rollout_idle_frac": 0.05,
            "weight_sync_s": 0.4, "step_time_s": 6.0, "pixel_fetch_s": 0.05,
        })
        rd.log_metrics("rollout", step, {"running": 8, "accepted": 8 * (step + 1), "pixelstore_mb": 12.5 + step})
        if step % 4 == 3:
            rd.log_metrics("eval", step, {"version": step + 1, "success_rate": 0.3 + 0.04 * step, "reward_mean": 0.3,
                                          "n_episodes": 20, "per_task": {"miniwob/click-button": 0.5,
                                                                         "miniwob/enter-text": 0.2}})
        t += 6.0
    for i, traj in enumerate(episodes_spec()):
        shots = [screenshots[(i + k) % len(screenshots)] for k in range(len(traj.steps))]
        rd.keep_episode(traj, traj.head_version, shots)
    rd.write_summary({"train_steps": n_steps, "final_success_rate": 0.8, "wall_time_s": 6.0 * n_steps})
    return rd
