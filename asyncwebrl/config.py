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
from asyncwebrl.training.config import ActorConfig, CheckpointConfig
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
        if self.total_train_steps < 1:
            raise ConfigError("total_train_steps must be >= 1")
        if alloc.rollout.backend == "sglang" and self.cluster.n_gpus_per_node == 0:
            raise ConfigError("backend 'sglang' needs GPUs (cluster.n_gpus_per_node > 0); use 'hf' on CPU")
        self._check_heldout()
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
        if not self.test_rollout.heldout_tasks.strip() or self.env.type != "miniwob":
            return  # held-out tasks are MiniWoB tasks; other env types ignore them (the default sets them)
        from asyncwebrl.web.tasks import resolve_task_names

        try:
            held = resolve_task_names(self.test_rollout.heldout_tasks)
            train = resolve_task_names(self.env.tasks)
        except ValueError as e:
            raise ConfigError(f"test_rollout.heldout_tasks / env.tasks: {e}") from e
        both = sorted(set(held) & set(train))
        if both:
            raise ConfigError(f"test_rollout.heldout_tasks must not overlap env.tasks (the trainer samples them): "
                              f"{', '.join(both)}")

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
