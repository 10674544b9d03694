"""`asyncwebrl bench pool`: the everlasting async pool vs the synchronous (WebGym) pool, one run.

Workload: the synthetic web-like env (heavy-tailed episode lengths, per-step latency, per-session
warm-up) through the real episode loop (rollout/episode.py: prompt, VLMAdapter encoding, PixelStore
puts), the real executor/controller/sync pool, and a trainer stand-in that sleeps `train_step_s` per
step (a disaggregated trainer on its own devices). Generation is either
- `policy=standin` (default): the GENERATION STAND-IN, a client that answers after `standin_gen_ms`
  with an action (correct target with probability `standin_accuracy`), modelling an inference
  server with spare capacity; it is named as such in the output and JSON; or
- `policy=server`: the embedded hf inference server in this process (`model=default` or a prepared
  test model such as `model=tiny-qwen2.5-vl`).

Phases, same workload: (1) rollout capacity (async pool, no trainer), (2) async pool with the trainer,
(3) synchronous pool with the trainer. Figures: trajectories/s, trainer idle fraction, rollout idle
fraction, speedup = async / sync, and the ideal-overlap bound min(rollout capacity, trainer capacity).
"""

from __future__ import annotations

import asyncio
import random
import re
import time
from dataclasses import dataclass
from typing import Any

from asyncwebrl.bench.common import parse_overrides, print_table
from asyncwebrl.pixelstore.base import PixelStore
from asyncwebrl.results import write_result
from asyncwebrl.weights.version import PolicyVersion

DEFAULTS: dict[str, Any] = {
    "policy": "standin",
    "model": "default",
    "steps": 10,
    "batch_size": 4,
    "concurrency": 4,
    "eta": 2,
    "n_samples": 4,
    "train_step_s": 3.0,
    "step_latency_ms": 150.0,
    "warmup_ms": 500.0,
    "success_steps": 5.0,
    "failure_steps": 12.5,
    "long_tail_prob": 0.05,
    "long_tail_factor": 4.0,
    "standin_gen_ms": 100.0,
    "standin_accuracy": 0.3,
    "max_new_tokens": 8,
    "capacity_steps": 6,
    "seed": 1,
}


@dataclass
class StandinOutput:
    output_ids: list[int]
    output_logprobs: list[float]
    output_versions: list[int]
    text: str
    finish_reason: str
    prompt_tokens: int
    server: str
    latency_s: float


class GenerationStandin:
    """NOT a model: answers each request after a log-normal delay with a click on an element of the
    prompt's element list (the instruction's target with probability `accuracy`)."""

    _ELEM = re.compile(r"\[(\d+)\] \w+ \"([^\"]*)\"")
    _TARGET = re.compile(r"Click '([^']+)'")

    def __init__(self, tokenizer: Any, gen_ms: float, accuracy: float, version: PolicyVersion, seed: int = 0):
        self.tok = tokenizer
        self.gen_s = gen_ms / 1000.0
        self.accuracy = accuracy
        self.version = version
        self.rng = random.Random(seed)

    async def agenerate(self, input_ids, image_data=None, sampling=None, sticky_key=None, rid=None,
                        cache_key=None) -> StandinOutput:
        t0 = time.perf_counter()
        tail = self.tok.decode(input_ids[-160:], skip_special_tokens=True)
        user = tail.rsplit("Task:", 1)[-1]
        elems = self._ELEM.findall(user)
        target = self._TARGET.search(user)
        pick = None
        if target and elems and self.rng.random() < self.accuracy:
            pick = next((i for i, n in elems if n == target.group(1)), None)
        if pick is None and elems:
            pick = self.rng.choice(elems)[0]
        text = f"click [{pick}]" if pick is not None else "wait"
        if self.gen_s > 0:
            await asyncio.sleep(self.rng.lognormvariate(-0.125, 0.5) * self.gen_s)
        ids = self.tok.encode(text, add_special_tokens=False)
        v = self.version.value  # what a server reports: the owner's value, set by the refresh bracket
        return StandinOutput(ids, [-0.5] * len(ids), [v] * len(ids), text, "stop", len(input_ids), "standin",
                             time.perf_counter() - t0)


def _build(knobs: dict[str, Any], version: PolicyVersion, server: Any) -> tuple[Any, Any, Any]:
    from asyncwebrl.models.prepare import resolve_model_path
    from asyncwebrl.pixelstore.store import InProcessPixelStore
    from asyncwebrl.rollout.config import RolloutConfig
    from asyncwebrl.rollout.workflow import EpisodeRolloutSpec, cached_adapter
    from asyncwebrl.web.base import Task
    from asyncwebrl.web.config import EnvConfig
    from asyncwebrl.web.synthetic import SyntheticProfile, SyntheticWebEnv

    model = resolve_model_path(knobs["model"])
    env_cfg = EnvConfig(type="synthetic", synthetic_step_latency_ms=knobs["step_latency_ms"], max_steps=200,
                        history_k=1)
    profile = SyntheticProfile(success_steps=knobs["success_steps"], failure_steps=knobs["failure_steps"],
                               long_tail_prob=knobs["long_tail_prob"], long_tail_factor=knobs["long_tail_factor"],
                               warmup_ms=knobs["warmup_ms"])
    store = InProcessPixelStore("bench")
    tok = cached_adapter(model).tokenizer
    seed = knobs["seed"]

    class Tasks:
        def __init__(self, index: int):
            self.rng = random.Random(seed * 7919 + index)

        def next(self) -> Task:
            return Task(task_id="synthetic/clicks", seed=self.rng.randrange(2**31), max_steps=200)

    def client_factory() -> Any:
        if server is not None:
            from asyncwebrl.inference.client import InferenceClient

            return InferenceClient([server.address])
        return GenerationStandin(tok, knobs["standin_gen_ms"], knobs["standin_accuracy"], version, seed)

    spec = EpisodeRolloutSpec(
        env_cfg=env_cfg, model_path=model, client_factory=client_factory, store=store,
        sampling={"max_new_tokens": knobs["max_new_tokens"], "temperature": 1.0},
        n_samples=knobs["n_samples"], task_factory=Tasks,
        env_factory=lambda cfg: SyntheticWebEnv(cfg, profile),
    )
    rcfg = RolloutConfig(consumer_batch_size=knobs["batch_size"], max_concurrent_rollouts=knobs["concurrency"],
                         max_head_offpolicyness=knobs["eta"], workers=1, batch_timeout_s=1800.0)
    return spec, rcfg, store


def _free_group(store: PixelStore, g: Any) -> None:
    store.free([k for t in g.trajectories for k in t.all_pixel_keys()])


def _run_phase(pool: Any, store: PixelStore, steps: int, train_s: float, server: Any) -> dict[str, Any]:
    if server is not None:  # the server reports this phase's owner, not the previous phase's
        server.engine.weight_version = str(pool.clock.value)
    pool.start()
    t0 = time.monotonic()
    wait = 0.0
    trajs = 0
    lengths: list[int] = []
    wins = 0
    first_at, first_trajs = 0.0, 0
    try:
        for i in range(steps):
            tw = time.monotonic()
            batch = pool.prepare_batch()
            wait += time.monotonic() - tw
            if i == 0:
                first_at, first_trajs = time.monotonic(), sum(len(g.trajectories) for g in batch)
            for g in batch:
                trajs += len(g.trajectories)
                lengths.extend(len(t.steps) for t in g.trajectories)
                wins += sum(t.success for t in g.trajectories)
                _free_group(store, g)  # the trainer consumed the pixels
            time.sleep(train_s)

            def refresh() -> None:
                if server is not None:  # a no-op weight "update" sets the version the bracket publishes
                    server.engine.weight_version = str(pool.clock.next)

            pool.update_weights(refresh)
        wall = time.monotonic() - t0
        steady_s = time.monotonic() - first_at
        st = pool.stats()
    finally:
        pool.shutdown()
    return {
        "trajectories": trajs,
        "wall_s": wall,
        "trajectories_per_s": trajs / wall,
        "steady_trajectories_per_s": (trajs - first_trajs) / steady_s if steps > 1 and steady_s > 0 else trajs / wall,
        "trainer_idle_fraction": wait / wall,
        "rollout_idle_fraction": st.rollout_idle_fraction,
        "dropped_stale": st.dropped_stale,
        "staleness_hist": st.staleness_hist,
        "failed_rollouts": st.failed_rollouts,
        "mean_episode_steps": sum(lengths) / max(1, len(lengths)),
        "success_rate": wins / max(1, trajs),
        "max_episode_steps": max(lengths, default=0),
    }


def main(overrides: list[str]) -> int:
    knobs = parse_overrides(overrides, DEFAULTS)
    if knobs["policy"] not in ("standin", "server"):
        raise SystemExit("bench pool: policy must be 'standin' or 'server'")
    if knobs["capacity_steps"] < 2 or knobs["steps"] < 1:
        raise SystemExit("bench pool: capacity_steps must be >= 2 (steady state) and steps >= 1")
    from asyncwebrl.rollout.controller import RolloutController
    from asyncwebrl.rollout.sync_pool import SyncRolloutPool

    server = None
    if knobs["policy"] == "server":
        from asyncwebrl.inference.engine import HFEngine
        from asyncwebrl.inference.server import launch_in_thread
        from asyncwebrl.models.prepare import resolve_model_path

        engine = HFEngine(resolve_model_path(knobs["model"]))
        engine.start()
        server = launch_in_thread(engine)
    results: dict[str, dict[str, Any]] = {}
    try:
        import dataclasses

        # each phase is a fresh run: its own version owner, from 0
        version = PolicyVersion()
        spec, rcfg, store = _build(knobs, version, server)
        cap_cfg = dataclasses.replace(rcfg, max_head_offpolicyness=10_000)
        results["capacity"] = _run_phase(RolloutController.local(spec, cap_cfg, clock=version), store,
                                         knobs["capacity_steps"], 0.0, server)
        version = PolicyVersion()
        spec, rcfg, store = _build(knobs, version, server)
        results["async"] = _run_phase(RolloutController.local(spec, rcfg, clock=version), store, knobs["steps"],
                                      knobs["train_step_s"], server)
        version = PolicyVersion()
        spec, rcfg, store = _build(knobs, version, server)
        results["sync"] = _run_phase(SyncRolloutPool(spec, rcfg, clock=version), store, knobs["steps"],
                                     knobs["train_step_s"], server)
    finally:
        if server is not None:
            server.stop()
            server.engine.stop()
    per_step = knobs["batch_size"] * knobs["n_samples"]
    trainer_capacity = per_step / knobs["train_step_s"] if knobs["train_step_s"] > 0 else float("inf")
    rollout_capacity = results["capacity"]["steady_trajectories_per_s"]  # after start-up, no trainer
    ideal = min(rollout_capacity, trainer_capacity)
    a, s = results["async"], results["sync"]
    speedup = a["trajectories_per_s"] / s["trajectories_per_s"]
    policy_name = ("GENERATION STAND-IN (not a model)" if knobs["policy"] == "standin"
                   else f"embedded hf server ({knobs['model']})")
    rows = [
        {"mode": m, "traj/s": r["trajectories_per_s"], "trainer_idle": r["trainer_idle_fraction"],
         "rollout_idle": r["rollout_idle_fraction"], "wall_s": r["wall_s"], "mean_len": r["mean_episode_steps"],
         "dropped": r["dropped_stale"]}
        for m, r in results.items()
    ]
    print(f"policy: {policy_name}; trainer stand-in {knobs['train_step_s']} s/step; "
          f"ideal overlap bound {ideal:.3g} traj/s (rollout {rollout_capacity:.3g}, trainer {trainer_capacity:.3g})")
    figures = {
        "speedup": speedup,
        "speedup_steady": a["steady_trajectories_per_s"] / s["steady_trajectories_per_s"],
        "success_rate_async": a["success_rate"],
        "success_rate_sync": s["success_rate"],
        "async_trajectories_per_s": a["trajectories_per_s"],
        "sync_trajectories_per_s": s["trajectories_per_s"],
        "async_trainer_idle_fraction": a["trainer_idle_fraction"],
        "sync_trainer_idle_fraction": s["trainer_idle_fraction"],
        "async_rollout_idle_fraction": a["rollout_idle_fraction"],
        "sync_rollout_idle_fraction": s["rollout_idle_fraction"],
        "rollout_capacity_trajectories_per_s": rollout_capacity,
        "trainer_capacity_trajectories_per_s": trainer_capacity,
        "ideal_overlap_trajectories_per_s": ideal,
        "async_fraction_of_ideal": a["trajectories_per_s"] / ideal,
        "sync_fraction_of_ideal": s["trajectories_per_s"] / ideal,
        "policy": policy_name,
        "phases": results,
        "anchors": {"asyncwebrl_paper": 2.9, "areal": 2.77},
        "note": "2-core shared CPU box: rollout CPU work and the episode loop share the cores; the trainer "
                "stand-in sleeps (a disaggregated trainer on its own devices)",
    }
    write_result("pool", {**knobs, "policy_name": policy_name}, figures)
    print_table(rows, f"speedup async/sync = {speedup:.2f}x ({policy_name}; async at "
                      f"{100 * a['trajectories_per_s'] / ideal:.0f}% of the ideal overlap bound)")
    return 0
