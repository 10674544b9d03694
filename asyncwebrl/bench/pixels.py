"""`asyncwebrl bench pixels`: the PixelStore vs pixels inside trajectories in Ray's object store.

One run, side by side. Screenshots are real page renders (headless Chromium: the demo site at
1280x768 and MiniWoB++ task pages at 160x210; drawn stand-ins only if Chromium is unavailable, named
so in the JSON). At 16, 64 and 256 concurrent rollouts, Ray worker actors play episodes of
`steps` steps; every step takes a screenshot and either puts it into the PixelStore actor and records
the key (`store`) or keeps the PNG in `StepSample.pixels` (`object_store`). Finished trajectories go
to the driver as actor-method returns, the path rollout groups take to the controller. Measured:
- bytes through Ray's object store / RPC per trajectory step (serialized size of what the driver
  receives, and of what the workers sent to the store actor, which stays on the node);
- store memory per screenshot vs the processed fp32 pixel_values of the model's image processor;
- put / get latency; trainer batch-assembly time (fetch the batch's pixels + decode PNGs);
- whether Ray's object store spilled (`Spilled` in Ray's memory summary).
"""

from __future__ import annotations

import io
import pickle
import random
import re
import statistics
import time
from pathlib import Path
from typing import Any

from asyncwebrl.bench.common import parse_overrides, print_table
from asyncwebrl.pixelstore.base import PixelStore
from asyncwebrl.results import write_result

DEFAULTS: dict[str, Any] = {
    "concurrency": [16, 64, 256],
    "steps": 4,
    "workers": 2,
    "batch_rollouts": 16,
    "object_store_mb": 1024,
    "store_capacity_mb": 1024,
}

PAGE_SIZE = (1280, 768)
MINIWOB_SIZE = (160, 210)
MINIWOB_TASKS = ["click-button", "click-dialog", "click-link", "enter-text", "book-flight", "click-checkboxes",
                 "social-media", "email-inbox"]


def render_screenshots() -> tuple[dict[str, list[bytes]], str]:
    """{'page': [...1280x768 PNGs], 'miniwob': [...160x210 PNGs]} and how they were made."""
    try:
        return _render_chromium(), "chromium renders (demo site + generated shop/news pages at 1280x768, MiniWoB++ task pages at 160x210)"
    except Exception as e:  # noqa: BLE001 - no browser on this box: drawn stand-ins, named as such
        return _drawn(), f"drawn stand-ins (Chromium unavailable: {type(e).__name__})"


def rich_page_html(seed: int) -> str:
    """A shop/news-like page: nav, text columns, and product cards with photo-like (noisy) images,
    the content that makes real screenshots weigh about 0.1 MB or more as PNG."""
    rng = random.Random(seed)
    words = ["deal", "laptop", "shipping", "review", "news", "sport", "garden", "phone", "travel", "price",
             "weather", "recipe", "market", "music", "camera", "update", "account", "search"]

    def text(n: int) -> str:
        return " ".join(rng.choice(words) for _ in range(n))

    cards = "".join(
        f'<div class="card"><canvas width="180" height="110" data-s="{rng.randrange(10**6)}"></canvas>'
        f'<b>{text(3)}</b><p>{text(14)}</p><button>Add to cart</button> <span>${rng.randrange(5, 900)}.99</span></div>'
        for _ in range(8)
    )
    nav = "".join(f"<a href='#'>{w}</a>" for w in rng.sample(words, 8))
    return f"""<html><head><style>
body{{font-family:sans-serif;margin:0;background:#f4f4f4}} nav{{background:#{rng.randrange(0x222222, 0x446688):06x};padding:10px}}
nav a{{color:#fff;margin:0 12px}} .grid{{display:grid;grid-template-columns:repeat(4,1fr);gap:12px;padding:12px}}
.card{{background:#fff;padding:8px;border-radius:6px;font-size:13px}} aside{{padding:12px;font-size:12px;color:#333}}
</style></head><body><nav>{nav}<input placeholder="Search {text(2)}"></nav>
<h2 style="margin:12px">{text(6)}</h2><div class="grid">{cards}</div><aside>{text(120)}</aside>
<script>
for (const c of document.querySelectorAll('canvas')) {{
  let s = +c.dataset.s; const r = () => (s = (s * 1103515245 + 12345) % 2147483648) / 2147483648;
  const g = c.getContext('2d'), im = g.createImageData(c.width, c.height);
  const base = [r() * 255, r() * 255, r() * 255];
  for (let i = 0; i < im.data.length; i += 4) {{
    const y = (i / 4 / c.width) | 0, v = 40 * Math.sin(y / 9) + 10 * r();
    im.data[i] = base[0] + v; im.data[i + 1] = base[1] + v; im.data[i + 2] = base[2] + v; im.data[i + 3] = 255;
  }}
  g.putImageData(im, 0, 0);
}}
</script></body></html>"""


def _render_chromium() -> dict[str, list[bytes]]:
    import asyncio

    from playwright.async_api import async_playwright

    import asyncwebrl.web as web_pkg

    demo = Path(web_pkg.__file__).parent / "demo_site"
    import miniwob

    mw = Path(miniwob.__file__).parent / "html" / "miniwob"
    pages = sorted(demo.glob("*.html"))
    tasks = [mw / f"{t}.html" for t in MINIWOB_TASKS if (mw / f"{t}.html").exists()]
    if not pages or not tasks:
        raise FileNotFoundError("demo site or MiniWoB HTML not found")

    async def go() -> dict[str, list[bytes]]:
        async with async_playwright() as p:
            browser = await p.chromium.launch(executable_path="/usr/lib/chromium/chromium-headless-shell",
                                              args=["--no-sandbox", "--disable-gpu"])
            out: dict[str, list[bytes]] = {"page": [], "miniwob": []}
            for kind, files, (w, h) in (("page", pages, PAGE_SIZE), ("miniwob", tasks, MINIWOB_SIZE)):
                ctx = await browser.new_context(viewport={"width": w, "height": h})
                page = await ctx.new_page()
                for i, f in enumerate(files):
                    await page.goto(f.as_uri(), wait_until="load", timeout=15000)
                    if kind == "miniwob":  # show the task itself, not the idle start screen
                        await page.evaluate("s => { try { Math.seedrandom(s); core.startEpisodeReal(); } catch (e) {} }", i)
                    await page.wait_for_timeout(100)
                    out[kind].append(await page.screenshot(type="png"))
                if kind == "page":  # the plain demo pages are light; real sites carry photos and dense text
                    for seed in range(6):
                        await page.set_content(rich_page_html(seed), wait_until="load", timeout=15000)
                        out[kind].append(await page.screenshot(type="png"))
                await ctx.close()
            await browser.close()
            return out

    return asyncio.run(asyncio.wait_for(go(), 120))


def _drawn() -> dict[str, list[bytes]]:
    from PIL import Image, ImageDraw

    out: dict[str, list[bytes]] = {"page": [], "miniwob": []}
    for kind, (w, h) in (("page", PAGE_SIZE), ("miniwob", MINIWOB_SIZE)):
        for s in range(6):
            rng = random.Random(s)
            img = Image.new("RGB", (w, h), (255, 255, 255))
            d = ImageDraw.Draw(img)
            for y in range(5, h - 12, 14):
                d.text((8, y), " ".join(rng.choice(["lorem", "ipsum", "web", "agent", "click"]) for _ in range(w // 40)),
                       fill=(rng.randrange(80), rng.randrange(80), rng.randrange(80)))
            buf = io.BytesIO()
            img.save(buf, format="PNG")
            out[kind].append(buf.getvalue())
    return out


class EpisodeWorker:
    """Ray actor body: plays `n` rollouts of `steps` steps concurrently (threads) and returns them."""

    def __init__(self, shots: dict[str, list[bytes]], store: PixelStore):
        self.shots = shots
        self.store = store

    def run(self, n: int, steps: int, kind: str, mode: str, seed: int) -> tuple[list[Any], list[float], int]:
        from concurrent.futures import ThreadPoolExecutor

        from asyncwebrl.records import StepSample, Trajectory, new_id

        shots = self.shots[kind]
        put_lat: list[float] = []
        sent = 0

        def episode(i: int) -> Trajectory:
            nonlocal sent
            rng = random.Random(seed * 100_003 + i)
            samples = []
            for _ in range(steps):
                # a distinct object per step, as every real screenshot is (pickle would share repeats)
                png = bytes(bytearray(shots[rng.randrange(len(shots))]))
                if mode == "store":
                    t0 = time.perf_counter()
                    key = self.store.put(png)
                    put_lat.append(time.perf_counter() - t0)
                    sent += len(png)
                    samples.append(StepSample(prompt_ids=list(range(200)), output_ids=[1, 2, 3],
                                              behave_logprobs=[-0.1] * 3, versions=[0] * 3, pixel_keys=[key]))
                else:
                    samples.append(StepSample(prompt_ids=list(range(200)), output_ids=[1, 2, 3],
                                              behave_logprobs=[-0.1] * 3, versions=[0] * 3, pixels=[png]))
                time.sleep(0.001)
            return Trajectory(traj_id=new_id("t-"), task_id="bench", steps=samples, reward=0.0)

        with ThreadPoolExecutor(max_workers=min(n, 32)) as pool:
            trajs = list(pool.map(episode, range(n)))
        return trajs, put_lat, sent


def _spilled_mib() -> float:
    import ray
    from ray._private.internal_api import memory_summary

    # name this cluster: with no address Ray refuses when several instances run on the machine
    summary = memory_summary(address=ray.get_runtime_context().gcs_address, stats_only=True)
    m = re.search(r"Spilled ([\d.]+) MiB", summary)
    return float(m.group(1)) if m else 0.0


def _pctl(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _assemble(trajs: list[Any], store: PixelStore, mode: str) -> tuple[float, float, int]:
    """Trainer side: pixels of every step of the batch -> decoded images. Returns (fetch s, decode s, missing)."""
    from PIL import Image

    t0 = time.perf_counter()
    if mode == "store":
        keys = [k for t in trajs for k in t.all_pixel_keys()]
        blobs = store.get(keys)
    else:
        blobs = [p for t in trajs for s in t.steps for p in (s.pixels or [])]
    t1 = time.perf_counter()
    missing = sum(b is None for b in blobs)
    for b in blobs:
        if b is not None:
            Image.open(io.BytesIO(b)).convert("RGB")
    return t1 - t0, time.perf_counter() - t1, missing


def fp32_pixel_bytes(shots: dict[str, list[bytes]]) -> dict[str, Any]:
    """Processed fp32 input per screenshot: measured with the prepared models' processors, and the
    production Qwen3-VL figure (patch 16, temporal patch 2, full resolution) computed from its geometry."""
    from PIL import Image

    from asyncwebrl.models.prepare import resolve_model_path
    from asyncwebrl.models.vlm import VLMAdapter

    out: dict[str, Any] = {}
    for name in ("default", "tiny-qwen3-vl"):
        try:
            a = VLMAdapter(resolve_model_path(name))
        except Exception as e:  # noqa: BLE001
            out[name] = f"unavailable: {e}"
            continue
        for kind, blobs in shots.items():
            img = Image.open(io.BytesIO(blobs[0])).convert("RGB")
            msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x"}]}]
            enc = a.encode(a.chat_text(msgs), [img])
            pv = enc.images.get("pixel_values")
            out[f"{name}_{kind}"] = int(pv.numel() * 4) if pv is not None else 0
    for kind, (w, h) in (("page", PAGE_SIZE), ("miniwob", MINIWOB_SIZE)):
        pw, ph = (w + 31) // 32 * 2, (h + 31) // 32 * 2  # patches of 16 px, grid rounded to the 2x2 merge
        out[f"qwen3vl_fullres_{kind}"] = pw * ph * 3 * 2 * 16 * 16 * 4
    return out


def main(overrides: list[str]) -> int:
    knobs = parse_overrides(overrides, DEFAULTS)
    import ray

    from asyncwebrl.pixelstore.ray_store import PixelStoreClient, launch_ray_stores

    shots, shot_source = render_screenshots()
    png_mean = {k: statistics.mean(len(b) for b in v) for k, v in shots.items()}
    fp32 = fp32_pixel_bytes(shots)
    ray.init(num_cpus=max(2, knobs["workers"]), include_dashboard=False, log_to_driver=False,
             object_store_memory=int(knobs["object_store_mb"]) * 2**20, configure_logging=False)
    rows: list[dict[str, Any]] = []
    figures: dict[str, Any] = {"screenshots": shot_source, "png_bytes_mean": png_mean, "fp32_pixel_values_bytes": fp32}
    try:
        handles = launch_ray_stores("bench-pixels", int(knobs["store_capacity_mb"]) * 2**20, 120.0)
        store = PixelStoreClient("bench-pixels", handles, put_timeout_s=120.0)
        worker_cls = ray.remote(EpisodeWorker).options(num_cpus=0.5, max_concurrency=2)
        workers = [worker_cls.remote(shots, store) for _ in range(knobs["workers"])]
        for kind in ("page", "miniwob"):
            for n in knobs["concurrency"]:
                for mode in ("store", "object_store"):
                    spill0 = _spilled_mib()
                    per = [n // len(workers) + (1 if i < n % len(workers) else 0) for i in range(len(workers))]
                    t0 = time.perf_counter()
                    refs = [w.run.remote(k, knobs["steps"], kind, mode, 17 + i) for i, (w, k) in enumerate(zip(workers, per, strict=True))]
                    results = ray.get(refs, timeout=600)
                    wall = time.perf_counter() - t0
                    trajs = [t for r in results for t in r[0]]
                    put_lat = [x for r in results for x in r[1]]
                    to_store = sum(r[2] for r in results)
                    steps = sum(len(t.steps) for t in trajs)
                    via_ray = sum(len(pickle.dumps(r[0], protocol=5)) for r in results)
                    batch = trajs[: knobs["batch_rollouts"]]
                    tg0 = time.perf_counter()
                    fetch_s, decode_s, missing = _assemble(batch, store, mode)
                    get_s = time.perf_counter() - tg0
                    mem = store.stats()
                    items = max(1, mem["items"])
                    row = {
                        "shots": kind, "rollouts": n, "mode": mode,
                        "ray_bytes_per_step": via_ray / steps,
                        "store_bytes_per_shot": mem["bytes"] / items if mode == "store" else 0.0,
                        "put_p50_ms": 1000 * _pctl(put_lat, 0.5), "put_p99_ms": 1000 * _pctl(put_lat, 0.99),
                        "assemble_ms": 1000 * (fetch_s + decode_s), "fetch_ms": 1000 * fetch_s,
                        "spilled_mib": _spilled_mib() - spill0, "wall_s": wall,
                    }
                    row["node_local_put_bytes_per_step"] = to_store / steps
                    row["missing"] = missing
                    row["get_batch_ms"] = 1000 * get_s
                    rows.append(row)
                    if mode == "store":
                        store.free([k for t in trajs for k in t.all_pixel_keys()])
                    del trajs, results, batch
        st = store.stats()
        store.kill_all()
        figures["store_final"] = {k: v for k, v in st.items() if k != "stores"}
    finally:
        ray.shutdown()

    def pick(kind: str, n: int, mode: str) -> dict[str, Any]:
        return next(r for r in rows if r["shots"] == kind and r["rollouts"] == n and r["mode"] == mode)

    ns = knobs["concurrency"]
    ref_n = 64 if 64 in ns else ns[len(ns) // 2]
    s_row, o_row = pick("page", ref_n, "store"), pick("page", ref_n, "object_store")
    figures.update({
        "object_store_bytes_per_step": s_row["ray_bytes_per_step"],
        "object_store_bytes_per_step_vanilla": o_row["ray_bytes_per_step"],
        "object_store_bytes_ratio_vanilla_over_store": o_row["ray_bytes_per_step"] / s_row["ray_bytes_per_step"],
        "store_bytes_per_screenshot_page": s_row["store_bytes_per_shot"],
        "fp32_over_store_bytes_qwen3vl_fullres_page": fp32["qwen3vl_fullres_page"] / max(1.0, s_row["store_bytes_per_shot"]),
        "put_p50_ms_page": s_row["put_p50_ms"], "put_p99_ms_page": s_row["put_p99_ms"],
        "assemble_ms_store_page": s_row["assemble_ms"], "assemble_ms_object_store_page": o_row["assemble_ms"],
        "spilled_mib_total": sum(r["spilled_mib"] for r in rows),
        "reference_rollouts": ref_n,
        "rows": rows,
    })
    write_result("pixels", knobs, figures)
    table = [{k: r[k] for k in ("shots", "rollouts", "mode", "ray_bytes_per_step", "store_bytes_per_shot",
                                "put_p50_ms", "put_p99_ms", "assemble_ms", "spilled_mib")} for r in rows]
    print(f"screenshots: {shot_source}; mean PNG bytes {png_mean}; fp32 pixel_values bytes {fp32}")
    print_table(table, f"object_store_bytes_per_step (store) = {s_row['ray_bytes_per_step']:.0f} B vs "
                       f"{o_row['ray_bytes_per_step']:.0f} B with pixels inside trajectories "
                       f"({figures['object_store_bytes_ratio_vanilla_over_store']:.0f}x less; 1280x768, {ref_n} rollouts)")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
