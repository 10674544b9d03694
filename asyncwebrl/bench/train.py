"""`asyncwebrl bench train`: the update engine at the hardware (issue 30).

Drives the production `FSDPActor` (one rank) through `train_step` — the pi_prox pass and the PPO
update — on a web-shaped batch: every sample holds one 160x210 screenshot fetched by key from a
PixelStore, a prompt of about 200 text tokens (150-230 words of instruction) and `out_len` generated
tokens, the shape of a web agent's step. It reports throughput, MFU and where the time goes.

Model FLOPs (the MFU numerator), stated once:
    flops_per_step = 8 x N x T
N = trainable non-embedding parameters (the language model without its tied embedding; the vision
tower is frozen and not counted), T = tokens of the batch (prompt + output, no padding counted).
8 = 2 (the pi_prox forward) + 6 (the training forward and backward). Attention score FLOPs and the
vision tower are left out (they are small at ~270 tokens per sample; leaving them out understates
the MFU). The pi_prox pass alone: 2 x N x T over its time.
MFU = flops_per_step / step time / peak: the datasheet's dense bf16 peak (H200 SXM: 989 TFLOP/s),
and, beside it, a bf16 8192^3 matmul measured in the same run (fp32 1024^3 on a CPU, where no
datasheet peak is used).

Shapes: `tiny` (tiny-qwen2.5-vl, CPU), `default` (the prepared default model with default.yaml's
actor settings: what `make train` steps), `3b` (a random-init Qwen2.5-VL-3B shape, the GPU headline).
One run writes bench/results/train.json (CPU) or train_gpu.json (CUDA) with every shape it ran.

Knobs (key=value): shapes, n_samples, out_len, steps, mb_max_tokens, prox_mb_max_tokens, packing,
recipe (auto | fp32 | mp | bf16), gradient_checkpointing, compile (auto | 1 | 0: actor.compile_layers, auto = its default), model (a folder, overrides the shape's),
out (result name), profile (one extra step, synchronized at phase boundaries, gives the time split;
the timed steps never synchronize inside the step), trace (a torch.profiler table of that step's
kernels, written beside the result).
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from asyncwebrl.bench.common import parse_overrides, print_table
from asyncwebrl.pixelstore.base import PixelStore
from asyncwebrl.results import write_result

H200_BF16_DENSE_TFLOPS = 989.0
"""NVIDIA H200 SXM datasheet, dense bf16 tensor-core peak (1,979 with sparsity)"""

DEFAULTS: dict[str, Any] = {
    "shapes": "auto", "n_samples": 0, "out_len": 16, "steps": 2, "mb_max_tokens": 0, "prox_mb_max_tokens": 0,
    "packing": True, "recipe": "auto", "gradient_checkpointing": False, "model": "", "out": "", "profile": True,
    "trace": False, "compile": "auto",
}

SHAPES: dict[str, dict[str, Any]] = {
    # name: model, samples, actor overrides
    "tiny": {"model": "tiny-qwen2.5-vl", "n_samples": 16, "actor": {"mb_max_tokens": 2048}},
    "default": {"model": "default", "n_samples": 8, "actor": {"mb_max_tokens": 2048, "ppo_n_minibatches": 2}},
    "3b": {"model": "random:qwen2.5-vl-3b", "n_samples": 256, "actor": {"mb_max_tokens": 8192}},
}

WORDS = ("click the button named submit in the dialog then type the name into the field and scroll down to "
         "find the link on the page before you answer").split()


@dataclass(kw_only=True)
class TimeSplit:
    """Seconds of one extra, profiled train_step, by phase: the device is synchronized at each
    boundary, so GPU work is charged to the phase that queued it (the step is slower than the timed
    ones by those synchronizations: `TrainBenchResult.profiled_step_s`)."""

    pixel_fetch_s: float
    image_processing_s: float
    """host decoding and processing of the screenshots (the part the device waits for)"""
    vision_s: float
    """the frozen vision tower over the step's screenshots, once per step (one rank with packing
    embeds them up front; otherwise it runs inside the first pass, charged to prox or forward)"""
    h2d_s: float
    forward_s: float
    backward_s: float
    optimizer_s: float
    prox_s: float
    """the whole pi_prox pass (its own host-to-device copies included)"""
    other_s: float
    """the rest of the step: sample preparation, loss arithmetic, metrics"""


@dataclass(kw_only=True)
class TrainBenchResult:
    """One shape's measurement: every figure measured in this run."""

    shape: str
    model: str
    device: str
    recipe: str
    """dtype of the parameters and AdamW state, and the compute (mp = fp32 master + bf16 compute)"""
    packing: bool
    mb_max_tokens: int
    n_samples: int
    tokens: int
    output_tokens: int
    nonembedding_trainable_params: int
    flops_per_step: float
    """8 x nonembedding_trainable_params x tokens (module docstring)"""
    step_s: float
    """the fastest of the timed train_steps (after one warm-up step; no synchronization inside them)"""
    steps_s: list[float]
    profiled_step_s: float | None
    """the extra step that measured `split` (synchronized at every phase boundary)"""
    tokens_per_s: float
    samples_per_s: float
    model_tflops_per_s: float
    peak_tflops: float | None
    """datasheet dense bf16 peak of the device (None on a CPU)"""
    matmul_tflops: float
    """a matmul measured in this run on this device (bf16 8192^3 on CUDA, fp32 1024^3 on CPU)"""
    mfu: float | None
    """model FLOPs per second over the datasheet peak"""
    mfu_vs_matmul: float
    prox_s: float
    prox_mfu: float | None
    """the pi_prox pass alone: 2 x N x T over its time in the profiled step, over the datasheet peak"""
    peak_mem_gib: float | None
    weights_changed_frac: float
    """share of the first trainable matrix's entries that one step changed (the recipe's updates land)"""
    split: TimeSplit
    loss: float
    extra: dict[str, Any] = field(default_factory=dict)


def web_shaped_samples(adapter, n: int, out_len: int, seed: int = 0,
                       store: PixelStore | None = None) -> list:
    """n web-shaped samples (module docstring); screenshots put into `store` (keys) or inline."""
    from asyncwebrl.bench.inference import screenshot_png
    from asyncwebrl.models.vlm import decode_image
    from asyncwebrl.records import TrainSample

    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        png = screenshot_png(seed * 100_003 + i)
        words = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(rng.randint(150, 230)))
        chat = adapter.chat_text([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": words}]}])
        ids = adapter.encode(chat, [decode_image(png)]).input_ids
        vocab = min(len(adapter.tokenizer), 30_000)
        output = torch.randint(10, vocab, (out_len,), generator=g).tolist()
        behave = (-torch.rand(out_len, generator=g) * 3 - 0.1).tolist()
        keys = store.put_batch([png]) if store is not None else []
        out.append(TrainSample(prompt_ids=ids, output_ids=output, behave_logprobs=behave, versions=[0] * out_len,
                               advantage=float(torch.randn(1, generator=g)), pixel_keys=keys,
                               pixels=None if store is not None else [png]))
    return out


def measure_matmul_tflops(device: torch.device) -> float:
    if device.type == "cuda":
        n, dt, reps = 8192, torch.bfloat16, 10
    else:
        n, dt, reps = 1024, torch.float32, 3
    a = torch.randn(n, n, device=device, dtype=dt)
    b = torch.randn(n, n, device=device, dtype=dt)
    for _ in range(2):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return 2 * n**3 * reps / (time.perf_counter() - t) / 1e12


def _model_path(name: str, device: torch.device) -> str:
    if name.startswith("random:"):
        import os
        import tempfile

        from asyncwebrl.bench.inference import make_random_model

        out = os.path.join(tempfile.gettempdir(), f"awrl-train-{name.split(':', 1)[1]}")
        if not os.path.isfile(os.path.join(out, "config.json")):
            make_random_model(name.split(":", 1)[1], out, "bfloat16")  # loaded as actor.dtype
        return out
    return name


def _actor_config(shape: dict[str, Any], knobs: dict[str, Any], model: str, device: torch.device):
    from asyncwebrl.training.config import ActorConfig

    kw: dict[str, Any] = dict(path=model, lr=1e-5, packing=bool(knobs["packing"]),
                              gradient_checkpointing=bool(knobs["gradient_checkpointing"]),
                              compile_layers=None if knobs["compile"] == "auto" else bool(knobs["compile"]))
    kw.update(shape["actor"])
    if knobs["mb_max_tokens"]:
        kw["mb_max_tokens"] = int(knobs["mb_max_tokens"])
    if knobs["prox_mb_max_tokens"]:
        kw["prox_mb_max_tokens"] = int(knobs["prox_mb_max_tokens"])
    recipe = knobs["recipe"]
    if recipe == "auto":
        recipe = "mp" if device.type == "cuda" else "fp32"
    if recipe == "mp":
        kw.update(dtype="float32", mixed_precision=True)
    elif recipe == "fp32":
        kw.update(dtype="float32", mixed_precision=False)
    elif recipe == "bf16":
        kw.update(dtype="bfloat16", mixed_precision=False, allow_low_precision_params=True)
    else:
        raise SystemExit(f"unknown recipe '{recipe}' (auto, fp32, mp, bf16)")
    return ActorConfig(**kw), recipe


def run_shape(name: str, knobs: dict[str, Any], device: torch.device, matmul_tflops: float) -> TrainBenchResult:
    from asyncwebrl.models.prepare import resolve_model_path
    from asyncwebrl.pixelstore.store import InProcessPixelStore
    from asyncwebrl.training.actor import FSDPActor

    shape = SHAPES[name]
    model = knobs["model"] or shape["model"]
    model = resolve_model_path(_model_path(model, device)) if not model.startswith("random:") else _model_path(model, device)
    cfg, recipe = _actor_config(shape, knobs, model, device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    actor = FSDPActor(cfg, 0, 1, device=str(device))
    actor.profile = False
    n = int(knobs["n_samples"]) or int(shape["n_samples"])
    store = InProcessPixelStore("bench-train", capacity_bytes=1 << 30)
    trainable = [(k, p) for k, p in actor.hf.named_parameters() if p.requires_grad]
    emb = actor.hf.get_input_embeddings().weight
    n_nonemb = sum(p.numel() for _, p in trainable if p is not emb)
    first = next(p for k, p in trainable if p.dim() == 2 and p is not emb)

    adapter = actor.adapter

    def batch(seed: int) -> list:
        # fresh samples (and store references) per step: a step consumes its batch
        return web_shaped_samples(adapter, n, int(knobs["out_len"]), seed=seed, store=store)

    def timed(samples: list, act: FSDPActor = actor) -> tuple[float, dict[str, float]]:
        if cuda:
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        m = act.train_step(samples, pixel_store=store)
        if cuda:
            torch.cuda.synchronize(device)
        return time.perf_counter() - t, m

    actor.train_step(batch(0), pixel_store=store)  # warm-up: allocator, kernels
    steps, metrics, before, best = [], {}, None, []
    for k in range(max(1, int(knobs["steps"]))):
        samples = batch(k + 1)
        before = first.detach().float().clone()
        dt, metrics = timed(samples)
        steps.append(dt)
        if dt == min(steps):
            best = samples
    changed = float(((first.detach().float() - before) != 0).float().mean())
    times: dict[str, float] = {}
    profiled = None
    if knobs["profile"]:
        # one more step on the same shape of batch, synchronized at every phase boundary: the split
        actor.profile = True
        trace = _trace(device) if knobs["trace"] else contextlib.nullcontext()
        with trace as prof:
            profiled, _ = timed(batch(10_000))
        times = dict(actor.times)
        actor.profile = False
        if prof is not None:
            _write_trace(prof, knobs["out"] or ("train_gpu" if cuda else "train"), name)
    tokens = sum(s.n_tokens for s in best)
    out_tokens = sum(len(s.output_ids) for s in best)
    step = min(steps)
    flops = 8.0 * n_nonemb * tokens
    peak = H200_BF16_DENSE_TFLOPS if cuda else None
    tflops = flops / step / 1e12
    prox = times.get("prox", 0.0)
    split = TimeSplit(
        pixel_fetch_s=times.get("pixel_fetch", 0.0), image_processing_s=times.get("image_processing", 0.0),
        vision_s=times.get("vision", 0.0), h2d_s=times.get("h2d", 0.0), forward_s=times.get("forward", 0.0),
        backward_s=times.get("backward", 0.0), optimizer_s=times.get("optimizer", 0.0), prox_s=prox, other_s=0.0)
    if profiled is not None:
        split.other_s = max(0.0, profiled - sum(v for k, v in dataclasses.asdict(split).items() if k != "other_s"))
    res = TrainBenchResult(
        shape=name, model=model, device=str(device), recipe=recipe, packing=actor.packing, mb_max_tokens=cfg.mb_max_tokens,
        n_samples=n, tokens=tokens, output_tokens=out_tokens, nonembedding_trainable_params=n_nonemb,
        flops_per_step=flops, step_s=step, steps_s=steps, profiled_step_s=profiled, tokens_per_s=tokens / step, samples_per_s=n / step,
        model_tflops_per_s=tflops, peak_tflops=peak, matmul_tflops=matmul_tflops,
        mfu=tflops / peak if peak else None, mfu_vs_matmul=tflops / matmul_tflops,
        prox_s=prox, prox_mfu=(2.0 * n_nonemb * tokens / prox / 1e12 / peak) if (peak and prox > 0) else None,
        peak_mem_gib=torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
        weights_changed_frac=changed, split=split, loss=float(metrics.get("loss", float("nan"))),
    )
    actor.close()
    del actor
    if cuda:
        torch.cuda.empty_cache()
    return res


def _trace(device: torch.device):
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    return profile(activities=acts, record_shapes=False)


def _write_trace(prof, out: str, shape: str) -> None:
    """The profiled step's kernel table (by device time), beside the result files."""
    from asyncwebrl.results import RESULTS_DIR

    key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=60)
    (RESULTS_DIR / f"{out}-{shape}-trace.txt").write_text(table)
    print(table)


def main(overrides: list[str]) -> int:
    knobs = parse_overrides(overrides, DEFAULTS)
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    shapes = knobs["shapes"]
    if shapes == "auto":
        shapes = "3b" if device.type == "cuda" else "tiny,default"
    names = [s.strip() for s in str(shapes).split(",") if s.strip()]
    for s in names:
        if s not in SHAPES:
            raise SystemExit(f"unknown shape '{s}'; choose from {', '.join(SHAPES)}")
    matmul = measure_matmul_tflops(device)
    results = [run_shape(s, knobs, device, matmul) for s in names]
    rows = [{"shape": r.shape, "recipe": r.recipe, "samples": r.n_samples, "tokens": r.tokens, "step_s": r.step_s,
             "tokens/s": r.tokens_per_s, "mfu": r.mfu if r.mfu is not None else r.mfu_vs_matmul,
             "prox_s": r.prox_s, "fwd_s": r.split.forward_s, "bwd_s": r.split.backward_s,
             "img_s": r.split.image_processing_s, "peak_GiB": r.peak_mem_gib, "changed": r.weights_changed_frac}
            for r in results]
    name = knobs["out"] or ("train_gpu" if device.type == "cuda" else "train")
    path = write_result(name, {**knobs, "device": str(device)},
                        {r.shape: dataclasses.asdict(r) for r in results})
    last = results[-1]
    mfu = f"MFU {last.mfu:.1%} of {last.peak_tflops:.0f} TFLOP/s" if last.mfu is not None else \
        f"{last.mfu_vs_matmul:.1%} of the measured matmul"
    print_table(rows, f"train ({last.shape}): {last.tokens_per_s:,.0f} tokens/s, {mfu}, step {last.step_s:.2f} s "
                      f"-> {path}")
    return 0
