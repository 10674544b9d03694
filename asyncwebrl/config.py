"""The run's config tree: one section per component, AReaL-compatible key names (SPEC section 10).

Invariant: `load_run_config` returns a tree that every process can trust. Unknown keys, wrong types
and impossible combinations are rejected here, before any process starts.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import yaml

from asyncwebrl.allocation import AllocationModeError, parse_allocation_mode
from asyncwebrl.configtree import ConfigError, describe, load, to_dict
from asyncwebrl.evaluation.config import TestRolloutConfig
from asyncwebrl.inference.config import InferenceConfig
from asyncwebrl.pixelstore.config import PixelStoreConfig
from asyncwebrl.rollout.config import GenerationConfig, RolloutConfig
from asyncwebrl.scheduling.config import ClusterConfig, SchedulerConfig
from asyncwebrl.training.config import ActorConfig, CheckpointConfig, WarmStartConfig
from asyncwebrl.web.config import EnvConfig

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "default.yaml"


@dataclass(kw_only=True)
class StatsConfig:
    tensorboard: bool = True
    """write TensorBoard event files into the run directory"""
    wandb_project: str | None = None
    """Weights & Biases project (None = off)"""
    progress_bar: bool = True
    """show a progress bar with the headline numbers while training"""
    keep_episodes: int = 64
    """episodes (with screenshots) kept in the run directory for the viewer"""


@dataclass(kw_only=True)
class RunConfig:
    experiment_name: str = "asyncwebrl"
    """experiment name (a folder under cluster.fileroot)"""
    trial_name: str = "default"
    """trial name (a folder under the experiment)"""
    seed: int = 1
    """global seed: task sampling, env seeds, generation"""
    allocation_mode: str = "hf[rollout]:d1+fsdp[actor]:d1"
    """devices of each role, e.g. sglang[rollout]:d48+fsdp[actor]:d16 (SPEC section 1)"""
    total_train_steps: int = 20
    """training steps (weight versions) of the run"""
    recover: Literal["off", "auto"] = "off"
    """auto = resume from the newest complete checkpoint of this trial if one exists"""
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    gconfig: GenerationConfig = field(default_factory=GenerationConfig)
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    test_rollout: TestRolloutConfig = field(default_factory=TestRolloutConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    pixelstore: PixelStoreConfig = field(default_factory=PixelStoreConfig)
    stats: StatsConfig = field(default_factory=StatsConfig)

    def __post_init__(self) -> None:
        if self.actor.temperature is None:
            self.actor.temperature = self.gconfig.temperature

    def validate(self) -> None:
        if self.actor.temperature != self.gconfig.temperature and self.gconfig.temperature > 0:
            raise ConfigError(
                f"actor.temperature ({self.actor.temperature}) differs from gconfig.temperature "
                f"({self.gconfig.temperature}): the trainer's logprobs must use the sampling temperature"
            )
        try:
            alloc = parse_allocation_mode(self.allocation_mode)
        except AllocationModeError as e:
            raise ConfigError(str(e)) from e
        if alloc.rollout is None:
            raise ConfigError("allocation_mode needs an inference component with role 'rollout'")
        if alloc.actor is None:
            raise ConfigError("allocation_mode needs a training component 'fsdp[actor]:dN'")
        self._validate_inference_servers(alloc)
        from asyncwebrl.scheduling.fit import check_fit_here

        check_fit_here(self)  # the shared-device layout: refused here when trainer and server cannot fit
        if self.total_train_steps < 1:
            raise ConfigError("total_train_steps must be >= 1")
        if alloc.rollout.backend == "sglang" and self.cluster.n_gpus_per_node == 0:
            raise ConfigError("backend 'sglang' needs GPUs (cluster.n_gpus_per_node > 0); use 'hf' on CPU")
        self._check_heldout()
        self._check_warm_start()
        if self.cluster.n_gpus_per_node:
            total = self.cluster.n_nodes * self.cluster.n_gpus_per_node
            need = alloc.total_devices + (self.test_rollout.n_gpus if self.test_rollout.enabled else 0)
            if need > total:
                raise ConfigError(
                    f"allocation_mode plus test_rollout.n_gpus need {need} devices but the cluster has "
                    f"{total} (cluster.n_nodes x cluster.n_gpus_per_node)"
                )

    def _check_heldout(self) -> None:
        """Held-out tasks must be real task names and disjoint from the training tasks."""
        if not self.test_rollout.heldout_tasks.strip():
            return
        from asyncwebrl.web.tasks import resolve_task_names

        if self.env.type != "miniwob":
            # the default file's held-out set is MiniWoB's; on another env it cannot run, so it is
            # switched off with a warning rather than failing `train env.type=webgym ...`
            try:
                resolve_task_names(self.test_rollout.heldout_tasks)
            except ValueError:
                raise ConfigError("test_rollout.heldout_tasks names MiniWoB tasks or sets; it needs "
                                  "env.type=miniwob") from None
            import logging

            logging.getLogger("asyncwebrl").warning(
                "test_rollout.heldout_tasks=%s names MiniWoB tasks but env.type=%s: held-out evaluation is off",
                self.test_rollout.heldout_tasks, self.env.type)
            self.test_rollout.heldout_tasks = ""
            return
        try:
            held = resolve_task_names(self.test_rollout.heldout_tasks)
            train = resolve_task_names(self.env.tasks)
        except ValueError as e:
            raise ConfigError(f"test_rollout.heldout_tasks / env.tasks: {e}") from e
        both = sorted(set(held) & set(train))
        if both:
            raise ConfigError(f"test_rollout.heldout_tasks must not overlap env.tasks (the trainer samples them): "
                              f"{', '.join(both)}")

    def _check_warm_start(self) -> None:
        """The warm start's tasks: real, with an oracle (source=oracle), and never a held-out task."""
        ws = self.warm_start
        if not ws.enabled:
            return
        if self.env.type != "miniwob":
            raise ConfigError(f"warm_start demonstrates MiniWoB tasks (oracles, or recorded MiniWoB episodes); "
                              f"env.type={self.env.type} has none: set warm_start.enabled=false")
        from asyncwebrl.web.oracles import ORACLES
        from asyncwebrl.web.tasks import resolve_task_names

        try:
            tasks = resolve_task_names(ws.tasks or self.env.tasks)
        except ValueError as e:
            raise ConfigError(f"warm_start.tasks: {e}") from e
        if ws.source == "oracle":
            missing = [t for t in tasks if t not in ORACLES]
            if missing:
                raise ConfigError(f"warm_start.source=oracle but these tasks have no scripted oracle: "
                                  f"{', '.join(missing)} (oracles exist for {', '.join(ORACLES)}); set "
                                  "warm_start.tasks to a subset of them")
        if self.test_rollout.heldout_tasks.strip():
            held = set(resolve_task_names(self.test_rollout.heldout_tasks))
            both = sorted(held & set(tasks))
            if both:
                raise ConfigError(f"warm_start.tasks must not include held-out tasks (they would no longer be "
                                  f"held out): {', '.join(both)}")

    def _validate_inference_servers(self, alloc) -> None:
        """cluster.n_inference_servers against allocation_mode and rollout.mode (SPEC section 1)."""
        n = self.cluster.n_inference_servers
        if n is None:
            return
        rollout_colocated = any(len(c.allocs) > 1 and any(a.role == "rollout" for a in c.allocs)
                                for c in alloc.components)
        if n > 0:
            if self.rollout.mode != "async":
                raise ConfigError(
                    f"cluster.n_inference_servers={n} puts rollout on dedicated inference workers, which runs "
                    f"async; rollout.mode={self.rollout.mode} contradicts it (set rollout.mode=async, or "
                    "cluster.n_inference_servers=0 for the synchronous pool)")
            if rollout_colocated:
                raise ConfigError(
                    f"cluster.n_inference_servers={n} means rollout is not colocated with training, but "
                    f"allocation_mode '{alloc.text}' colocates the rollout role ('|'); use '+' between them")
            if self.cluster.n_gpus_per_node and alloc.rollout.dp != n:
                raise ConfigError(
                    f"cluster.n_inference_servers={n} but allocation_mode '{alloc.text}' gives the rollout role "
                    f"{alloc.rollout.dp} device(s), one server each; make them agree")
        elif self.rollout.mode != "sync":
            raise ConfigError(
                "cluster.n_inference_servers=0 means no dedicated inference workers (rollout and training "
                f"take turns), which is rollout.mode=sync; rollout.mode={self.rollout.mode} needs dedicated "
                "servers (set cluster.n_inference_servers > 0 or null)")

    @property
    def n_rollout_servers(self) -> int:
        """How many train-rollout servers start: cluster.n_inference_servers when > 0, else one per
        rollout device of allocation_mode."""
        return self.cluster.n_inference_servers or self.allocation.rollout.dp

    @property
    def allocation(self):
        return parse_allocation_mode(self.allocation_mode)

    @property
    def run_dir(self) -> Path:
        return Path(self.cluster.fileroot) / self.experiment_name / self.trial_name


def load_run_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """The default config (or `path`) with dotted overrides applied and everything validated."""
    return load(RunConfig, path or DEFAULT_CONFIG, overrides)


def save_resolved(cfg: RunConfig, run_dir: Path) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    out = run_dir / "config.yaml"
    out.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    return out


def config_reference() -> str:
    """Markdown table of every config key with type, default and doc (for --help-config and README)."""
    lines = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for key, tp, default, doc in describe(RunConfig):
        lines.append(f"| `{key}` | {tp} | `{json.dumps(default)}` | {doc} |")
    return "\n".join(lines)


def replace(cfg: RunConfig, **changes) -> RunConfig:
    return dataclasses.replace(cfg, **changes)
