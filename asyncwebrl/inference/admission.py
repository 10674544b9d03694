"""The inference server's cost model: what a /generate request may cost, decided from what it declares
before any expensive work, and a fair order in which admitted work is prepared and reaches the engine.

Invariants:
- Every request is assessed before its images are decoded, whatever its body size: prompts counted
  (`max_prompts`), distinct images counted (`max_images`; one image string shared by many prompts is
  one image), each image's pixels read from its header (`max_image_pixels`), and, for input_ids
  prompts, each prompt's image-token count checked against what its images will need (from the
  header sizes, no decoding). A request that fails is refused (400) having cost a base64 decode and a
  header read.
- The pixels a request makes the server decode and process are bounded (`max_request_pixels`): the
  engine decodes and processes the images of input_ids prompts once per distinct image list
  (`engine.IMAGE_MEMO`: 64 prompts sharing one screenshot cost one image), and those of text prompts
  once per prompt (the processor expands their placeholders), so the pixels are summed that way.
- Decoded-image memory is reserved against one server-wide budget (`memory_budget_bytes`) before
  decoding, at `bytes_per_pixel` per pixel counted as above; a request that would overflow it waits
  for nothing: 429 (try again) while others hold the budget or its client holds its share
  (`client_budget_share`), 413 when it alone is larger than a client's share. The reservation is
  released when the request's last prompt is done.
- Admitted work is taken round-robin over clients twice: each prompt's preparation (image decoding,
  processing, tokenizing) through a `FairQueue` of `prep_workers` threads, one prompt of a client at a
  time; then the prepared prompts into the engine through a `FairQueue` of `engine_window` prompts, in
  which a client with nothing in the engine always gets its first prompt in. A client's big batch
  therefore delays another client's prompt by at most one prompt's preparation, and, in the plain
  engine, by at most the step or prefill in progress: light clients go first (`light_client_prompts`).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from asyncwebrl.protocol import GenerateRequest, ProtocolError

MiB = 1024 * 1024
COST_ENV = "ASYNCWEBRL_COST_LIMITS"
"""cost limits a launcher hands a server: space-separated KEY=VALUE (the keys of `CostLimits`)"""


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
    """width * height summed over the images a request makes the server decode and process: each
    distinct image list of its input_ids prompts once, each text prompt's images once per prompt"""
    bytes_per_pixel: int = 32
    """decoded-image memory reserved per pixel: the decoded RGB(A) image plus the processor's float32
    patches (Qwen2-VL: 3 channels x 4 bytes x 2 temporal copies = 24 bytes a pixel at full size)"""
    memory_budget_bytes: int = 2048 * MiB
    """server-wide memory for the decoded images of admitted requests"""
    client_budget_share: float = 0.5
    """fraction of `memory_budget_bytes` one client may hold at once, so another client finds room"""
    engine_window: int = 0
    """prompts in the engine at once (0 = the engine's max_batch_size); a client with none in it gets
    one in regardless"""
    prep_workers: int = 2
    """threads preparing prompts (image decoding and processing, tokenizing); one client uses one at a time"""
    light_client_prompts: int = 4
    """a client with at most this many prompts in the engine is light: while a light client has prompts
    there, heavier clients' rows are set aside (KV kept, not decoded) and only light clients' prompts
    are admitted (0 = off). The plain (CPU) engine only: there every row adds to each step's time"""

    def as_env(self) -> dict[str, str]:
        """These limits as the environment a launcher gives a server process ($ASYNCWEBRL_COST_LIMITS)."""
        return {COST_ENV: " ".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self))}

    def validate(self) -> None:
        for name in ("max_prompts", "max_images", "max_image_pixels", "max_request_pixels", "bytes_per_pixel",
                     "memory_budget_bytes", "prep_workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"CostLimits.{name} must be >= 1")
        for name in ("engine_window", "light_client_prompts"):
            if getattr(self, name) < 0:
                raise ValueError(f"CostLimits.{name} must be >= 0")
        if not 0 < self.client_budget_share <= 1:
            raise ValueError("CostLimits.client_budget_share must be in (0, 1]")


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
    """pixels to decode and process (see CostLimits.max_request_pixels)"""
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
    counts, then headers of distinct images (each read once), then the pixels to process, then
    placeholder counts."""
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
    for im in distinct:
        try:
            w, h = image_size_of(im)
        except ValueError as e:
            raise ProtocolError(f"{first[im]}: {e}") from None
        if w * h > limits.max_image_pixels:
            raise ProtocolError(f"{first[im]}: {w}x{h} pixels exceeds the limit of {limits.max_image_pixels} pixels")
        distinct[im] = (w, h)
    # what the engine decodes and processes: an input_ids prompt's image list once per distinct list
    # (engine.IMAGE_MEMO), a text prompt's images once per prompt
    units = ([ims for ims in per_prompt if ims] if req.text is not None
             else list({tuple(ims): ims for ims in per_prompt if ims}.values()))
    pixels = 0
    for ims in units:
        pixels += sum(distinct[im][0] * distinct[im][1] for im in ims)
        if pixels > limits.max_request_pixels:
            raise ProtocolError(f"the request's images hold more than {limits.max_request_pixels} pixels to decode "
                                "(each distinct image list of input_ids prompts once, each text prompt's images "
                                "once per prompt)")
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
    """Bytes reserved for decoded images, server-wide, at most `client_share` of them by one client
    (used from the server's loop only)."""

    def __init__(self, total: int, client_share: float = 1.0):
        self.total = total
        self.client_total = max(1, int(total * client_share))
        self.reserved = 0
        self.peak = 0
        self.refused = 0
        self._by_client: collections.Counter[str] = collections.Counter()

    def reserve(self, n: int, client: str = "") -> None:
        if n > self.client_total:
            self.refused += 1
            whole = self.client_total == self.total
            raise Refused(413, f"the request's images need {n / MiB:.0f} MiB decoded, more than "
                               f"{'the server' if whole else 'one client'}'s image budget of "
                               f"{self.client_total / MiB:.0f} MiB")
        if self._by_client[client] + n > self.client_total:
            self.refused += 1
            raise Refused(429, f"this client's share of the server's image budget is in use "
                               f"({self._by_client[client] / MiB:.0f} of {self.client_total / MiB:.0f} MiB); "
                               "retry when its requests are done")
        if self.reserved + n > self.total:
            self.refused += 1
            raise Refused(429, f"the server's image budget is in use ({self.reserved / MiB:.0f} of "
                               f"{self.total / MiB:.0f} MiB); retry later")
        self.reserved += n
        self._by_client[client] += n
        self.peak = max(self.peak, self.reserved)

    def release(self, n: int, client: str = "") -> None:
        self.reserved = max(0, self.reserved - n)
        left = self._by_client[client] - n
        if left > 0:
            self._by_client[client] = left
        else:
            del self._by_client[client]


class FairQueue:
    """Work items on their way to a limited resource (the engine, the preparation threads),
    round-robin over clients (used from the server's loop only; `done(client)` is called there when
    one of that client's items is finished with the resource).

    At most `window` items are in at once and at most `per_client` (0 = no limit) of one client;
    with `first_always`, a client with none in gets its next item in even past the window (the
    engine: a newcomer waits for no one's long generation to end; the engine shares the rows)."""

    def __init__(self, submit: Callable[[Any], None], window: int, *, per_client: int = 0,
                 first_always: bool = False):
        self._submit = submit
        self.window = max(1, window)
        self.per_client = per_client
        self.first_always = first_always
        self.in_flight: collections.Counter[str] = collections.Counter()
        self._queues: collections.OrderedDict[str, collections.deque[Any]] = collections.OrderedDict()

    @property
    def pending(self) -> int:
        return sum(len(q) for q in self._queues.values())

    @property
    def in_engine(self) -> int:
        """items in the resource now"""
        return sum(self.in_flight.values())

    def all_pending(self) -> list[Any]:
        return [x for q in self._queues.values() for x in q]

    def push(self, client: str, items: list[Any]) -> None:
        if items:
            self._queues.setdefault(client, collections.deque()).extend(items)
            self._pump()

    def done(self, client: str) -> None:
        left = self.in_flight[client] - 1
        if left > 0:
            self.in_flight[client] = left
        else:
            del self.in_flight[client]
        self._pump()

    def _may_enter(self, client: str) -> bool:
        have = self.in_flight[client]
        if self.per_client and have >= self.per_client:
            return False
        return self.in_engine < self.window or (self.first_always and have == 0)

    def _pump(self) -> None:
        while True:
            client = next((c for c in self._queues if self._may_enter(c)), None)
            if client is None:
                return
            q = self._queues[client]
            item = q.popleft()
            if q:
                self._queues.move_to_end(client)  # its next item waits for every other client's turn
            else:
                del self._queues[client]
            self.in_flight[client] += 1
            self._submit(item)

    def flush(self, match: Callable[[Any], bool] | None = None) -> int:
        """Hand pending items (all, or those `match` picks) in now, past the window: an abort must find
        them in the engine."""
        n = 0
        for client in list(self._queues):
            q = self._queues[client]
            keep = collections.deque()
            for item in q:
                if match is None or match(item):
                    self.in_flight[client] += 1
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
