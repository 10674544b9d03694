"""A conformance check of a server against SGLang's documented native HTTP API.

    python -m asyncwebrl.inference.conformance http://127.0.0.1:30000 [--api-key-file F]

(key also from $ASYNCWEBRL_API_KEY). It speaks plain HTTP as any SGLang user would (urllib, no
project client), and checks: /health; /get_model_info and /model_info; /get_server_info and
/server_info; /generate for one prompt (text, input_ids), a batch of texts, a batch of input_ids
with a rid list, images (one prompt, and a batch with one image list per prompt) for Qwen-VL models;
return_logprob shapes ([logprob, token_id, text] per output token); streaming (SSE ending with
[DONE]); the error shape {"error": {"message"}} for a refused request (top_k=0) and for a context
overflow; /flush_cache; /abort_request; /pause_generation + /continue_generation; and
/update_weight_version (the version is read back, then restored). Control endpoints are also tried
without the key: they must refuse (401).

Invariant: exits 0 only when every check passed; each check prints one line `PASS|FAIL|SKIP name: detail`.
It changes the server's weight version only transiently (restored before it exits).
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
QWEN_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


@dataclass
class Check:
    name: str
    status: str
    """PASS, FAIL or SKIP"""
    detail: str = ""


class Skip(Exception):
    """The check does not apply to this server (e.g. images on a text-only model)."""


class Conformance:
    def __init__(self, url: str, api_key: str | None, timeout_s: float = 300.0):
        self.url, self.api_key, self.timeout_s = url.rstrip("/"), api_key, timeout_s
        self.results: list[Check] = []
        self._info: dict[str, Any] | None = None

    # ---- HTTP -----------------------------------------------------------------------------------
    def call(self, path: str, body: Any = None, *, method: str | None = None, key: bool = True,
             raw: bool = False) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        if key and self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(self.url + path, data=data, headers=headers,
                                     method=method or ("POST" if data is not None else "GET"))
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                text = r.read().decode()
                status = r.status
        except urllib.error.HTTPError as e:
            text, status = e.read().decode(), e.code
        if raw:
            return status, text
        try:
            return status, json.loads(text) if text else None
        except ValueError:
            return status, text

    def ok(self, path: str, body: Any = None, **kw) -> Any:
        status, out = self.call(path, body, **kw)
        if status != 200:
            raise AssertionError(f"{path} answered {status}: {str(out)[:300]}")
        return out

    # ---- helpers --------------------------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        if self._info is None:
            self._info = self.ok("/get_model_info")
        return self._info

    def image_prompt(self, text: str) -> str:
        if self.info().get("model_type") not in QWEN_TYPES:
            raise Skip(f"image placeholders unknown for model_type {self.info().get('model_type')!r}")
        return f"<|im_start|>user\n{QWEN_IMAGE}{text}<|im_end|>\n<|im_start|>assistant\n"

    @staticmethod
    def png(color: tuple[int, int, int], size: tuple[int, int] = (64, 48)) -> str:
        from PIL import Image

        buf = io.BytesIO()
        Image.new("RGB", size, color).save(buf, format="PNG")
        return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()

    @staticmethod
    def one_result(r: Any, *, logprobs: bool = False) -> None:
        assert isinstance(r, dict), f"a result is an object, got {type(r).__name__}"
        assert isinstance(r.get("text"), str), "result.text is a string"
        meta = r["meta_info"]
        for k in ("id", "finish_reason", "prompt_tokens", "completion_tokens"):
            assert k in meta, f"meta_info.{k} missing"
        assert meta["finish_reason"]["type"] in ("stop", "length", "abort"), meta["finish_reason"]
        if "output_ids" in r:
            assert len(r["output_ids"]) == meta["completion_tokens"], "output_ids vs completion_tokens"
        if logprobs:
            lps = meta["output_token_logprobs"]
            assert len(lps) == meta["completion_tokens"], "one logprob entry per output token"
            for lp, tok, txt in lps:
                assert isinstance(lp, float) and lp <= 0 and isinstance(tok, int), (lp, tok)
                assert txt is None or isinstance(txt, str)
            if "output_ids" in r:
                assert [t for _, t, _ in lps] == r["output_ids"], "logprob token ids = output_ids"

    @staticmethod
    def error_shape(status: int, body: Any, needle: str = "") -> None:
        assert status == 400, f"status {status}, expected 400"
        assert isinstance(body, dict) and isinstance(body.get("error"), dict), f"no error object: {body}"
        msg = body["error"].get("message")
        assert isinstance(msg, str) and msg, "error.message is a non-empty string"
        assert needle in msg, f"{needle!r} not in {msg!r}"

    # ---- checks ---------------------------------------------------------------------------------
    def checks(self) -> list[tuple[str, Callable[[], str]]]:
        sp = {"max_new_tokens": 4, "temperature": 0}

        def health() -> str:
            status, _ = self.call("/health")
            assert status == 200, status
            return "200"

        def model_info() -> str:
            for path in ("/get_model_info", "/model_info"):
                m = self.ok(path)
                assert isinstance(m.get("model_path"), str) and m.get("is_generation") is True, m
                assert isinstance(m.get("weight_version"), str), "weight_version is a string"
            return f"model_type={self.info().get('model_type')}"

        def server_info() -> str:
            for path in ("/get_server_info", "/server_info"):
                assert isinstance(self.ok(path), dict)
            return "ok"

        def generate_text() -> str:
            r = self.ok("/generate", {"text": "The capital of France is", "sampling_params": sp})
            self.one_result(r)
            assert r["meta_info"]["completion_tokens"] <= 4
            return repr(r["text"][:30])

        def generate_ids_logprob() -> str:
            ids = self.ok("/generate", {"text": "Hello", "sampling_params": dict(sp, max_new_tokens=1)})
            prompt = list(range(10, 20))
            r = self.ok("/generate", {"input_ids": prompt, "return_logprob": True,
                                      "sampling_params": {"max_new_tokens": 3, "temperature": 1.0,
                                                          "ignore_eos": True}})
            self.one_result(r, logprobs=True)
            assert r["meta_info"]["prompt_tokens"] == len(prompt) and r["meta_info"]["completion_tokens"] == 3
            return f"{len(r['meta_info']['output_token_logprobs'])} logprobs" + ("" if ids else "")

        def batch_text() -> str:
            r = self.ok("/generate", {"text": ["Hello", "World", "Paris is"], "sampling_params": sp})
            assert isinstance(r, list) and len(r) == 3, f"one result per prompt, got {type(r).__name__}"
            for x in r:
                self.one_result(x)
            assert len({x["meta_info"]["id"] for x in r}) == 3, "distinct ids"
            return "3 results"

        def batch_ids_rid() -> str:
            rids = ["conf-a", "conf-b"]
            r = self.ok("/generate", {"input_ids": [[10, 11, 12], [20, 21]], "rid": rids, "return_logprob": True,
                                      "sampling_params": [dict(sp, max_new_tokens=2), dict(sp, max_new_tokens=3)]})
            assert isinstance(r, list) and len(r) == 2
            for x in r:
                self.one_result(x, logprobs=True)
            assert [x["meta_info"]["id"] for x in r] == rids, "rid list is kept, in order"
            assert [x["meta_info"]["prompt_tokens"] for x in r] == [3, 2]
            assert [x["meta_info"]["completion_tokens"] <= n for x, n in zip(r, (2, 3), strict=True)] == [True] * 2
            return "ids and per-prompt sampling_params"

        def image_single() -> str:
            r = self.ok("/generate", {"text": self.image_prompt("What colour is this?"),
                                      "image_data": self.png((250, 10, 10)), "sampling_params": sp})
            self.one_result(r)
            assert r["meta_info"]["prompt_tokens"] > 10, "image tokens counted in the prompt"
            return f"prompt_tokens={r['meta_info']['prompt_tokens']}"

        def image_batch() -> str:
            prompts = [self.image_prompt("Colour?"), self.image_prompt("Colour?")]
            r = self.ok("/generate", {"text": prompts, "sampling_params": sp,
                                      "image_data": [[self.png((250, 10, 10))], [self.png((10, 10, 250), (32, 96))]]})
            assert isinstance(r, list) and len(r) == 2
            for x in r:
                self.one_result(x)
            return "2 results"

        def stream() -> str:
            status, text = self.call("/generate", {"text": "Count: one two", "stream": True,
                                                   "sampling_params": dict(sp, ignore_eos=True)}, raw=True)
            assert status == 200, status
            events = [ln[6:] for ln in text.split("\n") if ln.startswith("data: ")]
            assert events and events[-1] == "[DONE]", "the stream ends with data: [DONE]"
            last = json.loads(events[-2])
            self.one_result(last)
            return f"{len(events) - 1} chunks"

        def error_bad_param() -> str:
            status, body = self.call("/generate", {"text": "x", "sampling_params": {"top_k": 0}})
            self.error_shape(status, body, "top_k")
            return body["error"]["message"][:60]

        def error_context() -> str:
            ctx = self.info().get("context_length") or self.ok("/get_server_info").get("context_length")
            if not ctx:
                raise Skip("the server reports no context length")
            status, body = self.call("/generate", {"input_ids": [10] * 8, "sampling_params": {"max_new_tokens": ctx}})
            if status == 200:
                assert body["meta_info"]["completion_tokens"] <= ctx - 8
                return "clamped (server allows auto-truncate)"
            self.error_shape(status, body, "context")
            return body["error"]["message"][:60]

        def flush_abort() -> str:
            self.ok("/flush_cache", {})
            self.ok("/abort_request", {"rid": "conformance-no-such-request"})
            return "ok"

        def pause_continue() -> str:
            self.ok("/pause_generation", {"mode": "in_place"})
            self.ok("/continue_generation", {})
            self.one_result(self.ok("/generate", {"text": "Hi", "sampling_params": sp}))
            return "generates after continue"

        def weight_version() -> str:
            old = self.info()["weight_version"]
            try:
                self.ok("/update_weight_version", {"new_version": "conformance-1"})
                assert self.ok("/get_model_info")["weight_version"] == "conformance-1"
                r = self.ok("/generate", {"text": "Hi", "sampling_params": sp})
                assert r["meta_info"].get("weight_version", "conformance-1") == "conformance-1"
            finally:
                self.ok("/update_weight_version", {"new_version": old})
            return f"set and restored ({old!r})"

        def control_needs_key() -> str:
            for path, body in (("/update_weight_version", {"new_version": "intruder"}),
                               ("/pause_generation", {"mode": "in_place"}),
                               ("/update_weights_from_disk", {"model_path": "/tmp"})):
                status, _ = self.call(path, body, key=False)
                assert status == 401, f"{path} without the key answered {status}"
            assert self.info()["weight_version"] != "intruder"
            return "401 x3"

        return [("health", health), ("model_info", model_info), ("server_info", server_info),
                ("generate_text", generate_text), ("generate_input_ids_logprobs", generate_ids_logprob),
                ("batch_text", batch_text), ("batch_input_ids_rid", batch_ids_rid), ("image_single", image_single),
                ("image_batch", image_batch), ("stream", stream), ("error_shape_bad_param", error_bad_param),
                ("error_shape_context", error_context), ("flush_cache_abort_request", flush_abort),
                ("pause_continue", pause_continue), ("update_weight_version", weight_version),
                ("control_needs_key", control_needs_key)]

    def run(self) -> list[Check]:
        for name, fn in self.checks():
            try:
                self.results.append(Check(name, "PASS", fn()))
            except Skip as e:
                self.results.append(Check(name, "SKIP", str(e)))
            except Exception as e:  # a check that breaks is a failed check, the rest still run
                self.results.append(Check(name, "FAIL", f"{type(e).__name__}: {e}"))
        return self.results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("url")
    ap.add_argument("--api-key-file", default=None, help="file holding the key (else $ASYNCWEBRL_API_KEY)")
    args = ap.parse_args(argv)
    key = open(args.api_key_file).read().strip() if args.api_key_file else os.environ.get("ASYNCWEBRL_API_KEY")
    results = Conformance(args.url, key).run()
    for c in results:
        print(f"{c.status} {c.name}: {c.detail}")
    failed = [c for c in results if c.status == "FAIL"]
    print(f"{len(results) - len(failed)}/{len(results)} checks passed or skipped", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
