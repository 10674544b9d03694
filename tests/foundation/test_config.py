import subprocess
import sys

import pytest
import yaml

from asyncwebrl.config import RunConfig, config_reference, load_run_config, save_resolved
from asyncwebrl.configtree import ConfigError


def test_default_config_loads_and_is_the_embedded_default():
    cfg = load_run_config()
    assert isinstance(cfg, RunConfig)
    assert cfg.allocation.rollout.backend == "hf"
    assert cfg.env.type == "miniwob"
    from asyncwebrl.web.tasks import MINIWOB_EASY, resolve_task_names

    # the single-step tasks less those the base policy always solves (no GRPO signal, nothing to gain)
    train = resolve_task_names(cfg.env.tasks)
    assert set(train) < set(MINIWOB_EASY) and "click-test" not in train
    assert cfg.rollout.mode == "async"
    assert cfg.test_rollout.enabled


def test_dotted_overrides_are_typed():
    cfg = load_run_config(None, ["rollout.max_head_offpolicyness=4", "actor.lr=3e-5", "gconfig.stop=[a, b]",
                                 "rollout.max_concurrent_rollouts=null", "actor.eps_clip_higher=0.28"])
    assert cfg.rollout.max_head_offpolicyness == 4
    assert cfg.actor.lr == pytest.approx(3e-5)
    assert cfg.gconfig.stop == ["a", "b"]
    assert cfg.rollout.max_concurrent_rollouts is None
    assert cfg.actor.eps_clip_higher == pytest.approx(0.28)


def test_yaml_file_and_override_precedence(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("rollout:\n  consumer_batch_size: 6\n  max_head_offpolicyness: 2\n")
    cfg = load_run_config(f, ["rollout.max_head_offpolicyness=3"])
    assert cfg.rollout.consumer_batch_size == 6
    assert cfg.rollout.max_head_offpolicyness == 3


def test_unknown_key_names_key_and_closest_valid_ones():
    with pytest.raises(ConfigError) as ei:
        load_run_config(None, ["rollout.max_head_offpolicynes=2"])
    msg = str(ei.value)
    assert "rollout.max_head_offpolicynes" in msg
    assert "did you mean rollout.max_head_offpolicyness" in msg


def test_unknown_section_is_rejected():
    with pytest.raises(ConfigError, match="unknown config key 'rolout'.*did you mean rollout"):
        load_run_config(None, ["rolout.mode=sync"])


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("rollout.max_head_offpolicyness=-1", "eta"),
        ("rollout.consumer_batch_size=0", "consumer_batch_size"),
        ("rollout.mode=fast", "one of 'async' | 'sync'"),
        ("actor.lr=abc", "must be a number"),
        ("gconfig.n_samples=2.5", "must be an integer"),
        ("actor.recompute_logprob=maybe", "true or false"),
        ("allocation_mode=hf[rollout]:d2|fsdp[actor]:d1", "different world sizes"),
        ("allocation_mode=fsdp[actor]:d1", "role 'rollout'"),
        ("rollout=3", "is a section"),
    ],
)
def test_impossible_values_fail_before_start(override, fragment):
    with pytest.raises(ConfigError) as ei:
        load_run_config(None, [override])
    assert fragment in str(ei.value)


def test_resolved_config_round_trips(tmp_path):
    cfg = load_run_config(None, ["seed=7"])
    path = save_resolved(cfg, tmp_path)
    again = load_run_config(path)
    assert again == cfg
    assert yaml.safe_load(path.read_text())["seed"] == 7


def test_every_key_is_documented():
    ref = config_reference()
    undocumented = [line for line in ref.splitlines()[2:] if line.rstrip().endswith("|  |")]
    assert not undocumented, undocumented
    assert "`rollout.max_head_offpolicyness`" in ref


def test_cli_reports_config_errors_clearly():
    r = subprocess.run([sys.executable, "-m", "asyncwebrl.cli", "train", "actor.lrr=1"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "unknown config key 'actor.lrr'" in r.stderr and "actor.lr" in r.stderr


def test_cli_help_lists_subcommands():
    r = subprocess.run([sys.executable, "-m", "asyncwebrl.cli", "--help"], capture_output=True, text=True, timeout=120)
    for sub in ("train", "serve", "eval", "bench", "view", "prepare-model"):
        assert sub in r.stdout


def test_every_config_key_is_read_somewhere():
    """A key a user can set must change something: each config field is read (as `.name`) by some
    code of the package other than its own declaration. Documented-but-dead keys fail here."""
    import re
    from pathlib import Path

    import asyncwebrl
    from asyncwebrl.config import RunConfig
    from asyncwebrl.configtree import describe

    root = Path(asyncwebrl.__file__).parent
    code = "\n".join(p.read_text() for p in root.rglob("*.py") if p.name != "configtree.py")
    # docstrings and comments mention keys by name; only code may count as a read
    code = re.sub(r'"""[\s\S]*?"""', "", code)
    code = re.sub(r"#[^\n]*", "", code)
    dead = [key for key, *_ in describe(RunConfig)
            if not re.search(r"\.%s\b|getattr\([^)]*[\"']%s[\"']" % ((re.escape(key.split(".")[-1]),) * 2), code)]
    assert dead == [], f"config keys accepted but read nowhere: {dead}"


def test_overrides_interpolate_through_omegaconf(tmp_path, monkeypatch):
    """Files and overrides are layered by OmegaConf: `${...}` references resolve before validation."""
    from asyncwebrl.config import load_run_config

    monkeypatch.setenv("AWRL_SCRATCH", str(tmp_path))
    cfg = load_run_config(None, ["cluster.fileroot=${oc.env:AWRL_SCRATCH}/runs", "gconfig.n_samples=3",
                                 "rollout.consumer_batch_size=${gconfig.n_samples}"])
    assert cfg.cluster.fileroot == f"{tmp_path}/runs" and cfg.rollout.consumer_batch_size == 3
    # `key=` is the empty string (a string key given nothing), not null
    assert load_run_config(None, ["test_rollout.heldout_tasks="]).test_rollout.heldout_tasks == ""


def test_heldout_tasks_must_not_overlap_the_training_tasks():
    with pytest.raises(ConfigError, match="overlap.*click-test"):
        load_run_config(None, ["env.tasks=click-test,click-button", "test_rollout.heldout_tasks=click-test"])
    with pytest.raises(ConfigError, match="unknown MiniWoB task"):
        load_run_config(None, ["test_rollout.heldout_tasks=no-such-task"])
    cfg = load_run_config(None, ["env.tasks=click-test", "test_rollout.heldout_tasks=click-link"])
    assert cfg.test_rollout.heldout_tasks == "click-link"
    # the default's held-out MiniWoB tasks do not stop a run on another environment
    cfg = load_run_config(None, ["env.type=webgym", "env.task_file=asyncwebrl/web/demo_site/tasks.jsonl"])
    from asyncwebrl.evaluation.evaluate import eval_task_sets

    assert eval_task_sets(cfg)[1] == []


def test_eval_sets_default_to_the_training_tasks_and_take_webgym_ids():
    from asyncwebrl.evaluation.evaluate import eval_task_sets

    cfg = load_run_config(None, ["env.tasks=click-test,click-button", "test_rollout.n_episodes=4",
                                 "test_rollout.heldout_tasks=click-link", "test_rollout.heldout_n_episodes=2"])
    tasks, held = eval_task_sets(cfg)
    assert [t.task_id for t in tasks] == ["miniwob/click-test", "miniwob/click-button"] * 2
    assert [t.task_id for t in held] == ["miniwob/click-link"] * 2
    cfg = load_run_config(None, ["env.type=webgym", "env.task_file=asyncwebrl/web/demo_site/tasks.jsonl",
                                 "test_rollout.n_episodes=3", "test_rollout.tasks=demo/about,demo/agree"])
    tasks, held = eval_task_sets(cfg)
    assert [t.task_id for t in tasks] == ["demo/about", "demo/agree", "demo/about"] and not held
    assert tasks[0].spec["evaluator"]["type"] == "url_match"  # a playable task, not a bare name
