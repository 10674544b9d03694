"""Training samples: one per episode step, built from rollout groups, split across ranks and packed
into micro-batches by a token budget; pixels are fetched from the PixelStore only here, when a
micro-batch is about to run.

Invariant: a sample whose screenshots are missing from the store is dropped and counted, never
waited for; the number of loss tokens (the global PPO denominator) is fixed before any forward pass,
from the samples that survived the pixel fetch on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncwebrl.models.mrope import MRopeIndex
from asyncwebrl.models.vlm import VLMAdapter, decode_image
from asyncwebrl.pixelstore.base import PixelStore
from asyncwebrl.records import RolloutGroup, TrainSample
from asyncwebrl.training.advantages import trajectory_advantages
from asyncwebrl.training.packing import PackedInputs, pack


def samples_from_groups(
    groups: list[RolloutGroup],
    group_norm: bool = True,
    std_norm: bool = True,
    step_normalizer: str = "none",
    step_normalizer_k: int = 10,
    wasted_steps_never_reinforced: bool = False,
) -> list[TrainSample]:
    """Every step of every non-failed trajectory, carrying its episode advantage (steps without
    generated tokens carry no loss and are skipped); with `wasted_steps_never_reinforced` an invalid
    or no-effect step carries at most 0 (actor.wasted_steps_never_reinforced)."""
    out: list[TrainSample] = []
    for g in groups:
        for traj, adv in trajectory_advantages(g, group_norm, std_norm, step_normalizer, step_normalizer_k):
            for s in traj.steps:
                if not s.output_ids:
                    continue
                wasted = wasted_steps_never_reinforced and (s.invalid or s.no_effect)
                ts = TrainSample(
                    prompt_ids=list(s.prompt_ids), output_ids=list(s.output_ids),
                    behave_logprobs=list(s.behave_logprobs), versions=list(s.versions),
                    advantage=min(adv, 0.0) if wasted else adv,
                    pixel_keys=list(s.pixel_keys), pixels=s.pixels, traj_id=traj.traj_id,
                )
                ts.validate()
                out.append(ts)
    return out


def shard_for_rank(samples: list[TrainSample], rank: int, world_size: int) -> list[TrainSample]:
    """Greedy balance by token count (longest first); deterministic, the same answer on every rank."""
    order = sorted(range(len(samples)), key=lambda i: (-samples[i].n_tokens, i))
    load = [0] * world_size
    owner = [0] * len(samples)
    for i in order:
        r = min(range(world_size), key=lambda j: (load[j], j))
        owner[i] = r
        load[r] += samples[i].n_tokens
    return [s for i, s in enumerate(samples) if owner[i] == rank]


def micro_batches(samples: list[TrainSample], max_tokens: int, packed: bool = False) -> list[list[TrainSample]]:
    """Consecutive groups whose size stays within `max_tokens`: padded size (n x longest), or with
    `packed` the plain token sum (no padding); a sample longer than the budget runs alone. Samples are
    sorted by length first so padding stays small."""
    ordered = sorted(samples, key=lambda s: s.n_tokens)
    out: list[list[TrainSample]] = []
    cur: list[TrainSample] = []
    total = 0
    for s in ordered:
        longest = max([s.n_tokens] + [c.n_tokens for c in cur])
        size = total + s.n_tokens if packed else longest * (len(cur) + 1)
        if cur and size > max_tokens:
            out.append(cur)
            cur, total = [], 0
        cur.append(s)
        total += s.n_tokens
    if cur:
        out.append(cur)
    return out


def consumed_pixel_keys(batch: list[RolloutGroup] | list[TrainSample]) -> list[str]:
    """Every PixelStore reference a consumed batch holds, one entry per reference (a screenshot that a
    sliding window reused is listed once per step that used it, matching its refcount). From groups:
    every step of every trajectory, including steps that became no sample (no output tokens); a failed
    trajectory released its own references already and lists none."""
    if batch and isinstance(batch[0], RolloutGroup):
        return [k for g in batch for t in g.trajectories for k in t.all_pixel_keys()]  # type: ignore[union-attr]
    return [k for s in batch for k in s.pixel_keys]  # type: ignore[union-attr]


def fetch_pixels(samples: list[TrainSample], pixel_store: PixelStore) -> tuple[list[TrainSample], list[list[bytes]], int]:
    """(kept samples, their encoded screenshots, number dropped for missing pixels). One store call."""
    keys = sorted({k for s in samples if s.pixels is None for k in s.pixel_keys})
    got: dict[str, bytes | None] = {}
    if keys:
        if pixel_store is None:
            raise ValueError("samples reference PixelStore keys but no pixel_store was given")
        got = dict(zip(keys, pixel_store.get(keys), strict=False))
    kept, pixels, dropped = [], [], 0
    for s in samples:
        if s.pixels is not None:
            kept.append(s)
            pixels.append(list(s.pixels))
            continue
        data = [got.get(k) for k in s.pixel_keys]
        if any(d is None for d in data):
            dropped += 1
            continue
        kept.append(s)
        pixels.append(data)  # type: ignore[arg-type]
    return kept, pixels, dropped


@dataclass
class ForwardBatch:
    """Model inputs of one micro-batch plus where its loss tokens sit."""

    inputs: dict[str, torch.Tensor]
    rows: torch.Tensor
    """batch row of each loss token"""
    cols: torch.Tensor
    """position whose hidden state predicts the token (one before the token)"""
    targets: torch.Tensor
    behave: torch.Tensor
    versions: torch.Tensor
    advantages: torch.Tensor
    prox: torch.Tensor | None
    n_per_sample: list[int]
    ref: torch.Tensor | None = None
    """the reference policy's logprobs (the KL term), when every sample has them"""
    packed: PackedInputs | None = None
    """set for a packed micro-batch (`asyncwebrl.training.packing`): `inputs` is then empty, every loss
    token sits in row 0 and `cols` index the packed sequence"""


def process_images(adapter: VLMAdapter, samples: list[TrainSample], pixels: list[list[bytes]],
                   workers: int = 1) -> list[dict[str, torch.Tensor]]:
    """The model's image tensors of each sample (decoded and processed here, never earlier): once per
    sample per step, however many passes the step makes. `workers` > 1 spreads samples over threads
    (PNG decoding and the processor's array work release the GIL)."""
    def one(i: int) -> dict[str, torch.Tensor]:
        pix = pixels[i]
        if not pix:
            return adapter.encode_with_images_for_ids(samples[i].prompt_ids, [])
        return adapter.encode_with_images_for_ids(samples[i].prompt_ids + samples[i].output_ids,
                                                  [decode_image(p) for p in pix])
    if workers <= 1 or len(samples) < 2:
        return [one(i) for i in range(len(samples))]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(one, range(len(samples))))


def build_forward_batch(adapter: VLMAdapter, samples: list[TrainSample], images: list[dict[str, torch.Tensor]],
                        mrope: MRopeIndex | None = None, sample_ids: list[int] | None = None) -> ForwardBatch:
    """Token ids prompt+output, the samples' processed image tensors (`process_images`), and loss-token
    indices: one right-padded row per sample, or with `mrope` one packed row (`packing.pack`; `sample_ids`
    name the samples for the image-embedding cache)."""
    seqs = [s.prompt_ids + s.output_ids for s in samples]
    packed = None
    if mrope is not None:
        packed = pack(seqs, images, mrope, sample_ids if sample_ids is not None else list(range(len(samples))))
        inputs: dict[str, torch.Tensor] = {}
    else:
        inputs = adapter.collate(seqs, images)
    rows, cols, targets, behave, versions, advs, prox, ref = [], [], [], [], [], [], [], []
    offset = 0
    for i, s in enumerate(samples):
        p, n = len(s.prompt_ids), len(s.output_ids)
        rows += [0 if packed else i] * n
        start = offset if packed else 0
        cols += list(range(start + p - 1, start + p + n - 1))
        offset += p + n
        targets += s.output_ids
        behave += s.behave_logprobs
        versions += s.versions
        advs += [s.advantage] * n
        if s.prox_logprobs is not None:
            prox += s.prox_logprobs
        if s.ref_logprobs is not None:
            ref += s.ref_logprobs
    have_prox = all(s.prox_logprobs is not None for s in samples)
    have_ref = bool(samples) and all(s.ref_logprobs is not None for s in samples)
    return ForwardBatch(
        inputs=inputs, rows=torch.tensor(rows), cols=torch.tensor(cols), targets=torch.tensor(targets),
        behave=torch.tensor(behave, dtype=torch.float32), versions=torch.tensor(versions),
        advantages=torch.tensor(advs, dtype=torch.float32),
        prox=torch.tensor(prox, dtype=torch.float32) if have_prox else None,
        ref=torch.tensor(ref, dtype=torch.float32) if have_ref else None,
        n_per_sample=[len(s.output_ids) for s in samples], packed=packed,
    )
