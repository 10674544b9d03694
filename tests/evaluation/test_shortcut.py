"""The shortcut baseline (issue 34): the best constant-action policy's success on the evaluation
episodes, played on real MiniWoB++ tasks in real Chromium. A task that position alone solves shows a
high baseline whatever the ids; a task that needs reading shows a low one, which the oracle (reading
the page) clears by a wide margin."""

from __future__ import annotations

import asyncio

import pytest

from asyncwebrl.evaluation.evaluate import eval_tasks
from asyncwebrl.evaluation.shortcut import shortcut_baseline, shortcut_figures
from asyncwebrl.web.browser import BrowserPool
from asyncwebrl.web.config import EnvConfig

pytestmark = pytest.mark.browser


def _baseline(names: list[str], n: int, **env):
    async def go():
        try:
            return await shortcut_baseline(eval_tasks([f"miniwob/{t}" for t in names], n, 2), EnvConfig(**env))
        finally:
            pool = BrowserPool._shared.get(id(asyncio.get_running_loop()))
            if pool is not None:
                await pool.close()

    return asyncio.run(asyncio.wait_for(go(), 300))


def test_a_positional_task_has_a_high_baseline_under_either_numbering():
    # click-test-2: buttons ONE and TWO, the target ONE first in document order
    drawn = _baseline(["click-test-2"], 12)
    document = _baseline(["click-test-2"], 12, element_ids="document")
    assert drawn.n_episodes == document.n_episodes == 12 and drawn.failed_episodes == 0
    # "the first button" needs no id: it is the shortcut under drawn ids too
    assert drawn.success_rate == 1.0 and drawn.policy.startswith("first ")
    assert drawn.per_policy["first button"] == 1.0 and drawn.per_policy["first element"] == 1.0
    assert document.per_policy["click [1]"] == 1.0 and document.per_policy["click [2]"] == 0.0
    # under drawn ids no single id solves it: click [1] and click [2] split the episodes
    assert 0.2 <= drawn.per_policy["click [1]"] <= 0.8
    assert drawn.per_policy["click [1]"] + drawn.per_policy["click [2]"] == pytest.approx(1.0)


def test_a_task_that_needs_reading_has_a_low_baseline_and_the_gain_is_reported():
    # click-button: the named button among up to six, in random order
    base = _baseline(["click-button"], 24)
    assert {"click [1]", "first button", "first element"} <= set(base.per_policy)
    assert base.success_rate <= 0.6, base.per_policy
    assert base.success_rate == max(base.per_policy.values())
    figs = shortcut_figures(1.0, base)  # what an oracle's evaluation reports beside it
    assert figs["shortcut_baseline"] == base.success_rate and figs["gain_over_shortcut"] >= 0.4
    assert shortcut_figures(1.0, None) == {}
