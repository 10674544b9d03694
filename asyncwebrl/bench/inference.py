"""`asyncwebrl bench inference`: generated tokens/s of the embedded hf server at concurrency 1/8/32
(and 64 on a GPU).

One run, side by side: the same server subprocess (real HTTP, continuous batching) is driven by the
rollout client with 1, 8 and 32 requests in flight; every request is a MiniWoB-like prompt (one
160x210 screenshot + a short instruction, placeholders expanded on the client side) and generates
exactly `max_new_tokens` sampled tokens (ignore_eos), so tokens/s are comparable across levels.
Headline: speedup of concurrency 8 and 32 over one-at-a-time.

Knobs: model=default|PATH|random:qwen2.5-vl-3b (random-init weights of that shape, for a GPU),
device=cpu|cuda, dtype, max_new_tokens, requests (per level; at least waves x the concurrency),
waves (default 4: every client of a level sends that many requests back to back, so prefills of new
requests overlap the decoding of running ones as in a rollout, instead of one burst per level),
name (result file stem: the GPU run writes name=inference_gpu).

On a GPU the bench also reports the bandwidth bound of decoding: every decode step reads the text
decoder's weights once (vision tower excluded, tied embeddings counted once), so
steps/s <= HBM bandwidth / weight bytes, and tokens/s at concurrency c <= c x that. The bandwidth is
named: the H200 datasheet's 4.8 TB/s, and the device-to-device copy bandwidth measured in this run.
`share_of_bound_cN` = tokens_per_s_cN / (N x bound steps/s at the datasheet bandwidth).
"""

from __future__ import annotations

import asyncio
import io
import os
import random
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from asyncwebrl.bench.common import parse_overrides, print_table
from asyncwebrl.results import write_result

DATASHEET_HBM_BYTES_PER_S = {"NVIDIA H200": 4.8e12, "NVIDIA H100 80GB HBM3": 3.35e12}


@dataclass
class BandwidthBound:
    """The decode roofline of one model on one device (see module docstring)."""

    weight_bytes: int
    """bytes of the text decoder's weights (what one decode step reads)"""
    datasheet_bytes_per_s: float
    """the device's HBM bandwidth by its datasheet"""
    measured_copy_bytes_per_s: float
    """device-to-device copy bandwidth measured here (bytes read + written per second)"""

    @property
    def steps_per_s(self) -> float:
        return self.datasheet_bytes_per_s / self.weight_bytes

    @property
    def steps_per_s_measured(self) -> float:
        return self.measured_copy_bytes_per_s / self.weight_bytes


def decoder_weight_bytes(model_dir: str) -> int:
    """Bytes of the saved weights outside the vision tower (safetensors headers only, no loading)."""
    import glob

    from safetensors import safe_open

    total = 0
    for f in glob.glob(os.path.join(model_dir, "*.safetensors")):
        with safe_open(f, "pt") as sf:
            for k in sf.keys():
                if ".visual." in f".{k}" or k.startswith("visual"):
                    continue
                sl = sf.get_slice(k)
                n = 1
                for d in sl.get_shape():
                    n *= d
                total += n * {"BF16": 2, "F16": 2, "F32": 4}.get(sl.get_dtype(), 4)
    return total


def measure_copy_bandwidth(gib: float = 2.0, reps: int = 10) -> float:
    """Device-to-device copy bandwidth of GPU 0 (bytes read + written per second, median of reps)."""
    import torch

    n = int(gib * 2**30)
    a = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    b = torch.empty_like(a)
    b.copy_(a)
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1000)
    del a, b
    torch.cuda.empty_cache()
    return 2 * n / sorted(times)[len(times) // 2]

DEFAULTS: dict[str, Any] = {
    "model": "default",
    "device": "cpu",
    "dtype": "float32",
    "max_new_tokens": 24,
    "concurrency": None,  # [1, 8, 32] on a CPU, [1, 8, 32, 64] on a GPU
    "requests": 32,
    "waves": 4,  # each level runs at least waves x concurrency requests: the closed loop refills, so
                 # the figure is the engine's running rate, not one burst of simultaneous prefills
    "temperature": 1.0,
    "startup_timeout_s": 900,
    "name": "inference",
}

RANDOM_SHAPES: dict[str, dict[str, Any]] = {
    # Qwen2.5-VL-3B text + vision dimensions (published config), random weights
    "qwen2.5-vl-3b": {
        "base": "tiny-qwen2.5-vl",
        "text": {"hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36,
                 "num_attention_heads": 16, "num_key_value_heads": 2, "max_position_embeddings": 32768,
                 "layer_types": ["full_attention"] * 36, "rope_parameters": {
                     "mrope_section": [16, 24, 24], "rope_theta": 1000000.0, "rope_type": "default",
                     "type": "mrope"}},
        "vision": {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
                   "out_hidden_size": 2048, "fullatt_block_indexes": [7, 15, 23, 31]},
    },
    # the tiny test model's own shape, re-initialized (to rehearse GPU scripts on a CPU)
    "qwen2.5-vl-tiny": {"base": "tiny-qwen2.5-vl", "text": {}, "vision": {}},
}


def screenshot_png(seed: int) -> bytes:
    """A 160x210 MiniWoB-like screenshot: instruction bar, a few coloured buttons, some text."""
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    img = Image.new("RGB", (160, 210), (255, 255, 255))
    d = ImageDraw.Draw(img)
    d.rectangle([0, 0, 160, 50], fill=(255, 255, 160))
    d.text((4, 4), f"Click on the button {rng.randint(1, 9)}.", fill=(0, 0, 0))
    for i in range(rng.randint(2, 5)):
        x, y = rng.randint(5, 110), rng.randint(60, 180)
        d.rectangle([x, y, x + 40, y + 18], fill=tuple(rng.randint(0, 255) for _ in range(3)), outline=(0, 0, 0))
        d.text((x + 4, y + 4), f"b{i}", fill=(0, 0, 0))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def make_random_model(shape: str, out_dir: str, dtype: str) -> str:
    """Save a random-init model of a published shape (tokenizer/processor from the tiny base)."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    from asyncwebrl.models.prepare import resolve_model_path

    spec = RANDOM_SHAPES[shape]
    base = resolve_model_path(spec["base"])
    cfg = AutoConfig.from_pretrained(base)
    for k, v in spec["text"].items():
        setattr(cfg.text_config, k, v)
    for k, v in spec["vision"].items():
        setattr(cfg.vision_config, k, v)
    cfg.tie_word_embeddings = cfg.text_config.tie_word_embeddings = True
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForImageTextToText.from_config(cfg, dtype=getattr(torch, dtype))
    model.save_pretrained(out_dir)
    for f in os.listdir(base):
        if not f.startswith("model") and not f.startswith("config"):
            shutil.copy(os.path.join(base, f), out_dir)
    del model
    return out_dir


def build_prompts(model: str, n: int) -> tuple[list[list[int]], list[bytes]]:
    from PIL import Image

    from asyncwebrl.models.vlm import VLMAdapter

    ad = VLMAdapter(model)
    ids, images = [], []
    for i in range(n):
        png = screenshot_png(i)
        msgs = [{"role": "user", "content": [
            {"type": "image"},
            {"type": "text", "text": f"Task {i}: click the button named in the yellow bar. Answer as click [N]."},
        ]}]
        ids.append(ad.encode(ad.chat_text(msgs), [Image.open(io.BytesIO(png))]).input_ids)
        images.append(png)
    return ids, images


async def run_level(client, concurrency: int, n_requests: int, prompts, images, sampling) -> dict[str, Any]:
    sem = asyncio.Semaphore(concurrency)
    lat: list[float] = []
    tokens = 0

    async def one(i: int) -> None:
        nonlocal tokens
        async with sem:
            k = i % len(prompts)
            out = await client.agenerate(prompts[k], [images[k]], sampling, rid=f"c{concurrency}-{i}")
            tokens += len(out.output_ids)
            lat.append(out.latency_s)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n_requests)))
    wall = time.perf_counter() - t0
    return {"concurrency": concurrency, "requests": n_requests, "tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall, "mean_latency_s": sum(lat) / len(lat)}


def main(overrides: list[str]) -> int:
    from asyncwebrl.inference.client import InferenceClient
    from asyncwebrl.scheduling.servers import launch_server, wait_healthy

    cfg = parse_overrides(overrides, DEFAULTS)
    tmp = None
    model = cfg["model"]
    if str(model).startswith("random:"):
        tmp = tempfile.mkdtemp(prefix="asyncwebrl-randmodel-")
        model = make_random_model(model.split(":", 1)[1], tmp, cfg["dtype"])
    on_gpu = str(cfg["device"]).startswith("cuda")
    levels = [int(c) for c in (cfg["concurrency"] or ([1, 8, 32, 64] if on_gpu else [1, 8, 32]))]
    bound = None
    if on_gpu:
        import torch

        name = torch.cuda.get_device_name(0)
        bound = BandwidthBound(weight_bytes=decoder_weight_bytes(model),
                               datasheet_bytes_per_s=DATASHEET_HBM_BYTES_PER_S.get(name, 4.8e12),
                               measured_copy_bytes_per_s=measure_copy_bandwidth())
    load_before = os.getloadavg()[0]
    prompts, images = build_prompts(model, 16)
    log_path = os.path.join(tempfile.gettempdir(), f"asyncwebrl-bench-inference-{os.getpid()}.log")
    srv = launch_server(wait=False, model=model, device=cfg["device"], dtype=cfg["dtype"],
                                  max_batch_size=max(levels), log_path=log_path)
    rows = []
    info: dict[str, Any] = {}
    try:
        wait_healthy(srv.address, cfg["startup_timeout_s"], proc=srv)
        sampling = {"max_new_tokens": cfg["max_new_tokens"], "temperature": cfg["temperature"], "ignore_eos": True}

        async def drive() -> None:
            client = InferenceClient([srv.address], timeout_s=1800, max_retries=0)
            try:
                await run_level(client, 2, 2, prompts, images, sampling)  # warm-up
                for c in levels:
                    rows.append(await run_level(client, c, max(int(cfg["requests"]), int(cfg["waves"]) * c), prompts, images, sampling))
            finally:
                import aiohttp

                auth = {"Authorization": f"Bearer {srv.api_key}"} if srv.api_key else {}
                async with aiohttp.ClientSession(headers=auth) as http, \
                        http.get(f"{srv.address}/get_server_info") as resp:
                    info.update(await resp.json())
                await client.aclose()

        asyncio.run(drive())
    finally:
        srv.stop()
        if tmp:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    by_c = {r["concurrency"]: r for r in rows}
    figures: dict[str, Any] = {f"tokens_per_s_c{c}": round(r["tokens_per_s"], 2) for c, r in by_c.items()}
    figures.update({f"mean_latency_s_c{c}": round(r["mean_latency_s"], 3) for c, r in by_c.items()})
    base = by_c.get(1)
    for c in levels:
        if base and c != 1:
            figures[f"speedup_c{c}_over_c1"] = round(by_c[c]["tokens_per_s"] / base["tokens_per_s"], 2)
    figures["prompt_tokens"] = len(prompts[0])
    stats = info.get("stats", {})
    figures["engine"] = info.get("engine", "?")
    figures["engine_stats"] = {k: stats.get(k) for k in ("graphs", "compiled", "capture_s", "prefill_batches",
                                                          "prefills", "steps", "prefill_s", "decode_s",
                                                          "batched_vision_attention", "lean_prefill",
                                                          "lean_prefill_min_cosine") if k in stats}
    if bound is not None:
        figures["decoder_weight_gb"] = round(bound.weight_bytes / 1e9, 3)
        figures["hbm_bandwidth_datasheet_tb_s"] = bound.datasheet_bytes_per_s / 1e12
        figures["hbm_copy_bandwidth_measured_tb_s"] = round(bound.measured_copy_bytes_per_s / 1e12, 3)
        figures["bound_steps_per_s"] = round(bound.steps_per_s, 1)
        figures["bound_steps_per_s_measured_bw"] = round(bound.steps_per_s_measured, 1)
        for c, r in by_c.items():
            figures[f"share_of_bound_c{c}"] = round(r["tokens_per_s"] / (c * bound.steps_per_s), 3)
    config = {**cfg, "concurrency": levels, "model": cfg["model"], "server": "hf (subprocess, HTTP)", "image": "160x210 PNG",
              "note": "tokens/s of generated tokens; CPU runs share cores between server and client",
              "load_avg_1m_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)]}
    write_result(cfg["name"], config, figures)
    headline = ", ".join(f"c{c}/c1 = {figures[f'speedup_c{c}_over_c1']}x" for c in levels if c != 1 and base)
    print_table(rows, f"hf server tokens/s speedup over one-at-a-time: {headline}")
    return 0
