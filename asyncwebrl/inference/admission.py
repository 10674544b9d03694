"""The inference server's cost model: what a /generate request may cost, decided from what it declares
before any expensive work, and a fair order in which admitted prompts reach the engine.

Invariants:
- Every request is assessed before its images are decoded, whatever its body size: prompts counted
  (`max_prompts`), distinct images counted (`max_images`; one image string shared by many prompts is
  one image), each image's pixels read from its header (`max_image_pixels`) and their sum bounded
  (`max_request_pixels`), and, for input_ids prompts, each prompt's image-token count checked against
  what its images will need (from the header sizes, no decoding). A request that fails is refused
  (400) having cost a base64 decode and a header read.
- Decoded-image memory is reserved against one server-wide budget (`memory_budget_bytes`) before
  decoding, at `bytes_per_pixel` per pixel of each DISTINCT image (the engine decodes and processes a
  shared image once: `engine.IMAGE_MEMO`); a request that would overflow it waits for nothing: 429
  (try again) while others hold the budget, 413 when it alone is larger than the budget. The
  reservation is released when the request's last prompt is done.
- Admitted prompts reach the engine through `FairQueue`: at most `engine_window` prompts in the engine
  at once, the next one taken round-robin over clients, so a client's big batch delays another client's
  prompt by at most one window's worth of work, not by the whole batch.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from asyncwebrl.protocol import GenerateRequest, ProtocolError

MiB = 1024 * 1024


@dataclass(kw_only=True)
class CostLimits:
    """What one /generate request, and all of them together, may cost."""

    max_prompts: int = 256
    """prompts in one request (any body size)"""
    max_images: int = 64
    """distinct images in one request (equal image strings count once)"""
    max_image_pixels: int = 4096 * 4096
    """width * height of one image, from its header"""
    max_request_pixels: int = 32 * MiB
    """sum of width * height over a request's distinct images"""
    bytes_per_pixel: int = 32
    """decoded-image memory reserved per pixel: the decoded RGB(A) image plus the processor's float32
    patches (Qwen2-VL: 3 channels x 4 bytes x 2 temporal copies = 24 bytes a pixel at full size)"""
    memory_budget_bytes: int = 2048 * MiB
    """server-wide memory for the decoded images of admitted requests"""
    engine_window: int = 0
    """prompts in the engine at once (0 = the engine's max_batch_size): the fair queue's granularity"""

    def validate(self) -> None:
        for name in ("max_prompts", "max_images", "max_image_pixels", "max_request_pixels", "bytes_per_pixel",
                     "memory_budget_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"CostLimits.{name} must be >= 1")
        if self.engine_window < 0:
            raise ValueError("CostLimits.engine_window must be >= 0")


class Refused(ProtocolError):
    """A request the cost model refuses with a status other than 400 (413, 429)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass
class Assessment:
    """What a request will cost, known before decoding."""

    prompts: int
    images: int
    """distinct images"""
    pixels: int
    """sum over distinct images"""
    reserve_bytes: int


def image_token_counter(engine: Any) -> Callable[[int, int], int] | None:
    """(width, height) -> image tokens one image of that size becomes in a prompt, computed without
    decoding (the processor's own resize rule); None for a family whose count is not known that way."""
    fam = getattr(getattr(engine, "adapter", None), "model_family", None)
    proc = getattr(fam, "image_processor", None)
    if proc is not None and hasattr(proc, "get_number_of_image_patches") and getattr(fam, "merge", None):
        merge2 = int(fam.merge) ** 2
        return lambda w, h: int(proc.get_number_of_image_patches(h, w, {})) // merge2
    seq = getattr(getattr(fam, "processor", None), "image_seq_len", None)
    if isinstance(seq, int) and seq > 0:
        return lambda w, h: seq
    return None


def assess(req: GenerateRequest, limits: CostLimits, *, image_token_id: int | None,
           tokens_for: Callable[[int, int], int] | None, image_size_of: Callable[[str], tuple[int, int]]) -> Assessment:
    """The cost of `req`, or ProtocolError (400) naming the first limit it breaks. Cheap checks first:
    counts, then headers of distinct images (each read once), then placeholder counts."""
    n = req.batch_size
    if n > limits.max_prompts:
        raise ProtocolError(f"a request of {n} prompts exceeds the limit of {limits.max_prompts}")
    per_prompt = req.prompt_images()
    distinct: dict[str, tuple[int, int] | None] = {}
    first: dict[str, str] = {}  # where each distinct image first appears, as the caller would name it
    for i, ims in enumerate(per_prompt):
        for j, im in enumerate(ims):
            if im not in distinct:
                distinct[im] = None
                first[im] = f"prompt {i}: image_data[{j}]" if req.is_batch else f"image_data[{j}]"
                if len(distinct) > limits.max_images:
                    raise ProtocolError(f"more than {limits.max_images} distinct images in one request")
    pixels = 0
    for im in distinct:
        try:
            w, h = image_size_of(im)
        except ValueError as e:
            raise ProtocolError(f"{first[im]}: {e}") from None
        if w * h > limits.max_image_pixels:
            raise ProtocolError(f"{first[im]}: {w}x{h} pixels exceeds the limit of {limits.max_image_pixels} pixels")
        pixels += w * h
        if pixels > limits.max_request_pixels:
            raise ProtocolError(f"the request's images hold more than {limits.max_request_pixels} pixels")
        distinct[im] = (w, h)
    if req.input_ids is not None and image_token_id is not None:
        prompts = req.input_ids if req.is_batch else [req.input_ids]
        for i, (ids, ims) in enumerate(zip(prompts, per_prompt, strict=True)):
            have = sum(1 for t in ids if t == image_token_id)
            where = f"prompt {i}: " if req.is_batch else ""
            if not ims and have:
                raise ProtocolError(f"{where}input_ids contain image tokens but no image_data was given")
            if ims and tokens_for is not None:
                need = sum(tokens_for(*distinct[im]) for im in ims)
                if have != need:
                    raise ProtocolError(f"{where}input_ids hold {have} image tokens; the images need {need}")
    return Assessment(prompts=n, images=len(distinct), pixels=pixels, reserve_bytes=pixels * limits.bytes_per_pixel)


class MemoryBudget:
    """Bytes reserved for decoded images, server-wide (used from the server's loop only)."""

    def __init__(self, total: int):
        self.total = total
        self.reserved = 0
        self.peak = 0
        self.refused = 0

    def reserve(self, n: int) -> None:
        if n > self.total:
            self.refused += 1
            raise Refused(413, f"the request's images need {n / MiB:.0f} MiB decoded, more than the server's "
                               f"whole image budget of {self.total / MiB:.0f} MiB")
        if self.reserved + n > self.total:
            self.refused += 1
            raise Refused(429, f"the server's image budget is in use ({self.reserved / MiB:.0f} of "
                               f"{self.total / MiB:.0f} MiB); retry later")
        self.reserved += n
        self.peak = max(self.peak, self.reserved)

    def release(self, n: int) -> None:
        self.reserved = max(0, self.reserved - n)


class FairQueue:
    """Admitted prompts on their way into the engine, round-robin over clients (used from the server's
    loop only; `done` is called there when a submitted prompt finishes)."""

    def __init__(self, submit: Callable[[Any], None], window: int):
        self._submit = submit
        self.window = max(1, window)
        self.in_engine = 0
        self._queues: collections.OrderedDict[str, collections.deque[Any]] = collections.OrderedDict()

    @property
    def pending(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def push(self, client: str, items: list[Any]) -> None:
        self._queues.setdefault(client, collections.deque()).extend(items)
        self._pump()

    def done(self) -> None:
        self.in_engine = max(0, self.in_engine - 1)
        self._pump()

    def _pump(self) -> None:
        while self.in_engine < self.window and self._queues:
            client, q = next(iter(self._queues.items()))
            item = q.popleft()
            if q:
                self._queues.move_to_end(client)  # its next prompt waits for every other client's turn
            else:
                del self._queues[client]
            self.in_engine += 1
            self._submit(item)

    def flush(self, match: Callable[[Any], bool] | None = None) -> int:
        """Hand pending prompts (all, or those `match` picks) to the engine now, past the window: an
        abort must find them there."""
        n = 0
        for client in list(self._queues):
            q = self._queues[client]
            keep = collections.deque()
            for item in q:
                if match is None or match(item):
                    self.in_engine += 1
                    self._submit(item)
                    n += 1
                else:
                    keep.append(item)
            if keep:
                self._queues[client] = keep
            else:
                del self._queues[client]
        return n

    def drop(self, items: list[Any]) -> list[Any]:
        """Take `items` out of the queue if still pending (their client went away); the ones dropped."""
        ids = {id(x) for x in items}
        dropped = []
        for client in list(self._queues):
            q = self._queues[client]
            kept = collections.deque(x for x in q if id(x) not in ids)
            dropped += [x for x in q if id(x) in ids]
            if kept:
                self._queues[client] = kept
            else:
                del self._queues[client]
        return dropped
