"""`asyncwebrl bench soak`: many MiniWoB episodes through the rollout pool; does memory stay flat?

Workload: real Chromium + MiniWoB++ through the real async rollout controller (executor slots, the
episode loop, VLMAdapter encoding), screenshots through the loopback PixelStore server process (put
by the episodes, freed when the "trainer" consumes a batch), and a real embedded inference server
process. The policy is either
- `policy=model`: every generation request goes to the inference server (the default SmolVLM model,
  `max_new_tokens` small); or
- `policy=scripted` (default, for 10k episodes on a small box): a SCRIPTED POLICY, not a model — it
  reads the element list in the prompt and clicks the instruction's target (GenerationStandin of
  bench/pool.py with accuracy 1, no delay); one request in `server_every` is still sent to the real
  inference server (same prompt and screenshot) so its memory is exercised over the whole run.

Memory: PSS (proportional set size) of the Chromium process trees, the PixelStore process and the
inference server process, sampled every `sample_every_s` together with the number of episodes done.
Headline: `slope_mb_per_1k_episodes` per component, the least-squares slope of PSS against episodes
after the first `warmup_frac` of the run (flat memory = slope near 0). Beside it
`floor_slope_mb_per_1k_episodes`: the slope of the per-window minima (10 windows), the memory a
process falls back to; a leak raises the floor, a sawtooth of freed-and-reused heap does not; and
`peak_growth_mb`, the peak of the second half minus the peak of the first (a bounded process: <= 0).
"""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path
from typing import Any

from asyncwebrl.bench.common import parse_overrides, print_table, write_result

DEFAULTS: dict[str, Any] = {
    "episodes": 10000,
    "policy": "scripted",
    "model": "default",
    "tasks": "click-test,click-button,click-link,focus-text",
    "max_steps": 3,
    "concurrency": 4,
    "n_samples": 2,
    "batch_size": 2,
    "max_new_tokens": 4,
    "server_every": 8,
    "sample_every_s": 2.0,
    "warmup_frac": 0.2,
    "seed": 1,
}


def _pss_tree(pids: list[int]) -> int:
    """Total PSS (bytes) of the given processes and all their descendants (each counted once)."""
    import psutil

    seen: set[int] = set()
    total = 0
    for pid in pids:
        try:
            root = psutil.Process(pid)
            procs = [root] + root.children(recursive=True)
        except psutil.Error:
            continue
        for p in procs:
            if p.pid in seen:
                continue
            seen.add(p.pid)
            try:
                total += p.memory_full_info().pss
            except psutil.Error:
                pass
    return total


def slope_per_1k(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys against xs, times 1000 (MB per 1k episodes when xs are episodes)."""
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return 0.0
    return 1000.0 * sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx


def floor_slope_per_1k(xs: list[float], ys: list[float], windows: int = 10) -> float:
    """Slope of the minimum of ys in each of `windows` equal spans of xs (MB per 1k episodes)."""
    if len(xs) < 2 or xs[-1] <= xs[0]:
        return 0.0
    span = (xs[-1] - xs[0]) / windows
    px, py = [], []
    for w in range(windows):
        lo, hi = xs[0] + w * span, xs[0] + (w + 1) * span
        inside = [y for x, y in zip(xs, ys, strict=True) if lo <= x < hi or (w == windows - 1 and x == hi)]
        if inside:
            px.append((lo + hi) / 2)
            py.append(min(inside))
    return slope_per_1k(px, py)


def peak_growth(ys: list[float]) -> float:
    """Peak of the second half minus peak of the first half: how much the envelope of a bounded
    sawtooth rose over the run (0 or less: the highest memory was already reached early)."""
    if len(ys) < 2:
        return 0.0
    half = len(ys) // 2
    return max(ys[half:]) - max(ys[:half])


class ScriptedClient:
    """SCRIPTED POLICY (not a model): prompt-parsing clicks; every `server_every`-th request also goes to
    the real inference server so its memory sees the same traffic shape."""

    def __init__(self, model_path: str, address: str, server_every: int, seed: int):
        from asyncwebrl.bench.pool import GenerationStandin
        from asyncwebrl.inference.client import InferenceClient
        from asyncwebrl.rollout.workflow import cached_adapter

        self.policy = GenerationStandin(cached_adapter(model_path).tokenizer, 0.0, 1.0, lambda: 0, seed)
        self.server = InferenceClient([address], timeout_s=120.0)
        self.every = max(1, int(server_every))
        self.n = 0
        self.server_requests = 0

    async def agenerate(self, input_ids, image_data=None, sampling=None, sticky_key=None, rid=None):
        self.n += 1
        if self.n % self.every == 0:
            await self.server.agenerate(input_ids, image_data, dict(sampling or {}, max_new_tokens=1), None, None)
            self.server_requests += 1
        return await self.policy.agenerate(input_ids, image_data, sampling, sticky_key, rid)

    def release(self, sticky_key: str) -> None:
        pass

    async def aclose(self) -> None:
        await self.server.aclose()


class _ClientFactory:
    def __init__(self, knobs: dict[str, Any], model_path: str, address: str):
        self.knobs, self.model_path, self.address = knobs, model_path, address

    def __call__(self) -> Any:
        from asyncwebrl.inference.client import InferenceClient

        if self.knobs["policy"] == "model":
            return InferenceClient([self.address], timeout_s=120.0)
        return ScriptedClient(self.model_path, self.address, self.knobs["server_every"],
                              random.Random(self.knobs["seed"]).randrange(2**31))


class MemorySampler:
    """PSS of each component against episodes done, sampled on a thread."""

    def __init__(self, components: dict[str, Any], episodes_done, every_s: float):
        self.components = components
        """name -> callable returning the root pids to sum"""
        self.episodes_done = episodes_done
        self.every_s = every_s
        self.samples: list[dict[str, float]] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, name="soak-pss", daemon=True)

    def sample(self) -> None:
        row = {"t": time.monotonic(), "episodes": float(self.episodes_done())}
        for name, pids in self.components.items():
            row[name] = _pss_tree(pids()) / 2**20
        self.samples.append(row)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sample()

    def __enter__(self) -> MemorySampler:
        self.sample()
        self._t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._t.join(30)
        self.sample()


def run_soak(knobs: dict[str, Any], log_dir: Path) -> dict[str, Any]:
    from asyncwebrl.models.prepare import resolve_model_path
    from asyncwebrl.pixelstore.local_store import start_local_store
    from asyncwebrl.rollout.config import RolloutConfig
    from asyncwebrl.rollout.controller import RolloutController
    from asyncwebrl.rollout.workflow import EpisodeRolloutSpec
    from asyncwebrl.scheduling.servers import launch_server
    from asyncwebrl.web.browser import browser_root_pids
    from asyncwebrl.web.config import EnvConfig
    from asyncwebrl.web.tasks import make_task_sampler

    if knobs["policy"] not in ("model", "scripted"):
        raise ValueError(f"policy must be model or scripted, got {knobs['policy']!r}")
    model = resolve_model_path(knobs["model"])
    env_cfg = EnvConfig(type="miniwob", tasks=knobs["tasks"], max_steps=int(knobs["max_steps"]))
    server = launch_server(model=model, log_dir=log_dir, name="soak", max_batch_size=8)
    store = start_local_store(256 << 20, put_timeout_s=60.0, prefix="soak")
    seed = int(knobs["seed"])
    pool = None
    try:
        spec = EpisodeRolloutSpec(
            env_cfg=env_cfg, model_path=model, client_factory=_ClientFactory(knobs, model, server.address),
            store=store, sampling={"max_new_tokens": int(knobs["max_new_tokens"]), "temperature": 1.0},
            n_samples=int(knobs["n_samples"]), task_factory=lambda i: make_task_sampler(env_cfg, seed=seed * 7919 + i),
        )
        rcfg = RolloutConfig(consumer_batch_size=int(knobs["batch_size"]),
                             max_concurrent_rollouts=int(knobs["concurrency"]), max_head_offpolicyness=10**9,
                             workers=1, batch_timeout_s=600.0)

        def free(g) -> None:
            store.free([k for t in g.trajectories for k in t.all_pixel_keys()])

        pool = RolloutController.local(spec, rcfg, on_drop_group=free)
        done = {"episodes": 0, "failed": 0, "success": 0, "steps": 0}
        components = {
            "browsers": lambda: browser_root_pids(env_cfg.headless_shell),
            "pixelstore": lambda: [store.server.proc.pid],
            "inference_server": lambda: [server.pid],
        }
        target = int(knobs["episodes"])
        t0 = time.monotonic()
        pool.start()
        reported = 0
        with MemorySampler(components, lambda: done["episodes"], float(knobs["sample_every_s"])) as mem:
            while done["episodes"] < target:
                for g in pool.prepare_batch():
                    for t in g.trajectories:
                        done["episodes"] += 1
                        done["failed"] += int(t.failed)
                        done["success"] += int(t.success)
                        done["steps"] += len(t.steps)
                    free(g)  # the consumer took the pixels
                if done["episodes"] // 500 > reported:
                    reported = done["episodes"] // 500
                    last = mem.samples[-1] if mem.samples else {}
                    print(f"soak: {done['episodes']}/{target} episodes, {time.monotonic() - t0:.0f} s, PSS MB "
                          + ", ".join(f"{c} {last.get(c, 0):.0f}" for c in components), flush=True)
        wall = time.monotonic() - t0
        stats = pool.stats()
        store_stats = store.stats()
    finally:
        if pool is not None:
            pool.shutdown()
        store.close()
        server.stop()
    return {"samples": mem.samples, "done": done, "wall_s": wall, "rollout": stats, "store": store_stats}


def summarize(res: dict[str, Any], warmup_frac: float) -> dict[str, Any]:
    samples = res["samples"]
    total = res["done"]["episodes"]
    after = [s for s in samples if s["episodes"] >= warmup_frac * total] or samples
    figs: dict[str, Any] = {}
    for comp in ("browsers", "pixelstore", "inference_server"):
        xs = [s["episodes"] for s in after]
        ys = [s[comp] for s in after]
        figs[comp] = {
            "slope_mb_per_1k_episodes": round(slope_per_1k(xs, ys), 3),
            "floor_slope_mb_per_1k_episodes": round(floor_slope_per_1k(xs, ys), 3),
            "peak_growth_mb": round(peak_growth(ys), 1),
            "pss_mb_start": round(after[0][comp], 1), "pss_mb_end": round(after[-1][comp], 1),
            "pss_mb_max": round(max(s[comp] for s in samples), 1),
        }
    figs["slope_mb_per_1k_episodes"] = {c: figs[c]["slope_mb_per_1k_episodes"]
                                        for c in ("browsers", "pixelstore", "inference_server")}
    figs["floor_slope_mb_per_1k_episodes"] = {c: figs[c]["floor_slope_mb_per_1k_episodes"]
                                              for c in ("browsers", "pixelstore", "inference_server")}
    figs["peak_growth_mb"] = {c: figs[c]["peak_growth_mb"] for c in ("browsers", "pixelstore", "inference_server")}
    return figs


def main(overrides: list[str]) -> int:
    knobs = parse_overrides(overrides, DEFAULTS)
    import tempfile

    with tempfile.TemporaryDirectory(prefix="soak-") as d:
        res = run_soak(knobs, Path(d))
    figs = summarize(res, float(knobs["warmup_frac"]))
    done = res["done"]
    figs.update({
        "episodes": done["episodes"], "failed_episodes": done["failed"], "success_rate": done["success"] / max(1, done["episodes"]),
        "mean_episode_steps": done["steps"] / max(1, done["episodes"]), "wall_s": round(res["wall_s"], 1),
        "episodes_per_s": round(done["episodes"] / max(1e-9, res["wall_s"]), 2),
        "lost_rollouts": res["rollout"].get("lost_rollouts"), "store_items_at_end": res["store"].get("items",
                                                                                                     res["store"]),
        "policy": ("SCRIPTED POLICY (prompt-parsing clicks, not a model; 1 in "
                   f"{knobs['server_every']} requests also sent to the real server)") if knobs["policy"] == "scripted"
        else f"embedded hf server ({knobs['model']})",
        "samples": [{k: round(v, 2) for k, v in s.items() if k != "t"} for s in res["samples"]],
    })
    rows = [{"component": c, "pss_mb_start": figs[c]["pss_mb_start"], "pss_mb_end": figs[c]["pss_mb_end"],
             "slope_mb_per_1k": figs[c]["slope_mb_per_1k_episodes"]}
            for c in ("browsers", "pixelstore", "inference_server")]
    path = write_result("soak", knobs, figs)
    worst = max(figs["slope_mb_per_1k_episodes"].items(), key=lambda kv: abs(kv[1]))
    print(f"policy: {figs['policy']}; {done['episodes']} episodes in {figs['wall_s']} s "
          f"({figs['episodes_per_s']} ep/s), {done['failed']} failed")
    print_table(rows, f"slope_mb_per_1k_episodes: browsers {figs['browsers']['slope_mb_per_1k_episodes']}, "
                      f"pixelstore {figs['pixelstore']['slope_mb_per_1k_episodes']}, inference server "
                      f"{figs['inference_server']['slope_mb_per_1k_episodes']} (largest |slope|: {worst[0]}) -> {path}")
    return 0
