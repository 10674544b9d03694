"""Building the running system of one training run from its config, under either scheduler.

`ray`: one placement group per role (rollout servers, actor ranks, test-rollout servers), rollout
workers and the PixelStore as Ray actors. `local`: server processes pinned to devices by
`CUDA_VISIBLE_DEVICES`, one in-process trainer rank, rollout executors on threads, and the
loopback PixelStore process — for GPU boxes without Ray.

Invariant: `System.shutdown()` stops everything `build_system` started, in reverse order, and is
safe to call after a partial build (a failure half-way leaves no process behind).

`System.version` is the run's ONE weight-version owner (`weights.version.PolicyVersion`), started at
`resume_version` (0, or the checkpoint's version on resume: the one place resume sets it); the
rollout side reads it, the refresh bracket advances it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncwebrl.config import RunConfig
from asyncwebrl.controller.rundir import RunDir
from asyncwebrl.pixelstore.base import PixelStore
from asyncwebrl.weights.version import PolicyVersion

log = logging.getLogger(__name__)


class ClientFactory:
    """Picklable recipe for an InferenceClient inside a rollout worker."""

    def __init__(self, addresses: list[str], api_key: str | None, timeout_s: float, max_retries: int):
        self.addresses, self.api_key, self.timeout_s, self.max_retries = addresses, api_key, timeout_s, max_retries

    def __call__(self):
        from asyncwebrl.inference.client import InferenceClient

        return InferenceClient(self.addresses, api_key=self.api_key, timeout_s=self.timeout_s,
                               max_retries=self.max_retries)


class TaskFactory:
    """Picklable: worker index -> task stream, seeded by (run seed, worker, resume version) so workers
    and resumed runs do not replay each other's tasks."""

    def __init__(self, env_cfg, seed: int, resume_version: int = 0):
        self.env_cfg, self.seed, self.resume_version = env_cfg, seed, resume_version

    def __call__(self, index: int):
        from asyncwebrl.web.tasks import make_task_sampler

        return make_task_sampler(self.env_cfg, seed=self.seed * 1_000_003 + index * 7919 + self.resume_version * 31)

    def state(self) -> dict[str, int]:
        return {"seed": self.seed, "resume_version": self.resume_version}


def sampling_params(cfg: RunConfig, adapter) -> dict[str, Any]:
    params: dict[str, Any] = {
        "max_new_tokens": cfg.gconfig.max_new_tokens,
        "temperature": cfg.gconfig.temperature,
        "top_p": cfg.gconfig.top_p,
        "top_k": cfg.gconfig.top_k,
        "stop_token_ids": adapter.eos_token_ids,
    }
    if cfg.gconfig.stop:
        params["stop"] = list(cfg.gconfig.stop)
    return params


@dataclass
class System:
    cfg: RunConfig
    run: RunDir
    model_path: str = ""
    api_key: str = field(default="", repr=False)
    trainer_addresses: list[str] = field(default_factory=list)
    """hosts the servers may dial for the weight group besides loopback: the trainer node's address
    when the Ray cluster spans nodes"""
    """the run's inference key: inference.api_key, or a fresh random one (launched servers always have one)"""
    scheduler: Any = None
    server_handles: list[Any] = field(default_factory=list)
    """ServerProcess (local) or ServerHost actor handles (ray), train rollout"""
    server_addresses: list[str] = field(default_factory=list)
    test_handles: list[Any] = field(default_factory=list)
    test_addresses: list[str] = field(default_factory=list)
    pixel_store: PixelStore | None = None
    trainer: Any = None
    rollout: Any = None
    task_factory: TaskFactory | None = None
    test_rollout: Any = None
    version: PolicyVersion = field(default_factory=PolicyVersion)
    """the weight version's one owner (see the module docstring)"""
    _rollout_started: bool = False
    _test_started: bool = False
    _to_close: list[Any] = field(default_factory=list)

    def start_test_rollout(self) -> None:
        if self.test_rollout is not None and not self._test_started:
            self.test_rollout.start()
            self._test_started = True

    def start_rollout(self) -> None:
        if not self._rollout_started:
            self.rollout.start()
            self._rollout_started = True
        self.start_test_rollout()

    def task_sampler_state(self) -> dict[str, int]:
        return self.task_factory.state() if self.task_factory else {}

    def shutdown(self) -> None:
        steps = [
            ("test rollout", lambda: self.test_rollout and self.test_rollout.stop()),
            ("rollout", lambda: self.rollout and self.rollout.shutdown()),
            ("trainer", lambda: self.trainer and self.trainer.close()),
            ("servers", self._stop_servers),
            ("pixel store", lambda: self.pixel_store is not None and hasattr(self.pixel_store, "close")
             and self.pixel_store.close()),
            ("scheduler", lambda: self.scheduler and self.scheduler.shutdown()),
        ]
        for name, fn in steps:
            try:
                fn()
            except Exception as e:  # keep tearing down the rest
                log.warning("shutdown of %s failed: %r", name, e)

    def _stop_servers(self) -> None:
        from asyncwebrl.scheduling.servers import ServerProcess

        for h in self.server_handles + self.test_handles:
            if isinstance(h, ServerProcess):
                h.stop()
            else:
                try:
                    import ray

                    ray.get(h.stop.remote(), timeout=30)
                except Exception:
                    pass


def _server_kwargs(cfg: RunConfig, run: RunDir, model: str, backend: str, api_key: str,
                   trainer_addresses: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    from asyncwebrl.scheduling.budget import core_budget

    budget = core_budget(cfg)  # roles sharing cores: few server threads, below the trainer's priority
    return dict(backend=backend, model=model, dtype=cfg.inference.dtype, api_key=api_key, niceness=budget.rollout_niceness,
                max_batch_size=cfg.inference.max_batch_size, max_context_len=cfg.inference.max_context_len,
                log_dir=run.root / "logs", startup_timeout=cfg.inference.startup_timeout_s, host=cfg.inference.host,
                cpu_threads=budget.server_threads, weight_sync_timeout_s=cfg.inference.weight_sync_timeout_s,
                weights_roots=[str(Path(run.root) / "checkpoints")], trainer_addresses=list(trainer_addresses),
                env=cfg.inference.cost.as_env())


def build_system(cfg: RunConfig, run: RunDir, resume_version: int = 0) -> System:
    from asyncwebrl.httpguard import new_key
    from asyncwebrl.models.prepare import resolve_model_path

    system = System(cfg=cfg, run=run, model_path=resolve_model_path(cfg.actor.path),
                    api_key=cfg.inference.api_key or new_key(), version=PolicyVersion(resume_version))
    try:
        if cfg.scheduler.type == "ray":
            _build_ray(system)
        else:
            _build_local(system)
        _build_rollout(system)
        if cfg.test_rollout.enabled:
            _build_test_rollout(system)
    except BaseException:
        system.shutdown()
        raise
    return system


def _build_ray(s: System) -> None:
    import ray

    from asyncwebrl.pixelstore import make_pixel_store
    from asyncwebrl.scheduling.placement import plan_roles
    from asyncwebrl.scheduling.ray_scheduler import RayScheduler, start_servers
    from asyncwebrl.scheduling.trainer_host import start_trainer

    cfg = s.cfg
    s.scheduler = RayScheduler(plan_roles(cfg), address=cfg.scheduler.ray_address,
                               auth_token_file=cfg.scheduler.ray_auth_token_file)
    alloc = cfg.allocation
    base = cfg.inference.base_port
    if s.scheduler.spans_nodes:  # the weight group's master is trainer rank 0, on its node's address
        s.trainer_addresses = [s.scheduler.bundle_address_and_port("actor", 0)[0]]
    s.server_handles = start_servers(s.scheduler, "rollout", _server_kwargs(
        cfg, s.run, s.model_path, alloc.rollout.backend, s.api_key, s.trainer_addresses), base_port=base)
    if cfg.test_rollout.enabled:
        s.test_handles = start_servers(s.scheduler, "test-rollout", _server_kwargs(
            cfg, s.run, s.model_path, "hf", s.api_key, s.trainer_addresses),
            base_port=base + len(s.server_handles) if base else 0)
    s.server_addresses = ray.get([h.address.remote() for h in s.server_handles])
    s.test_addresses = ray.get([h.address.remote() for h in s.test_handles])
    if cfg.rollout.pixel_transport == "store":
        s.pixel_store = make_pixel_store(cfg.pixelstore, "ray", f"{cfg.experiment_name}-{cfg.trial_name}")
    s.trainer = start_trainer(cfg, s.scheduler)
    if cfg.actor.weight_update_mode == "xccl":
        s.trainer.init_weight_group(s.server_addresses, s.api_key)


def _build_local(s: System) -> None:
    from asyncwebrl.pixelstore import make_pixel_store
    from asyncwebrl.scheduling.fit import check_fit_here
    from asyncwebrl.scheduling.placement import local_device_assignment, plan_roles
    from asyncwebrl.scheduling.servers import launch_server
    from asyncwebrl.scheduling.trainer_host import start_trainer

    cfg = s.cfg
    check_fit_here(cfg)  # again where the device is known (the config may have been loaded without one)
    n_gpus = 0
    if cfg.cluster.n_gpus_per_node:
        import torch

        n_gpus = torch.cuda.device_count()
    devices = local_device_assignment(plan_roles(cfg), n_gpus)
    alloc = cfg.allocation
    kw = _server_kwargs(cfg, s.run, s.model_path, alloc.rollout.backend, s.api_key)
    base = cfg.inference.base_port
    for i, dev in enumerate(devices["rollout"]):
        s.server_handles.append(launch_server(device=dev, name=f"rollout{i}", port=base + i if base else 0, **kw))
    if cfg.test_rollout.enabled:
        kw_test = _server_kwargs(cfg, s.run, s.model_path, "hf", s.api_key)
        for i, dev in enumerate(devices["test-rollout"]):
            port = base + len(devices["rollout"]) + i if base else 0
            s.test_handles.append(launch_server(device=dev, name=f"test{i}", port=port, **kw_test))
    s.server_addresses = [h.address for h in s.server_handles]
    s.test_addresses = [h.address for h in s.test_handles]
    if cfg.rollout.pixel_transport == "store":
        s.pixel_store = make_pixel_store(cfg.pixelstore, "local", f"{cfg.experiment_name}-{cfg.trial_name}")
    s.trainer = start_trainer(cfg, None, device=devices["actor"][0])
    if cfg.actor.weight_update_mode == "xccl":
        s.trainer.init_weight_group(s.server_addresses, s.api_key)


def _build_rollout(s: System) -> None:
    from asyncwebrl.models.vlm import VLMAdapter
    from asyncwebrl.rollout.controller import make_rollout_controller
    from asyncwebrl.rollout.workflow import EpisodeRolloutSpec
    from asyncwebrl.scheduling.budget import NicedEnvFactory, core_budget

    cfg = s.cfg
    adapter = VLMAdapter(s.model_path)
    s.task_factory = TaskFactory(cfg.env, cfg.seed, s.version.start)
    niceness = core_budget(cfg).rollout_niceness
    # rollout workers are processes of their own under Ray (async); otherwise threads beside the trainer
    own_process = cfg.scheduler.type == "ray" and cfg.rollout.mode == "async"
    spec = EpisodeRolloutSpec(
        env_cfg=cfg.env, model_path=s.model_path,
        client_factory=ClientFactory(s.server_addresses, s.api_key, cfg.rollout.request_timeout_s,
                                     cfg.rollout.max_retries),
        store=s.pixel_store, sampling=sampling_params(cfg, adapter), n_samples=cfg.gconfig.n_samples,
        task_factory=s.task_factory, pixel_transport=cfg.rollout.pixel_transport,
        env_factory=NicedEnvFactory(niceness, own_process) if niceness > 0 else None,
    )
    store = s.pixel_store

    def free_group(g) -> None:
        if store is not None:
            store.free([k for t in g.trajectories for k in t.all_pixel_keys()])

    kwargs: dict[str, Any] = {"on_drop_group": free_group, "clock": s.version}
    if cfg.scheduler.type == "ray" and cfg.rollout.mode == "async":
        kwargs["cpus_per_worker"] = cfg.scheduler.cpus_per_role
        pin = cfg.scheduler.role_resources.get("rollout")
        if pin:  # rollout workers (browsers, episode loops) sit beside the rollout servers
            from asyncwebrl.scheduling.placement import NODE_RESOURCE_SLIVER

            kwargs["worker_resources"] = {pin: NODE_RESOURCE_SLIVER}
    s.rollout = make_rollout_controller(spec, cfg.rollout, cfg.scheduler.type, **kwargs)


def _build_test_rollout(s: System) -> None:
    from asyncwebrl.evaluation.evaluate import eval_sampling, eval_task_sets
    from asyncwebrl.evaluation.test_rollout import TestRolloutManager
    from asyncwebrl.inference.client import InferenceClient
    from asyncwebrl.models.vlm import VLMAdapter
    from asyncwebrl.pixelstore.store import InProcessPixelStore
    from asyncwebrl.web.tasks import make_env

    cfg = s.cfg
    adapter = VLMAdapter(s.model_path)
    env_cfg = cfg.env
    tasks, heldout = eval_task_sets(cfg)
    s.test_rollout = TestRolloutManager(
        ckpt_root=Path(s.run.root) / "checkpoints",
        client=InferenceClient(s.test_addresses, api_key=s.api_key, timeout_s=cfg.rollout.request_timeout_s),
        adapter=adapter, env_factory=lambda: make_env(env_cfg), env_cfg=env_cfg, tasks=tasks,
        sampling=eval_sampling(cfg, adapter),
        on_result=lambda figs: s.run.log_metrics("eval", int(figs["version"]), figs),
        poll_interval_s=cfg.test_rollout.poll_interval_s, flush_after_s=cfg.test_rollout.flush_after_s or None,
        store=InProcessPixelStore("eval"), heldout_tasks=heldout, shortcut=cfg.test_rollout.shortcut_baseline,
    )
