"""The report's parts without a browser: action marks on screenshots, run loading, plots."""

from __future__ import annotations

import io
import json

import pytest
from PIL import Image

from asyncwebrl.controller.rundir import RunDir
from asyncwebrl.view.annotate import action_mark, draw_action
from asyncwebrl.view.episodes import safe_name, versions_summary
from asyncwebrl.view.plots import PLOTS, render_plots, staleness_counts
from asyncwebrl.view.report import build_report
from asyncwebrl.view.rundata import RunDirError, load_run
from asyncwebrl.web.actions import parse_action


def _white_png(w: int = 160, h: int = 210) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (w, h), "white").save(out, format="PNG")
    return out.getvalue()


def _reddish(px: tuple[int, ...]) -> bool:
    return px[0] > 180 and px[1] < 100 and px[2] < 120


def test_click_marker_lands_on_the_clicked_pixel():
    png = draw_action(_white_png(), parse_action("Click [40, 100]"), invalid=False)
    img = Image.open(io.BytesIO(png)).convert("RGB")
    scale = 480 / 160
    banner = img.height - round(210 * scale)
    assert img.width == 480 and banner > 0  # enlarged, caption strip above the screenshot
    cx, cy = round(40 * scale), banner + round(100 * scale)
    assert _reddish(img.getpixel((cx, cy)))  # the centre dot
    assert img.getpixel((cx + 60, cy + 60)) == (255, 255, 255)  # nothing drawn far from the point
    # the screenshot itself is unchanged away from the mark
    assert img.getpixel((5, img.height - 5)) == (255, 255, 255)


def test_normalized_coordinates_follow_the_run_coord_mode():
    action = parse_action("Click [500, 500]")
    pix = action_mark(action, False, (160, 210), "pixel")
    norm = action_mark(action, False, (160, 210), "norm1000")
    assert pix.point == (500.0, 500.0)
    assert norm.point == pytest.approx((80.0, 105.0))


@pytest.mark.parametrize("text, kind, extra", [
    ("Type [10, 20] [hello]", "type", {"text": "hello"}),
    ("fill('4', 'abc')", "type", {"label": "#4", "text": "abc"}),
    ("click('12')", "click", {"label": "#12", "point": None}),
    ("Scroll [WINDOW] [up]", "scroll", {"direction": "up"}),
    ("scroll(0, 300)", "scroll", {"direction": "down"}),
    ("GoBack", "goback", {}),
    ("Wait", "wait", {}),
    ("ANSWER [42]", "answer", {"text": "42"}),
    ("I do not know", "invalid", {}),
])
def test_every_action_of_the_grammar_gets_a_mark(text, kind, extra):
    action = parse_action(text)
    mark = action_mark(action, action is None, (160, 210))
    assert mark.kind == kind
    for k, v in extra.items():
        assert getattr(mark, k) == v
    png = draw_action(_white_png(), action, action is None)
    assert png is not None and Image.open(io.BytesIO(png)).width == 480


@pytest.mark.parametrize("action", [{}, {"type": 3}, {"type": "click", "x": "left", "y": None},
                                    {"type": "click", "x": 1e30, "y": -1e30}, {"type": "scroll", "dx": "a"},
                                    {"type": "type", "element": {"nested": [1]}, "text": "x" * 10_000}])
def test_malformed_actions_draw_without_raising(action):
    assert draw_action(_white_png(), action, invalid=False) is not None


def test_unreadable_screenshot_is_none_not_an_exception():
    assert draw_action(b"not an image", {"type": "click", "x": 1, "y": 1}, False) is None
    assert draw_action(_white_png()[:50], {"type": "wait"}, False) is None


def test_versions_summary_flags_generation_across_a_weight_update():
    assert versions_summary([3, 3, 3]) == "v3 x3"
    assert versions_summary([3, 3, 4]).startswith("v3 x2, v4 x1 (2 versions")
    assert versions_summary([]) == "no generated tokens"
    assert versions_summary(None) == "no generated tokens"


def test_traj_ids_cannot_escape_the_report_folder():
    assert "/" not in safe_name("../../etc/passwd") and not safe_name("../x").startswith(".")
    assert safe_name("").startswith("episode")
    assert safe_name("a/b") != safe_name("a_b") and safe_name("ep-1") == "ep-1"


def test_bad_run_dir_is_a_clear_error(tmp_path):
    with pytest.raises(RunDirError, match="does not exist"):
        load_run(tmp_path / "nope")
    f = tmp_path / "metrics.jsonl"
    f.write_text("{}\n")
    with pytest.raises(RunDirError, match="not a directory"):
        load_run(f)


def test_staleness_histograms_are_summed_over_steps(tmp_path):
    rd = RunDir(tmp_path, tensorboard=False)
    rd.log_metrics("train", 0, {"staleness_hist": {"0": 2, "1": 1}})
    rd.log_metrics("train", 1, {"staleness_hist": {0: 1, "2": 4, "bad": 9}})
    rd.log_metrics("train", 2, {"staleness_hist": "not a dict"})
    rd.close()
    assert staleness_counts(load_run(tmp_path)) == {0: 3.0, 1: 1.0, 2: 4.0}


def test_plots_skip_missing_metrics_and_draw_present_ones(tmp_path):
    rd = RunDir(tmp_path / "run", tensorboard=False)
    rd.log_metrics("train", 0, {"reward_mean": 0.5, "loss": float("nan"), "entropy": True, "new_metric": 2.0})
    rd.close()
    results = {p.key: p for p in render_plots(load_run(tmp_path / "run"), tmp_path / "plots")}
    assert set(results) == {k for k, _, _ in PLOTS}
    assert results["learning_step"].file == "learning_step.png"
    assert (tmp_path / "plots" / "learning_step.png").stat().st_size > 1000
    assert results["other_train"].file == "other_train.png"  # a metric the viewer does not know is still shown
    for key in ("eval_version", "clip_rates", "staleness", "idle", "weight_sync", "timeline", "optimisation",
                "rollout_pool"):
        assert results[key].file is None and results[key].note == "no data yet", key


def test_weight_sync_plot_falls_back_to_the_timeline(tmp_path):
    rd = RunDir(tmp_path / "run", tensorboard=False)
    for s in range(3):
        rd.log_phase(s, "weight_sync", 10.0 * s, 10.0 * s + 0.25)
    rd.close()
    ws = {p.key: p for p in render_plots(load_run(tmp_path / "run"), tmp_path / "plots")}["weight_sync"]
    assert ws.file and "median 0.250 s" in ws.note and "timeline" in ws.note


def test_rebuild_drops_evicted_episodes_and_escapes_html(tmp_path):
    from view_fixtures import episodes_spec

    rd = RunDir(tmp_path, keep_episodes=8, tensorboard=False)
    eps = episodes_spec()
    eps[0].steps[0].action_text = "</script><script>alert(1)</script>"
    for traj in eps[:2]:
        rd.keep_episode(traj, traj.head_version, [_white_png()] * len(traj.steps))
    rd.close()
    res = build_report(tmp_path)
    assert (tmp_path / "report" / "episodes" / "ep-success-1").is_dir()
    html = res.index.read_text()
    assert "</script><script>alert(1)" not in html
    payload = html.split('<script id="episode-data" type="application/json">')[1].split("</script>")[0]
    texts = [s["action_text"] for e in json.loads(payload)["episodes"] for s in e["steps"]]
    assert "</script><script>alert(1)</script>" in texts  # the page still shows the exact output

    # A rebuild reuses the annotated copies it already made (reports are rebuilt while a run goes on).
    shots = sorted((tmp_path / "report" / "episodes").rglob("*.png"))
    stamps = [p.stat().st_mtime_ns for p in shots]
    build_report(tmp_path)
    assert sorted((tmp_path / "report" / "episodes").rglob("*.png")) == shots
    assert [p.stat().st_mtime_ns for p in shots] == stamps

    # The run evicts the episode (reservoir sampling); the next report must not show it any more.
    import shutil

    shutil.rmtree(tmp_path / "episodes" / "ep-success-1")
    index = tmp_path / "episodes" / "index.jsonl"
    index.write_text("".join(line + "\n" for line in index.read_text().splitlines() if "ep-success-1" not in line))
    res = build_report(tmp_path)
    assert res.n_episodes == 1
    assert not (tmp_path / "report" / "episodes" / "ep-success-1").exists()


def test_report_shows_task_sampling_and_heldout_per_task(tmp_path):
    from asyncwebrl.records import RolloutGroup, StepSample, Trajectory
    from asyncwebrl.rollout.curriculum import TaskCurriculum
    from asyncwebrl.web.config import TaskSamplingConfig

    cur = TaskCurriculum(["miniwob/click-test", "miniwob/click-button"], TaskSamplingConfig(mode="adaptive", prior="eval"))
    steps = [StepSample(prompt_ids=[1], output_ids=[2], behave_logprobs=[-0.1], versions=[0])]
    cur.observe_eval({"miniwob/click-test": 0.75})
    cur.observe([RolloutGroup("g1", "miniwob/click-button#3", [
        Trajectory(f"t{i}", "miniwob/click-button#3", steps, reward=float(i % 2), success=bool(i % 2)) for i in range(4)])])
    rd = RunDir(tmp_path, keep_episodes=0, tensorboard=False)
    rd.log_metrics("curriculum", 1, cur.record().flat())
    rd.log_metrics("eval", 1, {"version": 1, "success_rate": 0.5, "per_task": {"miniwob/click-test": 0.5},
                               "heldout_per_task": {"miniwob/click-link": 0.25}})
    rd.close()
    html = build_report(tmp_path).index.read_text()
    table = html.split('id="task-sampling"')[1].split("</table>")[0]
    assert "miniwob/click-button" in table and "0.5" in table and "not seen" in table  # click-test unobserved
    row = table.split("miniwob/click-test")[1].split("</tr>")[0]
    assert "0.75" in row  # ... but its evaluation prior is shown
    held = html.split('id="eval-heldout"')[1].split("</table>")[0]
    assert "miniwob/click-link" in held and "0.25" in held
