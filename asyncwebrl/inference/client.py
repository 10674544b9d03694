"""Rollout-side client of the inference servers (SGLang native API, SPEC section 3 "client rules").

`InferenceClient.agenerate(...)` returns a `GenerationOutput` whose token, logprob and version lists
stay aligned across interruptions: a response that comes back aborted (a weight update with
abort_all_requests, a pause in abort mode) is resubmitted with prompt + tokens so far and the
remaining budget, and the new tokens are tagged with the version that produced them. So a weight
update never loses an episode.

Version tagging: each response's tokens get their version from SGLang's `meta_info.weight_versions`
spans ({version, start, end} over the output tokens: a request held in place across a refresh has
one span per version); without spans, from the per-token extension `output_token_versions` (the hf
backend) when its length matches, else `meta_info.weight_version` for all of them. Prompt tokens are never tagged (they are -1 in the
trainer's view).

Server choice: one episode (`sticky_key`) sticks to one server while it is healthy (KV/prefix
reuse); new keys go to the least-loaded healthy server. Transport errors and 5xx are retried with
exponential backoff, then the server is marked failed (for `failure_cooldown_s`) and the request
fails over to another. HTTP 400/401 are the caller's fault: raised at once, never retried, with the
server's message whatever its error shape (SGLang's {"error": {"message"}} or ours).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

from asyncwebrl.protocol import GenerationOutput, ProtocolError, build_generate_payload, parse_version
from asyncwebrl.server_http import ServerAuthError, ServerError, ServerHttp

log = logging.getLogger(__name__)


class InferenceUnavailable(RuntimeError):
    """No server could answer (all failed after retries)."""


InferenceAuthError = ServerAuthError



class InferenceClient(ServerHttp):
    """Async HTTP client for a group of inference servers (one event loop per session)."""

    def __init__(
        self,
        addresses: list[str],
        api_key: str | None = None,
        timeout_s: float = 120.0,
        max_retries: int = 3,
        *,
        retry_backoff_s: float = 0.25,
        failure_cooldown_s: float = 30.0,
        max_resubmits: int = 64,
    ):
        if not addresses:
            raise ValueError("InferenceClient needs at least one server address")
        super().__init__(addresses, api_key=api_key, timeout_s=timeout_s)
        self.max_retries = max_retries
        self.retry_backoff_s = retry_backoff_s
        self.failure_cooldown_s = failure_cooldown_s
        self.max_resubmits = max_resubmits
        self._failed_until: dict[str, float] = {}
        self._sticky: dict[str, str] = {}
        self._inflight: dict[str, int] = {a: 0 for a in self.addresses}
        self.stats = {"requests": 0, "resubmits": 0, "retries": 0, "failovers": 0}

    # ---- server health / choice ------------------------------------------------------------------
    def mark_failed(self, addr: str, cooldown_s: float | None = None) -> None:
        """Stop routing to `addr` for a while; episodes stuck to it move elsewhere."""
        self._failed_until[addr] = time.monotonic() + (self.failure_cooldown_s if cooldown_s is None else cooldown_s)
        for k in [k for k, a in self._sticky.items() if a == addr]:
            del self._sticky[k]

    def restore(self, addr: str) -> None:
        self._failed_until.pop(addr, None)

    def healthy_addresses(self) -> list[str]:
        now = time.monotonic()
        return [a for a in self.addresses if self._failed_until.get(a, 0.0) <= now]

    def release(self, sticky_key: str) -> None:
        """The episode ended: forget its server."""
        self._sticky.pop(sticky_key, None)

    def _pick(self, sticky_key: str | None, exclude: set[str]) -> str | None:
        healthy = [a for a in self.healthy_addresses() if a not in exclude]
        if sticky_key is not None and self._sticky.get(sticky_key) in healthy:
            return self._sticky[sticky_key]
        if not healthy:
            return None
        addr = min(healthy, key=lambda a: (self._inflight[a], self.addresses.index(a)))
        if sticky_key is not None:
            self._sticky[sticky_key] = addr
        return addr

    async def _call_with_failover(self, endpoint: str, payload: dict[str, Any],
                                  sticky_key: str | None) -> tuple[str, dict[str, Any]]:
        tried: set[str] = set()
        last: Exception | None = None
        while True:
            addr = self._pick(sticky_key, tried)
            if addr is None:
                raise InferenceUnavailable(f"no healthy inference server left for {endpoint}; last error: {last}")
            self._inflight[addr] += 1
            try:
                for attempt in range(self.max_retries + 1):
                    try:
                        return addr, await self.call(addr, endpoint, payload)
                    except ServerError as e:
                        last = e
                        if payload.get("rid"):
                            await self._best_effort_abort(addr, payload["rid"])
                        if attempt < self.max_retries:
                            self.stats["retries"] += 1
                            await asyncio.sleep(self.retry_backoff_s * 2**attempt)
            finally:
                self._inflight[addr] -= 1
            log.warning("server %s failed %d times (%s); failing over", addr, self.max_retries + 1, last)
            self.mark_failed(addr)
            tried.add(addr)
            self.stats["failovers"] += 1

    async def _best_effort_abort(self, addr: str, rid: str) -> None:
        try:
            await self.call(addr, "/abort_request", {"rid": rid}, timeout_s=2.0)
        except Exception:  # the server may be down; the retry goes on regardless
            pass

    # ---- generation ------------------------------------------------------------------------------
    async def agenerate(
        self,
        input_ids: list[int],
        image_data: list[str | bytes] | None,
        sampling: dict[str, Any],
        sticky_key: str | None = None,
        rid: str | None = None,
        cache_key: str | None = None,
    ) -> GenerationOutput:
        """Generate until stop/length, resubmitting after aborts; see the module docstring.

        cache_key: the server's prefix-cache namespace for this request (SGLang's `extra_key`; see
        `protocol.cache_key_of`); the resubmissions of an interrupted request keep it."""
        t0 = time.perf_counter()
        rid = rid or uuid.uuid4().hex
        budget = int(sampling.get("max_new_tokens", 128))
        min_new = int(sampling.get("min_new_tokens", 0))
        out_ids: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        texts: list[str] = []
        n_resubmits = 0
        self.stats["requests"] += 1
        while True:
            sp = dict(sampling, max_new_tokens=budget - len(out_ids))
            if min_new:
                sp["min_new_tokens"] = max(0, min_new - len(out_ids))
            payload = build_generate_payload(list(input_ids) + out_ids, image_data, sp,
                                             rid=f"{rid}-{n_resubmits}", return_logprob=True, cache_key=cache_key)
            addr, resp = await self._call_with_failover("/generate", payload, sticky_key)
            ids, lps, vers, reason = _parse_generate_response(resp)
            out_ids += ids
            logprobs += lps
            versions += vers
            texts.append(resp.get("text", ""))
            if reason != "abort":
                break
            if len(out_ids) >= budget:
                reason = "length"
                break
            n_resubmits += 1
            self.stats["resubmits"] += 1
            if n_resubmits > self.max_resubmits:
                raise InferenceUnavailable(f"request {rid} aborted {n_resubmits} times in a row; giving up")
        return GenerationOutput(
            output_ids=out_ids,
            output_logprobs=logprobs,
            output_versions=versions,
            text="".join(texts),
            finish_reason="stop" if reason == "stop" else "length",
            prompt_tokens=len(input_ids),
            server=addr,
            latency_s=time.perf_counter() - t0,
            n_resubmits=n_resubmits,
        )

    def generate(self, input_ids: list[int], image_data: list[str | bytes] | None, sampling: dict[str, Any],
                 sticky_key: str | None = None, rid: str | None = None) -> GenerationOutput:
        """Blocking wrapper of agenerate (not for use inside a running event loop)."""
        async def once() -> GenerationOutput:
            try:
                return await self.agenerate(input_ids, image_data, sampling, sticky_key, rid)
            finally:
                await self.aclose()

        return asyncio.run(once())

    # ---- control of all servers ---------------------------------------------------------------------
    async def _broadcast(self, endpoint: str, payload: dict[str, Any] | None = None, *,
                         method: str = "POST", timeout_s: float | None = None) -> dict[str, dict[str, Any]]:
        addrs = self.healthy_addresses()
        results = await asyncio.gather(
            *(self.call(a, endpoint, payload, method=method, timeout_s=timeout_s) for a in addrs),
            return_exceptions=True,
        )
        out: dict[str, dict[str, Any]] = {}
        for a, r in zip(addrs, results, strict=False):
            if isinstance(r, (ProtocolError, InferenceAuthError)):
                raise r
            if isinstance(r, BaseException):
                log.warning("%s%s failed: %s; marking the server failed", a, endpoint, r)
                self.mark_failed(a)
                out[a] = {"success": False, "message": str(r)}
            else:
                out[a] = r
        return out

    async def aupdate_weights_from_disk(self, path: str, version: int | str,
                                       abort_all_requests: bool = False) -> dict[str, dict[str, Any]]:
        """Hot-load an HF safetensors folder on every healthy server and set the weight version."""
        return await self._broadcast(
            "/update_weights_from_disk",
            {"model_path": path, "weight_version": str(version), "abort_all_requests": abort_all_requests},
            timeout_s=max(self.timeout_s, 600.0),
        )


def _parse_generate_response(resp: dict[str, Any]) -> tuple[list[int], list[float], list[int], str]:
    """(output_ids, logprobs, versions, finish type) of one /generate answer; ProtocolError if malformed."""
    try:
        ids = [int(t) for t in resp["output_ids"]]
        meta = resp["meta_info"]
        lps = [float(x[0]) for x in meta.get("output_token_logprobs") or []]
        reason = meta["finish_reason"]["type"] if meta.get("finish_reason") else "abort"
        per_token = meta.get("output_token_versions")
        spans = versions_from_spans(meta.get("weight_versions"), len(ids))
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise ProtocolError(f"malformed /generate response: {type(e).__name__}: {e}") from None
    if len(lps) != len(ids):
        raise ProtocolError(f"/generate returned {len(ids)} tokens but {len(lps)} logprobs")
    if spans is not None:
        versions = spans
    elif isinstance(per_token, list) and len(per_token) == len(ids):
        versions = [parse_version(v) for v in per_token]
    else:
        versions = [parse_version(meta.get("weight_version"))] * len(ids)
    return ids, lps, versions, reason


def versions_from_spans(spans: Any, n: int) -> list[int] | None:
    """Per-token versions from SGLang's `meta_info.weight_versions` ([{version, start, end}], output
    token ranges in order; a request that ran across a refresh in place has several); None when the
    spans are absent or do not cover the n tokens exactly."""
    if not isinstance(spans, list) or not spans:
        return None
    out: list[int] = []
    for sp in spans:
        start, end = int(sp["start"]), int(sp["end"])
        if start != len(out) or end < start:
            return None
        out += [parse_version(sp["version"])] * (end - start)
    return out if len(out) == n else None
