"""Fixtures for the report tests: a real headless Chromium, real screenshots taken with it, and run
directories written through the real `RunDir` writer API with `Trajectory`/`StepSample` records."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncwebrl.controller.rundir import RunDir
from asyncwebrl.rollout.trajectory import StepSample, Trajectory

CHROMIUM = "/usr/lib/chromium/chromium-headless-shell"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-quic"]

_PAGE = """<html><body style="margin:0;font:12px sans-serif;background:#fff">
<div style="background:#ff0;padding:4px;height:40px">{instr}</div>
<div style="padding:6px">{buttons}<br><input style="margin-top:8px;width:120px" value="{typed}"></div>
</body></html>"""


@pytest.fixture(scope="session")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True, timeout=60_000)
        yield b
        b.close()


@pytest.fixture(scope="session")
def screenshots(browser) -> list[bytes]:
    """Four MiniWoB-sized (160x210) screenshots of a small task page, taken by Chromium."""
    page = browser.new_page(viewport={"width": 160, "height": 210})
    shots = []
    for i, instr in enumerate(["Click on the ONE button.", "Click on the TWO button.",
                               "Type 'hello' in the box.", "Scroll down and click submit."]):
        buttons = "".join(f'<button style="margin:3px">{w}</button>' for w in ("ONE", "TWO", "OK")[: 2 + i % 2])
        page.set_content(_PAGE.format(instr=instr, buttons=buttons, typed="hel" if i == 2 else ""))
        shots.append(page.screenshot(type="png"))
    page.close()
    return shots


def _step(text: str, action: dict | None, versions: list[int], reward: float = 0.0) -> StepSample:
    n = len(versions)
    return StepSample(
        prompt_ids=list(range(40)), output_ids=list(range(100, 100 + n)),
        behave_logprobs=[-0.2 - 0.1 * i for i in range(n)], versions=versions, pixel_keys=[f"k{n}"],
        action_text=text, action=action, invalid=action is None, step_reward=reward,
    )


def episodes_spec() -> list[Trajectory]:
    """Six episodes over two tasks and three versions: successes, failures, invalid actions, a truncation."""
    click = {"type": "click", "x": 30, "y": 58}
    return [
        Trajectory("ep-success-1", "miniwob/click-button", [
            _step("Click [30, 58]", click, [3, 3, 3], reward=1.0)], reward=1.0, raw_reward=0.8, success=True,
            info={"instruction": "Click on the ONE button."}),
        Trajectory("ep-multi-2", "miniwob/enter-text", [
            _step("Click [60, 95]", {"type": "click", "x": 60, "y": 95}, [4, 4, 4]),
            _step("Type [60, 95] [hello]", {"type": "type", "x": 60, "y": 95, "text": "hello"}, [4, 4, 5, 5]),
            _step("Scroll [WINDOW] [down]", {"type": "scroll", "direction": "down"}, [5, 5]),
            _step("ANSWER [done]", {"type": "answer", "text": "done"}, [5], reward=1.0)],
            reward=1.0, raw_reward=0.7, success=True, info={"instruction": "Type 'hello' in the box."}),
        Trajectory("ep-invalid-3", "miniwob/click-button", [
            _step("I think I should click the button", None, [4, 4, 4, 4, 4]),
            _step("Click [130, 58]", {"type": "click", "x": 130, "y": 58}, [4, 4])],
            reward=-0.1, success=False, n_invalid=1, info={"instruction": "Click on the TWO button."}),
        Trajectory("ep-fail-4", "miniwob/click-button", [
            _step("Click [80, 58]", {"type": "click", "x": 80, "y": 58}, [5, 5])],
            reward=0.0, success=False, info={"instruction": "Click on the TWO button."}),
        Trajectory("ep-trunc-5", "miniwob/enter-text", [
            _step("Wait", {"type": "wait"}, [5]), _step("GoBack", {"type": "goback"}, [5]),
            _step("mouse_click(500, 300)", {"type": "click", "x": 500, "y": 300, "normalized": True}, [5, 5])],
            reward=0.0, success=False, truncated=True, info={"instruction": "Type 'hello' in the box."}),
        Trajectory("ep-success-6", "miniwob/click-button", [
            _step("Click [30, 58]", click, [5, 5, 5], reward=1.0)], reward=1.0, success=True,
            info={"instruction": "Click on the ONE button."}),
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
            "weight_sync_s": 0.4, "step_time_s": 6.0,
        })
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
