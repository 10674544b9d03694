"""The hf engine in-process: logprobs equal a teacher-forced forward (batched, padded, with an image),
continuous batching beyond max_batch_size, sampling and stop rules, pause/abort semantics."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from PIL import Image

from asyncwebrl.inference.engine import EngineResult, HFEngine
from asyncwebrl.models.vlm import encode_image_b64
from asyncwebrl.protocol import GenerateRequest, ProtocolError, parse_request


@pytest.fixture(scope="module")
def engine(default_model_path):
    eng = HFEngine(default_model_path, max_batch_size=3, cpu_threads=1)
    eng.start()
    yield eng
    eng.stop()


def _req(ids, max_new=8, image=None, **sp) -> GenerateRequest:
    body = {"input_ids": ids, "return_logprob": True,
            "sampling_params": {"max_new_tokens": max_new, **sp}}
    if image is not None:
        body["image_data"] = [encode_image_b64(image)]
    return parse_request(GenerateRequest, body)


def _run(engine: HFEngine, reqs: list[GenerateRequest], timeout: float = 120) -> list[EngineResult]:
    results: dict[int, EngineResult] = {}
    done = threading.Event()

    def cb(i):
        def f(res):
            results[i] = res
            if len(results) == len(reqs):
                done.set()
        return f

    for i, r in enumerate(reqs):
        engine.submit(engine.prepare(r, cb(i)))
    assert done.wait(timeout), f"only {len(results)}/{len(reqs)} finished"
    return [results[i] for i in range(len(reqs))]


def _text_ids(engine, text):
    ad = engine.adapter
    return ad.encode(ad.chat_text([{"role": "user", "content": [{"type": "text", "text": text}]}])).input_ids


def _teacher_forced(engine, prompt, output, image=None, temperature=1.0):
    """Teacher-forced logprobs at the sampling temperature (what the trainer computes)."""
    ad = engine.adapter
    imgs = ad.encode_with_images_for_ids(prompt, [image] if image is not None else [])
    with torch.no_grad():
        logits = engine.model(**ad.collate([prompt + output], [imgs])).logits[0].float()
        lp = (logits / temperature).log_softmax(-1)
    return [float(lp[len(prompt) - 1 + j, t]) for j, t in enumerate(output)]


def test_logprobs_equal_teacher_forced_forward_batched_padded_and_with_image(engine):
    ad = engine.adapter
    img = Image.new("RGB", (160, 210), (30, 120, 220))
    img_prompt = ad.encode(ad.chat_text([{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "Click the blue button."}]}]), [img]).input_ids
    prompts = [_text_ids(engine, "Hi"), _text_ids(engine, "A much longer prompt about web agents and buttons."),
               img_prompt]
    reqs = [_req(prompts[0], 10, temperature=0.8, top_p=0.9, ignore_eos=True),
            _req(prompts[1], 14, temperature=1.0, top_k=20, ignore_eos=True),
            _req(prompts[2], 12, image=img, temperature=0.7, ignore_eos=True)]
    outs = _run(engine, reqs)
    for p, o, im, t in zip(prompts, outs, [None, None, img], [0.8, 1.0, 0.7], strict=True):
        assert o.finish_reason["type"] == "length" and len(o.output_ids) == len(o.logprobs)
        ref = _teacher_forced(engine, p, o.output_ids, im, temperature=t)
        assert max(abs(a - b) for a, b in zip(ref, o.logprobs, strict=True)) < 1e-3
    assert engine.stats["errors"] == 0


def test_more_requests_than_batch_slots_all_finish_with_their_own_lengths(engine):
    prompts = [_text_ids(engine, f"Count to {i}") for i in range(7)]
    outs = _run(engine, [_req(p, 3 + i, temperature=1.0, ignore_eos=True) for i, p in enumerate(prompts)])
    assert [len(o.output_ids) for o in outs] == [3 + i for i in range(7)]
    assert all(o.versions == ["0"] * len(o.output_ids) for o in outs)


def test_greedy_is_the_same_alone_and_batched(engine):
    p = _text_ids(engine, "The capital of France is")
    alone = _run(engine, [_req(p, 10, temperature=0, ignore_eos=True)])[0]
    batched = _run(engine, [_req(_text_ids(engine, "noise " * k), 12, temperature=1.0, ignore_eos=True)
                            for k in (1, 9)] + [_req(p, 10, temperature=0, ignore_eos=True)])[-1]
    assert alone.output_ids == batched.output_ids
    top1 = _run(engine, [_req(p, 10, temperature=1.0, top_k=1, ignore_eos=True)])[0]
    assert top1.output_ids == alone.output_ids


def test_stop_rules(engine):
    p = _text_ids(engine, "Write a list of fruits, one per line.")
    free = _run(engine, [_req(p, 24, temperature=0, ignore_eos=True)])[0]
    stop_tok = free.output_ids[3]
    by_tok = _run(engine, [_req(p, 24, temperature=0, ignore_eos=True, stop_token_ids=[stop_tok])])[0]
    assert by_tok.output_ids == free.output_ids[:free.output_ids.index(stop_tok) + 1]
    assert by_tok.finish_reason == {"type": "stop", "matched": stop_tok}
    piece = free.text[len(free.text) // 2:][:3]
    by_str = _run(engine, [_req(p, 24, temperature=0, ignore_eos=True, stop=[piece])])[0]
    assert by_str.finish_reason == {"type": "stop", "matched": piece}
    assert piece not in by_str.text and free.text.startswith(by_str.text)
    eos = _run(engine, [_req(p, 4, temperature=0, stop_token_ids=[], min_new_tokens=0)])[0]
    assert eos.finish_reason["type"] in ("stop", "length") and len(eos.output_ids) <= 4
    zero = _run(engine, [_req(p, 0)])[0]
    assert zero.output_ids == [] and zero.finish_reason["type"] == "length"


def test_pause_keeps_requests_and_abort_ends_them(engine):
    p = _text_ids(engine, "Tell me a long story.")
    results: list[EngineResult] = []
    engine.pause()
    try:
        engine.submit(engine.prepare(_req(p, 6, temperature=1.0, ignore_eos=True), results.append))
        deadline = time.time() + 60
        while engine.load_info()["waiting"] < 1 and time.time() < deadline:
            time.sleep(0.02)
        time.sleep(0.2)  # a paused engine must hold it: nothing may finish in this window
        assert results == [] and engine.load_info()["waiting"] == 1
    finally:
        engine.resume()
    deadline = time.time() + 60
    while not results and time.time() < deadline:
        time.sleep(0.05)
    assert len(results[0].output_ids) == 6
    r = _req(p, 500, temperature=1.0, ignore_eos=True)
    r.rid = "long"
    got: list[EngineResult] = []
    engine.submit(engine.prepare(r, got.append))
    deadline = time.time() + 60
    while (engine.stats["generated_tokens"] == 0 or not engine.load_info()["running"]) and time.time() < deadline:
        time.sleep(0.02)
    assert engine.abort(rid="long") == 1
    assert got[0].finish_reason["type"] == "abort" and len(got[0].output_ids) < 500
    assert len(got[0].output_ids) == len(got[0].logprobs) == len(got[0].versions)


def test_inputs_the_model_cannot_take_are_protocol_errors(engine):
    with pytest.raises(ProtocolError, match="context length"):
        engine.prepare(_req([1] * (engine.context_len + 1)), print)
    with pytest.raises(ProtocolError, match="requested token count exceeds"):  # SGLang refuses it too
        engine.prepare(_req([1] * (engine.context_len - 4), max_new=8), print)
    with pytest.raises(ProtocolError, match="vocab size"):
        engine.prepare(_req([engine.vocab_size + 5]), print)
    with pytest.raises(ProtocolError, match="image tokens"):
        engine.prepare(_req([engine.adapter.image_token_id] * 3, image=Image.new("RGB", (32, 32))), print)
    bad = parse_request(GenerateRequest, {"input_ids": [1], "image_data": ["bm90IGFuIGltYWdl"]})
    with pytest.raises(ProtocolError, match="undecodable"):
        engine.prepare(bad, print)


def test_a_row_with_non_finite_logits_ends_alone(engine, monkeypatch):
    """A sequence whose logits turn NaN (overflow, broken weights) is aborted by itself; the request
    decoded in the same batch goes on (without the guard, sampling raises and the whole batch dies).
    The NaN is injected into the poisoned row's logits just before sampling."""
    original = engine._append_tokens

    def poisoned(reqs, logits):
        for i, r in enumerate(reqs):
            if r.rid == "poison" and len(r.output_ids) >= 2:
                logits[i] = float("nan")
        return original(reqs, logits)

    monkeypatch.setattr(engine, "_append_tokens", poisoned)
    ids = _text_ids(engine, "Write a long poem.")
    victim = _req(ids, max_new=12, temperature=1.0, ignore_eos=True)
    bystander = _req(ids, max_new=12, temperature=1.0, ignore_eos=True)
    victim.rid, bystander.rid = "poison", "bystander"
    res = _run(engine, [victim, bystander])
    assert res[0].finish_reason["type"] == "abort" and "non-finite" in res[0].finish_reason["message"]
    assert len(res[0].output_ids) == 2
    assert res[1].finish_reason["type"] == "length" and len(res[1].output_ids) == 12
