"""The report as a user sees it: opened in real headless Chromium, stepping through episodes,
filtering them, and looking at the plots. A full-page screenshot is kept in the test's temp folder."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest
from PIL import Image
from view_fixtures import episodes_spec, write_run

from asyncwebrl.controller.rundir import RunDir
from asyncwebrl.records import Trajectory
from asyncwebrl.view.report import build_report

pytestmark = pytest.mark.browser

MAX_ARTIFACT_BYTES = 300_000


def _open(browser, index: Path):
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.goto(index.as_uri())
    return page, errors


def _rows(page) -> list[str]:
    return page.locator("#episode-rows tr").evaluate_all("rs => rs.map(r => r.dataset.traj)")


def _step_image_loaded(page) -> None:
    page.wait_for_function("() => { const i = document.getElementById('step-img');"
                           " return i.complete && i.naturalWidth > 0; }", timeout=10_000)


def _small_png(png: bytes, limit: int) -> bytes:
    """The page screenshot as a palette PNG, shrunk until it fits under `limit` bytes."""
    img = Image.open(io.BytesIO(png)).convert("RGB")
    while True:
        out = io.BytesIO()
        img.quantize(colors=128).save(out, format="PNG", optimize=True)
        if out.tell() < limit or img.width < 400:
            return out.getvalue()
        img = img.resize((int(img.width * 0.8), int(img.height * 0.8)), Image.LANCZOS)


def test_episode_browser_steps_filters_and_plots(tmp_path, browser, screenshots):
    run = tmp_path / "run"
    write_run(run, screenshots).close()
    res = build_report(run)
    assert res.n_episodes == 6 and res.n_plots == 12
    page, errors = _open(browser, res.index)

    assert len(_rows(page)) == 6
    assert page.inner_text("#episode-count") == "6 of 6 episodes"

    # Step through the four-step episode with the buttons and the keyboard.
    page.locator('#episode-rows tr[data-traj="ep-multi-2"]').click()
    assert page.inner_text("#step-counter") == "Step 1 / 4"
    assert page.inner_text("#step-action-text") == "Click [60, 95]"
    assert page.is_disabled("#prev-step")
    _step_image_loaded(page)
    first_src = page.get_attribute("#step-img", "src")

    page.click("#next-step")
    assert page.inner_text("#step-counter") == "Step 2 / 4"
    assert page.inner_text("#step-action-text") == "Type [60, 95] [hello]"
    assert json.loads(page.inner_text("#step-parse")) == {"type": "type", "x": 60.0, "y": 95.0, "text": "hello"}
    assert "v4 x2, v5 x2" in page.inner_text("#step-versions")
    assert "spanned a weight update" in page.inner_text("#step-versions")
    assert "mean -0.350" in page.inner_text("#step-logprob")
    _step_image_loaded(page)
    assert page.get_attribute("#step-img", "src") != first_src

    page.click("#next-step")
    page.click("#next-step")
    assert page.inner_text("#step-counter") == "Step 4 / 4"
    assert page.inner_text("#step-reward") == "1.000"
    assert page.is_disabled("#next-step")
    page.keyboard.press("ArrowLeft")
    assert page.inner_text("#step-counter") == "Step 3 / 4"
    assert page.inner_text("#step-action-text") == "Scroll [WINDOW] [down]"

    # Filter by outcome: only successes, then only episodes with invalid actions.
    page.select_option("#filter-outcome", "success")
    assert sorted(_rows(page)) == ["ep-multi-2", "ep-success-1", "ep-success-6"]
    assert set(page.locator("#episode-rows .badge").all_inner_texts()) == {"success"}
    page.select_option("#filter-outcome", "invalid")
    assert _rows(page) == ["ep-invalid-3"]
    assert page.inner_text("#ep-title").endswith("ep-invalid-3")  # the viewer follows the filter
    assert page.inner_text("#step-parse").startswith("INVALID (did not parse)")
    page.click("#next-step")
    assert "not executable" in page.inner_text("#step-parse")
    page.select_option("#filter-outcome", "failure")
    assert sorted(_rows(page)) == ["ep-fail-4", "ep-invalid-3", "ep-trunc-5"]

    # Task and version filters combine; no match shows the placeholder instead of a stale episode.
    page.select_option("#filter-outcome", "all")
    page.select_option("#filter-task", "miniwob/enter-text")
    page.select_option("#filter-version", "5")
    assert _rows(page) == ["ep-trunc-5"]
    page.select_option("#filter-version", "3")
    assert _rows(page) == []
    assert page.is_visible("#viewer-empty") and not page.is_visible("#viewer-body")
    page.select_option("#filter-task", "all")
    page.select_option("#filter-version", "all")
    page.locator('#episode-rows tr[data-traj="ep-multi-2"]').click()
    _step_image_loaded(page)

    # Every plot image loaded, and each figure the run logged is drawn rather than a placeholder.
    widths = page.locator("#training img, #timeline img").evaluate_all("is => is.map(i => i.naturalWidth)")
    assert len(widths) == 12 and min(widths) > 0
    assert page.locator("#training .placeholder, #timeline .placeholder").count() == 0
    assert "mean decoupled / coupled clip rate" in page.inner_text("#plot-clip_rates")
    assert page.locator("#phase-totals tbody tr").count() == 5  # rollout_wait, train, weight_sync, eval, checkpoint
    assert "0.5" in page.inner_text("#eval-per-task")

    png = page.screenshot(full_page=True)
    (tmp_path / "view_report_full.png").write_bytes(png)
    small = _small_png(png, MAX_ARTIFACT_BYTES)
    assert len(small) < MAX_ARTIFACT_BYTES
    (tmp_path / "view_report.png").write_bytes(small)
    assert errors == []
    page.close()


def test_empty_run_dir_renders_placeholders(tmp_path, browser):
    run = tmp_path / "killed-before-first-step"
    run.mkdir()
    res = build_report(run)
    assert res.n_episodes == 0 and res.n_plots == 0
    page, errors = _open(browser, res.index)
    assert "no data yet" in page.inner_text("#overview")
    assert "no episodes kept yet" in page.inner_text("#episodes")
    assert page.locator("#training .placeholder").count() == 11
    assert page.locator("#timeline .placeholder").count() == 1
    assert page.locator("img").count() == 0
    assert errors == []
    page.close()


def test_partial_and_damaged_run_still_renders(tmp_path, browser, screenshots):
    """A run killed mid-write: torn JSON lines, an evicted episode folder, a broken screenshot."""
    run = tmp_path / "run"
    rd = RunDir(run, keep_episodes=8, tensorboard=False)
    rd.log_metrics("train", 0, {"reward_mean": 0.1, "success_rate": 0.2, "staleness_hist": {"0": 3, "x": 1}})
    rd.log_metrics("train", 1, {"reward_mean": "nan?", "success_rate": 0.3})
    rd.log_phase(0, "train", 0.0, 2.0)
    eps = episodes_spec()
    for traj in eps[:3]:
        rd.keep_episode(traj, traj.head_version, screenshots[: len(traj.steps)])
    rd.keep_episode(Trajectory("ep-crashed", "miniwob/click-button", [], reward=0.0, failed=True), -1, [])
    rd.close()
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "step": 2, "rew')  # torn last line
    with open(run / "timeline.jsonl", "a") as f:
        f.write('{"step": 1, "phase": "train", "start": 5.0, "end": 1.0}\n{"phase": 3}\n')
    shutil.rmtree(run / "episodes" / "ep-success-1")  # evicted between index write and our read
    (run / "episodes" / "ep-multi-2" / "step_1.png").write_bytes(b"not a png")
    (run / "episodes" / "ep-multi-2" / "step_2.png").unlink()

    res = build_report(run)
    assert res.n_episodes == 3
    page, errors = _open(browser, res.index)
    problems = page.inner_text("#overview .problems")
    assert "ep-success-1" in problems and "timeline.jsonl: 2 malformed" in problems
    assert page.locator("#plot-learning_step img").count() == 1
    assert "no data yet" in page.inner_text("#plot-eval_version")
    page.locator('#episode-rows tr[data-traj="ep-multi-2"]').click()
    page.click("#next-step")
    assert page.inner_text("#step-counter") == "Step 2 / 4"
    assert "not a readable image" in page.inner_text("#step-noimg")
    assert not page.is_visible("#step-img")
    page.click("#next-step")
    assert "missing from the run directory" in page.inner_text("#step-noimg")
    page.click("#next-step")
    _step_image_loaded(page)
    page.select_option("#filter-outcome", "crashed")  # a browser crash before the first step
    assert _rows(page) == ["ep-crashed"]
    assert page.inner_text("#step-counter") == "Step 0 / 0"
    assert page.is_disabled("#next-step") and page.is_disabled("#prev-step")
    assert errors == []
    page.close()
