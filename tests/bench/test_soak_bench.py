"""The soak benchmark measures what it claims: the slope fit recovers a known leak, and a tiny real
soak through the production path (controller and trainer rank, real Chromium, PixelStore process,
inference server) samples every component and writes soak.json."""

import json
from types import SimpleNamespace

import pytest

from asyncwebrl.bench.soak import floor_slope_per_1k, peak_growth, slope_per_1k, summarize


def test_slope_fit_recovers_a_leak_and_a_flat_line():
    xs = [float(x) for x in range(0, 5000, 250)]
    assert slope_per_1k(xs, [100 + 0.002 * x for x in xs]) == pytest.approx(2.0)
    assert slope_per_1k(xs, [100.0 for _ in xs]) == pytest.approx(0.0)
    # warm-up growth is excluded from the fit
    samples = [{"episodes": x, "browsers": min(x, 1000.0) / 10, "pixelstore": 20.0, "inference_server": 400.0,
                "controller": 900.0} for x in xs]
    figs = summarize({"samples": samples, "summary": SimpleNamespace(trajectories=5000)}, warmup_frac=0.25)
    assert figs["slope_mb_per_1k_episodes"]["browsers"] == pytest.approx(0.0)
    assert figs["browsers"]["pss_mb_max"] == pytest.approx(100.0)


def test_floor_slope_tells_a_sawtooth_from_a_leak():
    xs = [float(x) for x in range(0, 10000, 20)]
    saw = [600 + (300 if (x // 700) % 2 else 0) for x in xs]  # heap taken and given back, ending high
    leak = [600 + 0.05 * x + (300 if (x // 700) % 2 else 0) for x in xs]
    assert abs(floor_slope_per_1k(xs, saw)) < 5
    assert floor_slope_per_1k(xs, leak) == pytest.approx(50, rel=0.2)
    assert peak_growth(saw) == 0 and peak_growth(leak) == pytest.approx(0.05 * 5000, rel=0.1)


@pytest.mark.slow
@pytest.mark.browser
def test_tiny_soak_samples_every_component(tmp_path, monkeypatch):
    import asyncwebrl.results as results_module
    from asyncwebrl.bench import soak

    monkeypatch.setattr(results_module, "RESULTS_DIR", tmp_path)
    assert soak.main(["episodes=8", "sample_every_s=0.5", "model=tiny-qwen2.5-vl", "max_new_tokens=4"]) == 0
    doc = json.loads((tmp_path / "soak.json").read_text())
    figs = doc["figures"]
    assert figs["episodes"] >= 8 and figs["steps"] == 2 and figs["lost_rollouts"] == 0
    assert "trainer rank" in figs["policy"]
    # the trainer rank gave the consumed screenshots back: the store ends with the in-flight ones only,
    # which may be none when the run stops between two rollouts
    assert figs["store_bytes_put"] > 0
    assert 0 <= figs["store_bytes_end"] < figs["store_bytes_put"]
    for comp in soak.COMPONENTS:
        if comp == "pixelstore":  # in the controller process: its figure is the bytes it holds, not a PSS
            assert figs[comp]["pss_mb_max"] > 0, comp
        else:
            assert figs[comp]["pss_mb_max"] > 5, comp  # the process was found and measured
