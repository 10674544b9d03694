"""Qwen2.5-VL vision tower with static per-grid layouts, replayed from CUDA graphs (GPU prefill).

transformers' `Qwen2_5_VisionTransformerPretrainedModel.forward` rebuilds, on every call, the
window permutation, the rotary table and the cu_seqlens of its images with Python loops and host
reads, then runs 32 blocks eagerly: for one 160x210 screenshot that is ~38 ms of CPU on an H200 for
well under a millisecond of GPU work. Every screenshot of one viewport has the same grid, so all of
it is static:
- `Layout`: the tensors of one tuple of image grids (window index and its inverse, cos/sin of the
  2-D rotary embedding in window order, cu_seqlens of the images and of the windows, each carrying
  its `ChunkPlan` for models/vision_attention.py), built once and cached (bounded);
- `VisionRunner.forward(pixels, layout)`: the tower from the model's own modules (blocks, merger)
  over a layout: no host reads, so it can be captured. The patch embedding (a Conv3d whose stride is
  its kernel: one dot product per patch) runs as the equivalent linear map over the flattened patch
  (cuDNN's bf16 Conv3d is slow for this shape), when both agree on a test batch;
- graphs: when every image of a call has one grid g (the usual case), the call runs as the graph
  of (g, bucket) where bucket is the smallest of 1, 2, 4, ... that holds the images: pixels copied
  into the graph's static input (rows past the images keep stale pixels of whole images, which attend
  only within themselves and are cut from the output), replayed, outputs cloned. The first call with
  a grid captures all its buckets up to `max_graph_patches` patches (a one-time stall of ~2 s for a 3B-sized tower; `eager()` keeps
  one-off calls such as start-up checks from doing so); at most `max_grids` grids get graphs, others and mixed-grid calls run eagerly over their cached layout. Graphs read
  the parameters in place: `reset()` after any parameter was rebound;
- MLPs of an unaligned width run over padded weight copies (models/aligned_mlp.py: `aligned.refresh()`
  after any weight write).
Invariants: `install` replaces `visual.forward` only after the eager runner gave the same features
as transformers' own forward on two test layouts (else it leaves the model alone); the first graph
is checked against the eager runner on the same input. The return value mimics the original's
(a tensor, or a BaseModelOutputWithPooling whose pooler_output holds the merged features).
"""

from __future__ import annotations

import logging
import time
import types
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from asyncwebrl.models.aligned_mlp import AlignedMLPs, install_aligned_mlps
from asyncwebrl.models.vision_attention import chunk_plan

log = logging.getLogger(__name__)

Grid = tuple[int, int, int]


@dataclass
class Layout:
    """Static tensors of the vision tower for one tuple of image grids (see module docstring)."""

    grids: tuple[Grid, ...]
    patches: int
    merged: int
    window_index: torch.Tensor
    reverse: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    cu_full: torch.Tensor
    cu_window: torch.Tensor


@dataclass
class _Graph:
    """A captured tower for (grid, bucket): static input and outputs. On a CPU (tests) `graph` is None
    and a replay runs the eager tower into the same static buffers: the bucketing is what is tested."""

    graph: Any
    layout: Layout
    pixels: torch.Tensor
    hidden: torch.Tensor
    merged: torch.Tensor

    def replay(self, runner: VisionRunner) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.hidden, self.merged = runner.forward(self.pixels, self.layout)


def _window_index(grids: tuple[Grid, ...], merge: int, window: int) -> tuple[torch.Tensor, list[int]]:
    """Merged-patch order that makes each window contiguous, and the patch count of each window."""
    order, sizes, base = [], [], 0
    for t, h, w in grids:
        gh, gw = h // merge, w // merge
        idx = torch.arange(t * gh * gw).reshape(t, gh, gw)
        nh, nw = -(-gh // window), -(-gw // window)
        padded = F.pad(idx, (0, nw * window - gw, 0, nh * window - gh), value=-1)
        padded = padded.reshape(t, nh, window, nw, window).permute(0, 1, 3, 2, 4).reshape(t, nh * nw, -1)
        for frame in padded:
            for win in frame:
                real = win[win >= 0]
                if real.numel():
                    order.append(real + base)
                    sizes.append(int(real.numel()) * merge * merge)
        base += t * gh * gw
    return torch.cat(order), sizes


def _positions(grids: tuple[Grid, ...], merge: int) -> torch.Tensor:
    """(h, w) patch coordinates of every patch, in the patch order of the pixel rows."""
    out = []
    for t, h, w in grids:
        hh = torch.arange(h)[:, None].expand(h, w).reshape(h // merge, merge, w // merge, merge)
        ww = torch.arange(w)[None, :].expand(h, w).reshape(h // merge, merge, w // merge, merge)
        hw = torch.stack([hh.permute(0, 2, 1, 3).reshape(-1), ww.permute(0, 2, 1, 3).reshape(-1)], dim=-1)
        out.append(hw.repeat(t, 1))
    return torch.cat(out)


class VisionRunner:
    """A Qwen2.5-VL vision tower run over cached layouts, from CUDA graphs where it can (module docstring)."""

    def __init__(self, visual: torch.nn.Module, *, use_graphs: bool, max_images: int = 64,
                 max_layouts: int = 64, max_grids: int = 4, max_graph_patches: int = 16384):
        cfg = visual.config
        self.visual = visual
        self.merge = int(cfg.spatial_merge_size)
        self.window = int(cfg.window_size) // self.merge // int(cfg.patch_size)
        self.full_blocks = set(int(i) for i in cfg.fullatt_block_indexes)
        self.inv_freq = visual.rotary_pos_emb.inv_freq
        p0 = next(visual.parameters())
        self.device, self.dtype = p0.device, p0.dtype
        self.use_graphs = use_graphs
        self.buckets: list[int] = []
        b = 1
        while b < max_images:
            self.buckets.append(b)
            b *= 2
        self.buckets.append(max_images)
        self.max_layouts, self.max_grids = max_layouts, max_grids
        self.max_graph_patches = max_graph_patches
        """largest bucket x patches per image that gets a graph (its activations stay allocated): 64
        MiniWoB screenshots (192 patches each) fit, 64 full-page ones (~4,800) would hold many GB"""
        self._layouts: OrderedDict[tuple[Grid, ...], Layout] = OrderedDict()
        self._graphs: dict[tuple[Grid, int], _Graph] = {}
        self._graph_grids: set[Grid] = set()
        self.linear_patch = False
        self._pool = None
        self._checked = False
        self._out_type: type | None = None
        self.aligned: AlignedMLPs | None = None
        """padded MLP weight copies (models/aligned_mlp.py): refresh() after any weight write"""
        self.stats = {"vision_graph_calls": 0, "vision_eager_calls": 0, "vision_graphs": 0, "vision_capture_s": 0.0}

    # ---- layouts ----------------------------------------------------------------------------------
    def layout(self, grids: tuple[Grid, ...]) -> Layout:
        lay = self._layouts.get(grids)
        if lay is not None:
            self._layouts.move_to_end(grids)
            return lay
        dev, unit = self.device, self.merge * self.merge
        win_idx, win_sizes = _window_index(grids, self.merge, self.window)
        pos = _positions(grids, self.merge).to(dev)
        freqs = pos[..., None].float() * self.inv_freq.float().to(dev)  # [S, 2, dim/4]
        freqs = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
        emb = torch.cat([freqs, freqs], dim=-1)
        patches = pos.shape[0]
        win_idx = win_idx.to(dev)
        patch_order = (win_idx[:, None] * unit + torch.arange(unit, device=dev)[None, :]).reshape(-1)
        cos, sin = emb.cos()[patch_order], emb.sin()[patch_order]
        full_sizes = [h * w for t, h, w in grids for _ in range(t)]

        def cu(sizes: list[int]) -> torch.Tensor:
            c = torch.tensor([0] + sizes, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(dev)
            c._awrl_plan = chunk_plan(sizes, dev)
            return c

        lay = Layout(grids, patches, patches // unit, win_idx, torch.argsort(win_idx), cos, sin,
                     cu(full_sizes), cu(win_sizes))
        self._layouts[grids] = lay
        while len(self._layouts) > self.max_layouts:
            self._layouts.popitem(last=False)
        return lay

    # ---- the tower --------------------------------------------------------------------------------
    def forward(self, pixels: torch.Tensor, lay: Layout) -> tuple[torch.Tensor, torch.Tensor]:
        """(pre-merger hidden states in window order, merged features in image order) of one layout."""
        v = self.visual
        h = self._patch_embed(pixels.to(self.dtype)) if self.linear_patch else v.patch_embed(pixels.to(self.dtype))
        s, unit = h.shape[0], self.merge * self.merge
        h = h.reshape(s // unit, unit, -1)[lay.window_index].reshape(s, -1)
        pe = (lay.cos, lay.sin)
        for i, blk in enumerate(v.blocks):
            h = blk(h, cu_seqlens=lay.cu_full if i in self.full_blocks else lay.cu_window, position_embeddings=pe)
        return h, v.merger(h)[lay.reverse]

    def _patch_embed(self, pixels: torch.Tensor) -> torch.Tensor:
        proj = self.visual.patch_embed.proj
        return F.linear(pixels, proj.weight.reshape(proj.weight.shape[0], -1), proj.bias)

    @contextmanager
    def eager(self) -> Iterator[None]:
        """No graph replay or capture inside (one-off calls: start-up checks)."""
        was, self.use_graphs = self.use_graphs, False
        try:
            yield
        finally:
            self.use_graphs = was

    def reset(self) -> None:
        """Drop the graphs (parameters were rebound); they are captured again on later calls."""
        self._graphs.clear()
        self._graph_grids.clear()
        self._pool = None

    def _wrap(self, hidden: torch.Tensor, merged: torch.Tensor) -> Any:
        if self._out_type is None:
            return merged
        return self._out_type(last_hidden_state=hidden, pooler_output=merged)

    @torch.inference_mode()
    def __call__(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor | None = None, **_: Any) -> Any:
        if grid_thw is None:
            raise ValueError("the vision tower needs grid_thw")
        grids = tuple(tuple(int(x) for x in g) for g in grid_thw.tolist())
        per = grids[0][0] * grids[0][1] * grids[0][2] if grids else 0
        if (self.use_graphs and len(set(grids)) == 1 and len(grids) <= self.buckets[-1]
                and next(b for b in self.buckets if b >= len(grids)) * per <= self.max_graph_patches):
            g = self._graph_for(grids[0], len(grids))
            if g is not None:
                return self._replay(g, pixel_values, grids)
        self.stats["vision_eager_calls"] += 1
        return self._wrap(*self.forward(pixel_values, self.layout(grids)))

    # ---- graphs -----------------------------------------------------------------------------------
    def _graph_for(self, grid: Grid, n: int) -> _Graph | None:
        nb = next(b for b in self.buckets if b >= n)
        g = self._graphs.get((grid, nb))
        if g is not None:
            return g
        if grid in self._graph_grids or len(self._graph_grids) >= self.max_grids:
            return None
        self._graph_grids.add(grid)
        try:
            for b in self.buckets:
                if b * grid[0] * grid[1] * grid[2] <= self.max_graph_patches:
                    self._capture(grid, b)
        except Exception:
            log.warning("vision graph capture failed; the vision tower runs eagerly", exc_info=True)
            self.use_graphs = False
            self._graphs.clear()
            return None
        return self._graphs.get((grid, nb))

    def _capture(self, grid: Grid, nb: int) -> None:
        t0 = time.perf_counter()
        lay = self.layout((grid,) * nb)
        per = grid[0] * grid[1] * grid[2]
        width = self.visual.patch_embed.proj.weight[0].numel()
        gen = torch.Generator(device=self.device).manual_seed(nb)
        pixels = torch.randn((nb * per, width), generator=gen, device=self.device).to(self.dtype)
        if self.device.type != "cuda":
            self._graphs[(grid, nb)] = _Graph(None, lay, pixels, *self.forward(pixels, lay))
            self.stats["vision_graphs"] += 1
            return
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            eager = self.forward(pixels, lay)
        torch.cuda.current_stream().wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            hidden, merged = self.forward(pixels, lay)
        g = _Graph(graph, lay, pixels, hidden, merged)
        if not self._checked:
            g.replay(self)
            cos = F.cosine_similarity(g.merged.float(), eager[1].float(), dim=-1).min().item()
            if not cos > 0.9999:
                raise RuntimeError(f"vision graph differs from the eager tower (min cosine {cos:.6f})")
            self._checked = True
        self._graphs[(grid, nb)] = g
        self.stats["vision_graphs"] += 1
        self.stats["vision_capture_s"] += time.perf_counter() - t0

    def _replay(self, g: _Graph, pixel_values: torch.Tensor, grids: tuple[Grid, ...]) -> Any:
        rows = pixel_values.shape[0]
        g.pixels[:rows].copy_(pixel_values)
        g.replay(self)
        self.stats["vision_graph_calls"] += 1
        n = len(grids)
        per = grids[0][0] * grids[0][1] * grids[0][2]
        unit = self.merge * self.merge
        return self._wrap(g.hidden[: n * per].clone(), g.merged[: n * per // unit].clone())

    # ---- installation -----------------------------------------------------------------------------
    @torch.inference_mode()
    def check(self, original: Any) -> float:
        """Max relative difference of this runner's merged features from `original` (the module's own
        forward) on two layouts (one image; two images of different grids, one of them partial windows),
        with the module's own patch embedding; then switches to the linear one where it agrees with it
        (relative difference <= 1e-5 in float32, 1e-2 in 16-bit: one dot product's rounding)."""
        width = self.visual.patch_embed.proj.weight[0].numel()
        m = self.merge
        worst = 0.0
        gen = torch.Generator(device=self.device).manual_seed(0)
        self.linear_patch = False  # the layouts are checked with the module's own patch embedding
        for grids in (((1, 4 * m, 6 * m),), ((1, 2 * m, 3 * m), (1, 5 * m, 2 * m))):
            n = sum(t * h * w for t, h, w in grids)
            pixels = torch.randn((n, width), generator=gen, device=self.device).to(self.dtype)
            thw = torch.tensor(grids, dtype=torch.long, device=self.device)
            ref = original(pixels, grid_thw=thw)
            if not isinstance(ref, torch.Tensor):
                self._out_type = type(ref)
                ref = ref.pooler_output
            _, got = self.forward(pixels, self.layout(grids))
            if got.shape != ref.shape:
                return float("inf")
            worst = max(worst, float((got.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)))
        pixels = torch.randn((256, width), generator=gen, device=self.device).to(self.dtype)
        conv, lin = self.visual.patch_embed(pixels).float(), self._patch_embed(pixels).float()
        rel = float((lin - conv).norm() / conv.norm().clamp_min(1e-12))
        self.stats["patch_linear_rel_diff"] = rel
        self.linear_patch = rel <= (1e-5 if self.dtype == torch.float32 else 1e-2)
        return worst


def install(model: torch.nn.Module, *, use_graphs: bool, max_images: int) -> VisionRunner | None:
    """Run a Qwen2.5-VL model's vision tower through a `VisionRunner` (None when not applicable or when
    its check fails; the model is then unchanged)."""
    visual = getattr(getattr(model, "model", model), "visual", None)
    if visual is None or type(visual).__name__ != "Qwen2_5_VisionTransformerPretrainedModel":
        return None
    try:
        runner = VisionRunner(visual, use_graphs=use_graphs, max_images=max_images)
        original = visual.forward
        diff = runner.check(original)
    except Exception:
        log.warning("static vision layouts unavailable for this transformers version", exc_info=True)
        return None
    tol = 1e-5 if runner.dtype == torch.float32 else 2e-2
    if not diff <= tol:
        log.warning("static vision layouts differ from transformers' vision tower (relative %.2e); not used", diff)
        return None
    runner.stats["vision_check_rel_diff"] = diff
    width = visual.patch_embed.proj.weight[0].numel()
    m = runner.merge
    test = torch.randn((4 * m * 6 * m, width), generator=torch.Generator(device=runner.device).manual_seed(1),
                       device=runner.device).to(runner.dtype)
    lay = runner.layout(((1, 4 * m, 6 * m),))
    other = torch.randn((4 * m * 4 * m, width), generator=torch.Generator(device=runner.device).manual_seed(2),
                        device=runner.device).to(runner.dtype)
    pair = runner.layout(((1, 4 * m, 6 * m), (1, 4 * m, 4 * m)))

    def batch_noise() -> float:  # the test image alone against the same image batched with another
        alone = runner.forward(test, lay)[1].float()
        together = runner.forward(torch.cat([test, other]), pair)[1][: alone.shape[0]].float()
        return float((together - alone).norm() / alone.norm().clamp_min(1e-12))

    runner.aligned = install_aligned_mlps(visual.blocks, lambda: runner.forward(test, lay)[1], tol, batch_noise)
    if runner.aligned is not None:
        runner.stats.update(aligned_mlp_rel_diff=runner.aligned.rel_diff, vision_batch_noise=runner.aligned.noise)
    visual._awrl_orig_forward = original
    visual.forward = types.MethodType(lambda self, *a, **kw: runner(*a, **kw), visual)
    return runner
