"""The `asyncwebrl` command: train, serve, eval, bench, view, prepare-model.

Every subcommand that runs the system takes `--config FILE` plus dotted overrides
(`rollout.max_head_offpolicyness=4`); the config is validated before anything starts.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from asyncwebrl.configtree import ConfigError
from asyncwebrl.net import LOOPBACK

BENCHMARKS = {
    "inference": ("asyncwebrl.bench.inference", "tokens/s of the embedded server at concurrency 1/8/32"),
    "pool": ("asyncwebrl.bench.pool", "async everlasting pool vs synchronous pool (synthetic env)"),
    "env": ("asyncwebrl.bench.env", "environment steps/s vs a raw Playwright loop"),
    "pixels": ("asyncwebrl.bench.pixels", "PixelStore vs pixels inside trajectories in Ray's object store"),
    "weightsync": ("asyncwebrl.bench.weightsync", "weight refresh vs the raw broadcast floor"),
    "train": ("asyncwebrl.bench.train", "the trainer at the hardware: tokens/s, MFU and time split of train_step"),
    "e2e": ("asyncwebrl.bench.e2e", "end-to-end async vs sync training throughput"),
    "soak": ("asyncwebrl.bench.soak", "memory over 10,000 MiniWoB episodes"),
    "clip": ("asyncwebrl.bench.clip", "clip rate of decoupled vs coupled PPO at eta = 1, 2, 4 (same batches)"),
    "curriculum": ("asyncwebrl.bench.curriculum", "uniform vs adaptive task sampling, greedy eval success"),
    "warmstart": ("asyncwebrl.bench.warmstart", "greedy eval success of the base model vs after the BC warm start"),
    "multinode": ("asyncwebrl.bench.multinode", "a short training run on a two-node Ray cluster (network namespace)"),
    "longrun": ("asyncwebrl.bench.longrun", "200+ training steps through controller and trainer rank: PixelStore bytes"),
    "readme": ("asyncwebrl.bench.report", "regenerate the table in docs/benchmarks.md from bench/results"),
}


def _config(args):
    from asyncwebrl.config import load_run_config

    return load_run_config(args.config, args.overrides)


def cmd_train(args) -> int:
    if args.help_config:
        from asyncwebrl.config import config_reference

        print(config_reference())
        return 0
    cfg = _config(args)
    from asyncwebrl.controller.main import run_training

    record = (args.record_as or "train-default") if args.record else None
    if args.record_as and not args.record:
        print("--record-as needs --record", file=sys.stderr)
        return 2
    run_training(cfg, record=record)
    return 0


def cmd_serve(args) -> int:
    from asyncwebrl.inference.server import serve_main

    return serve_main(args)


def cmd_eval(args) -> int:
    cfg = _config(args)
    from asyncwebrl.evaluation.evaluate import eval_main

    return eval_main(cfg, args.checkpoint)


def cmd_bench(args) -> int:
    if args.name not in BENCHMARKS:
        print(f"unknown benchmark '{args.name}'; choose one of: {', '.join(BENCHMARKS)}", file=sys.stderr)
        return 2
    module = importlib.import_module(BENCHMARKS[args.name][0])
    return module.main(args.overrides) or 0


def cmd_view(args) -> int:
    from asyncwebrl.view.report import view_main

    return view_main(args)


def cmd_record_screens(args) -> int:
    from asyncwebrl.web.record import record_main

    return record_main(args.out, args.episodes, args.tasks, args.seed, args.width, args.height)


def cmd_record_latency(args) -> int:
    from asyncwebrl.bench.latency import record_latency_main

    return record_latency_main(args.out, args.episodes, args.concurrency, args.tasks, args.seed)


def cmd_prepare_model(args) -> int:
    from asyncwebrl.models.prepare import prepare_all

    for name, path in prepare_all(force=args.force, tiny=not args.default_only).items():
        print(f"{name}: {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="asyncwebrl",
        description="Asynchronous multi-step RL for visual web agents (see README.md and SPEC).",
    )
    sub = p.add_subparsers(dest="command", required=True)

    def with_config(sp):
        sp.add_argument("--config", default=None, help="YAML config file (default: the embedded default)")
        sp.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rollout.max_head_offpolicyness=4")

    t = sub.add_parser("train", help="run PPO training (async everlasting pool, or rollout.mode=sync)")
    with_config(t)
    t.add_argument("--help-config", action="store_true", help="list every config key with its meaning")
    t.add_argument("--record", action="store_true",
                   help="also write the run summary to bench/results/train-default.json (or --record-as NAME)")
    t.add_argument("--record-as", metavar="NAME", default=None, help="with --record: bench/results/NAME.json")
    t.set_defaults(func=cmd_train)

    s = sub.add_parser("serve", help="start an inference server speaking SGLang's native HTTP API")
    s.add_argument("--backend", choices=["hf"], default="hf", help="hf = embedded transformers engine")
    s.add_argument("--model", default="default", help="model folder, hub id, or 'default'")
    s.add_argument("--host", default=LOOPBACK, help="bind address (loopback by default)")
    s.add_argument("--port", type=int, default=30000)
    s.add_argument("--api-key", default=None,
                   help="the key (visible in the process list: prefer $ASYNCWEBRL_API_KEY or --api-key-file); "
                        "without any, control endpoints get a fresh key written to a 0600 file")
    s.add_argument("--api-key-file", default=None, help="read the key from this file (mode 600)")
    s.add_argument("--key-scope", choices=["control", "all"], default=None,
                   help="which endpoints need the key: control ones only, or all but /health "
                        "(default: all when a key is given, control otherwise)")
    s.add_argument("--weights-root", action="append", default=[],
                   help="update_weights_from_disk loads only from folders under this (repeatable)")
    s.add_argument("--trainer-address", action="append", default=[],
                   help="host init_weights_update_group may dial besides loopback (repeatable)")
    s.add_argument("--allowed-host", action="append", default=[],
                   help="a Host name this server is reached by, besides IP literals and the machine's names")
    s.add_argument("--allow-auto-truncate", action="store_true",
                   help="clamp max_new_tokens to the context instead of refusing (SGLang's flag)")
    s.add_argument("--max-body-mb", type=float, default=32.0, help="largest /generate body")
    s.add_argument("--max-images", type=int, default=16, help="images per prompt")
    s.add_argument("--max-image-pixels", type=int, default=4096 * 4096, help="pixels of one image")
    s.add_argument("--cost", action="append", default=[], metavar="KEY=VALUE",
                   help="a cost limit of /generate (keys of inference.cost: max_prompts, memory_budget_bytes, "
                        "light_client_prompts, ...; repeatable; after $ASYNCWEBRL_COST_LIMITS)")
    s.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    s.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    s.add_argument("--max-batch-size", type=int, default=32)
    s.add_argument("--max-context-len", type=int, default=4096)
    s.add_argument("--threads", type=int, default=0, help="torch threads of a CPU server (0 = 1)")
    s.add_argument("--seed", type=int, default=0, help="sampling seed")
    s.add_argument("--weight-version", default="0", help="initial weight version")
    s.add_argument("--weight-sync-timeout", type=float, default=None,
                   help="seconds before a weight-update group join or broadcast fails "
                        "(default: $ASYNCWEBRL_WEIGHT_SYNC_TIMEOUT_S or 120)")
    s.add_argument("--parent-pid", type=int, default=None,
                   help="exit when this process is no longer the server's parent (launchers set it)")
    s.set_defaults(func=cmd_serve)

    e = sub.add_parser("eval", help="evaluate a checkpoint (or the base model) on a task set")
    with_config(e)
    e.add_argument("--checkpoint", default=None, help="checkpoint folder (default: actor.path)")
    e.set_defaults(func=cmd_eval)

    b = sub.add_parser(
        "bench",
        help="run a benchmark; writes bench/results/NAME.json",
        description="Benchmarks: " + "; ".join(f"{k}: {v[1]}" for k, v in BENCHMARKS.items()),
    )
    b.add_argument("name", help="one of: " + ", ".join(BENCHMARKS))
    b.add_argument("overrides", nargs="*", help="benchmark-specific key=value overrides")
    b.set_defaults(func=cmd_bench)

    v = sub.add_parser("view", help="write (and optionally serve) the HTML report of a run directory")
    v.add_argument("run_dir")
    v.add_argument("--serve", action="store_true", help="serve the report on the loopback address")
    v.add_argument("--port", type=int, default=8765)
    v.set_defaults(func=cmd_view)

    r = sub.add_parser("record-screens", help="save real MiniWoB++ screenshots for the synthetic env to replay")
    r.add_argument("out", help="folder to write NNNN-TASK-sSEED-kSTEP.png files into")
    r.add_argument("--episodes", type=int, default=24)
    r.add_argument("--tasks", default="miniwob-easy", help="task subset or comma-separated task names")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--width", type=int, default=160, help="viewport width (1280 for full-size pages)")
    r.add_argument("--height", type=int, default=210, help="viewport height (768 for full-size pages)")
    r.set_defaults(func=cmd_record_screens)

    rl = sub.add_parser("record-latency", help="time page loads, actions and session warm-up on real Chromium "
                                               "(a JSON file the synthetic env replays)")
    rl.add_argument("out", help="JSON file to write")
    rl.add_argument("--episodes", type=int, default=48)
    rl.add_argument("--concurrency", type=int, default=8, help="sessions at a time")
    rl.add_argument("--tasks", default="miniwob-easy", help="task subset or comma-separated task names")
    rl.add_argument("--seed", type=int, default=0)
    rl.set_defaults(func=cmd_record_latency)

    pm = sub.add_parser("prepare-model", help="build the default model (and tiny Qwen test models) offline")
    pm.add_argument("--force", action="store_true", help="rebuild even if present")
    pm.add_argument("--default-only", action="store_true", help="skip the tiny Qwen test models")
    pm.set_defaults(func=cmd_prepare_model)
    return p


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)  # unwinds: every `finally` stops what its command started


def main(argv: list[str] | None = None) -> int:
    import signal

    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:
        if e.name and e.name.startswith("asyncwebrl."):
            print(f"'{args.command}' is not yet implemented ({e.name} missing)", file=sys.stderr)
            return 3
        raise


if __name__ == "__main__":
    sys.exit(main())
