"""The static-cache engine (GraphEngine, graphs off on the CPU) against the plain engine: same greedy
tokens with requests joining and leaving, logprobs equal a teacher-forced forward at the sampling
temperature, abort of a running slot, and weights written in place are what the next step uses."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from PIL import Image

from asyncwebrl.inference.engine import EngineResult, HFEngine
from asyncwebrl.inference.graph_engine import (
    LEAN_ABS_TOL,
    LEAN_KV0_TOL,
    LEAN_NOISE_FACTOR,
    GraphEngine,
    make_engine,
)
from asyncwebrl.models.prepare import resolve_model_path
from asyncwebrl.models.vlm import encode_image_b64
from asyncwebrl.protocol import GenerateRequest, parse_request


@pytest.fixture(scope="module")
def qwen_path() -> str:
    return resolve_model_path("tiny-qwen2.5-vl")


@pytest.fixture(scope="module")
def engines(qwen_path):
    plain = HFEngine(qwen_path, max_batch_size=3, cpu_threads=1)
    graph = GraphEngine(qwen_path, max_batch_size=3, cpu_threads=1, max_context_len=512)
    assert graph.decoder is not None and not graph.decoder.use_graphs
    for e in (plain, graph):
        e.start()
    yield plain, graph
    for e in (plain, graph):
        e.stop()


def _req(ids, max_new=8, image=None, **sp) -> GenerateRequest:
    body = {"input_ids": ids, "return_logprob": True, "sampling_params": {"max_new_tokens": max_new, **sp}}
    if image is not None:
        body["image_data"] = [encode_image_b64(image)]
    return parse_request(GenerateRequest, body)


def _run(engine, reqs, timeout: float = 180) -> list[EngineResult]:
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


def _prompts(engine):
    ad = engine.adapter
    img = Image.new("RGB", (160, 210), (30, 120, 220))
    img_prompt = ad.encode(ad.chat_text([{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "Click the blue button."}]}]), [img]).input_ids

    def text(t):
        return ad.encode(ad.chat_text([{"role": "user", "content": [{"type": "text", "text": t}]}])).input_ids

    return [(text("Hi"), None), (img_prompt, img), (text("A much longer prompt about web agents and buttons."), None),
            (text("Second"), None), (img_prompt, img)], img


def test_greedy_tokens_equal_the_plain_engine_with_joins_and_leaves(engines):
    plain, graph = engines
    prompts, _ = _prompts(graph)
    # 5 requests through 3 slots, different lengths: rows leave mid-batch and waiting ones join
    lens = [5, 12, 3, 9, 7]
    outs = {}
    for name, eng in (("plain", plain), ("graph", graph)):
        reqs = [_req(p, n, image=im, temperature=0, ignore_eos=True) for (p, im), n in zip(prompts, lens, strict=True)]
        outs[name] = _run(eng, reqs)
    for a, b, n in zip(outs["plain"], outs["graph"], lens, strict=True):
        assert len(b.output_ids) == n
        assert a.output_ids == b.output_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-3
    assert graph.stats["prefill_batches"] < graph.stats["prefills"]  # prefills were batched
    assert graph.stats["lean_prefill"] == 1 and graph.stats["lean_prefill_min_cosine"] > 0.999


def test_steps_launched_ahead_drop_tokens_past_a_stop_and_keep_the_plain_outputs(engines):
    """Decode steps are launched before the host has read the previous token (decode_pipeline.py): a
    request that stops on a stop token or a stop string is launched once more, and that token must be
    dropped; outputs and finish reasons equal the one-step-at-a-time plain engine's."""
    plain, graph = engines
    prompts, _ = _prompts(graph)
    ref = _run(plain, [_req(p, 10, image=im, temperature=0, ignore_eos=True) for p, im in prompts[:3]])
    stop_tok = ref[0].output_ids[3]  # stops request 0 at its 4th token (or earlier, where it recurs)
    stop_str = graph.adapter.tokenizer.decode(ref[1].output_ids[4:6])
    cases = [({"stop_token_ids": [stop_tok]}, prompts[0]), ({"stop": [stop_str]}, prompts[1]),
             ({"ignore_eos": True}, prompts[2])]
    ahead, generated = graph.stats["steps_ahead"], graph.stats["generated_tokens"]
    outs = {}
    for name, eng in (("plain", plain), ("graph", graph)):
        outs[name] = _run(eng, [_req(p, 10, image=im, temperature=0, **sp) for sp, (p, im) in cases])
    for a, b in zip(outs["plain"], outs["graph"], strict=True):
        assert (a.output_ids, a.finish_reason, a.text) == (b.output_ids, b.finish_reason, b.text)
        assert len(b.logprobs) == len(b.versions) == len(b.output_ids)
    assert outs["graph"][0].finish_reason == {"type": "stop", "matched": stop_tok}
    assert outs["graph"][1].finish_reason["type"] == "stop" and len(outs["graph"][1].output_ids) < 10
    assert graph.stats["steps_ahead"] > ahead  # the path under test ran: steps launched one ahead
    assert graph.stats["generated_tokens"] == generated + sum(len(o.output_ids) for o in outs["graph"])


def test_lean_prefill_check_refuses_a_path_that_ignores_mrope(engines, monkeypatch):
    """The real lean path passes the start-up check (first-layer KV and last hidden states, the latter
    against transformers' own batch-vs-alone noise); one that drops the M-RoPE positions of an image
    prompt (plain 1-D positions) is refused, by its first-layer keys."""
    _, graph = engines
    st = dict(graph.stats)
    assert st["lean_prefill_distance"] <= LEAN_NOISE_FACTOR * st["lean_prefill_reference_noise"] + LEAN_ABS_TOL
    real = graph.decoder.prefill_text

    def one_d_positions(slots, **kw):  # every M-RoPE section gets the plain text position
        n, t = kw["inputs_embeds"].shape[:2] if kw.get("inputs_embeds") is not None else kw["input_ids"].shape
        kw["position_ids"] = torch.arange(t, device=graph.device)[None, None].expand(3, n, t)
        return real(slots, **kw)

    monkeypatch.setattr(graph.decoder, "prefill_text", one_d_positions)
    try:
        with graph.lock:
            assert graph._check_lean_prefill() is False
        assert graph.stats["lean_prefill_kv0_distance"] > 100 * LEAN_KV0_TOL > 1e3 * st["lean_prefill_kv0_distance"]
    finally:
        graph.stats.update({k: v for k, v in st.items() if k.startswith("lean_prefill")})


def test_a_burst_still_being_prepared_is_prefilled_together(engines, monkeypatch):
    """With nothing running, a prefill waits (up to GATHER_S) while other requests are inside prepare():
    a closed loop's wave becomes one prefill, not a small one and then the rest."""
    import asyncwebrl.inference.graph_engine as ge

    _, graph = engines
    monkeypatch.setattr(ge, "GATHER_S", 5.0)  # generous: a loaded CPU box must not split the burst
    prompts, _ = _prompts(graph)
    before = graph.stats["prefill_batches"]
    results: list[EngineResult] = []
    done = threading.Event()

    def cb(res):
        results.append(res)
        if len(results) == 2:
            done.set()

    with graph._cond:
        graph.preparing += 1  # the second request is still being prepared
    try:
        graph.submit(graph.prepare(_req(prompts[0][0], 3, temperature=0), cb))
        time.sleep(0.3)
        assert graph.stats["prefill_batches"] == before  # waiting for the rest of the burst
        graph.submit(graph.prepare(_req(prompts[3][0], 3, temperature=0), cb))
    finally:
        with graph._cond:
            graph.preparing -= 1
            graph._cond.notify_all()
    assert done.wait(120)
    assert graph.stats["prefill_batches"] == before + 1


def _teacher_forced(engine, prompt, output, image, temperature):
    ad = engine.adapter
    imgs = ad.encode_with_images_for_ids(prompt, [image] if image is not None else [])
    with torch.no_grad():
        logits = engine.model(**ad.collate([prompt + output], [imgs])).logits[0].float()
    lp = (logits / temperature).log_softmax(-1)
    return [float(lp[len(prompt) - 1 + j, t]) for j, t in enumerate(output)]


def test_sampled_logprobs_equal_teacher_forced_forward(engines):
    _, graph = engines
    prompts, _ = _prompts(graph)
    cases = [(prompts[0], 10, {"temperature": 0.8}), (prompts[1], 12, {"temperature": 0.7}),
             (prompts[2], 9, {"temperature": 1.0, "top_k": 20})]  # top_k: sampled on the CPU path
    outs = _run(graph, [_req(p, n, image=im, ignore_eos=True, **sp) for (p, im), n, sp in cases])
    for ((p, im), _, sp), o in zip(cases, outs, strict=True):
        ref = _teacher_forced(graph, p, o.output_ids, im, sp["temperature"])
        assert max(abs(a - b) for a, b in zip(ref, o.logprobs, strict=True)) < 1e-3


def test_abort_a_running_slot_keeps_the_others(engines):
    _, graph = engines
    prompts, _ = _prompts(graph)
    started = threading.Event()
    results: dict[str, EngineResult] = {}
    done = threading.Event()

    def on_done(res):
        results[res.rid] = res
        if len(results) == 2:
            done.set()

    def on_token(r):
        if len(r.output_ids) >= 2:
            started.set()

    reqs = []
    for rid, (p, im) in (("a", prompts[0]), ("b", prompts[2])):
        r = _req(p, 200, image=im, temperature=0, ignore_eos=True)
        r.rid = rid
        reqs.append(graph.prepare(r, on_done, on_token))
    for r in reqs:
        graph.submit(r)
    assert started.wait(60)
    assert graph.abort(rid="a") == 1
    assert done.wait(120)
    assert results["a"].finish_reason["type"] == "abort"
    assert results["b"].finish_reason["type"] == "length" and len(results["b"].output_ids) == 200
    # b moved into slot 0 when a left: its tokens still equal the plain engine's
    plain_b = _run(engines[0], [_req(prompts[2][0], 200, temperature=0, ignore_eos=True)])[0]
    assert plain_b.output_ids == results["b"].output_ids


def test_weights_written_in_place_change_the_next_tokens(qwen_path):
    eng = GraphEngine(qwen_path, max_batch_size=2, cpu_threads=1, max_context_len=256)
    eng.start()
    try:
        prompts, _ = _prompts(eng)
        req = _req(prompts[0][0], 6, temperature=0, ignore_eos=True)
        before = _run(eng, [req])[0].output_ids
        with eng.exclusive():
            for name, p in eng.named_parameters().items():
                if "language_model" in name and ("q_proj" in name or "up_proj" in name):
                    p.data.copy_(torch.randn_like(p) * 0.5)  # in place: the fused buffers see it
            assert not eng.decoder.weights_moved()
            q = next(p for n, p in eng.named_parameters().items() if "language_model" in n and "q_proj" in n)
            kept = q.data
            q.data = kept.clone()  # rebound, not written: the decoder must notice (and rebuild)
            assert eng.decoder.weights_moved()
            q.data = kept
            assert not eng.decoder.weights_moved()
        after = _run(eng, [_req(prompts[0][0], 6, temperature=0, ignore_eos=True)])[0].output_ids
        assert after != before
        # the plain forward of the same (updated) model agrees with the static path
        with torch.no_grad():
            ids = list(prompts[0][0])
            for tok in after:
                nxt = int(eng.model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
                assert nxt == tok
                ids.append(nxt)
    finally:
        eng.stop()


def test_make_engine_picks_by_device_and_env(qwen_path, monkeypatch):
    monkeypatch.setenv("ASYNCWEBRL_ENGINE", "bogus")
    with pytest.raises(ValueError, match="auto, plain or graph"):
        make_engine(qwen_path)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the GPU machine)")
def test_cuda_graphs_and_compiled_layers_give_the_plain_engines_greedy_tokens(qwen_path):
    plain = HFEngine(qwen_path, device="cuda", max_batch_size=4)
    graph = GraphEngine(qwen_path, device="cuda", max_batch_size=4, max_context_len=512)
    assert graph.decoder.use_graphs
    for e in (plain, graph):
        e.start()
    try:
        assert graph.stats["graphs"] > 0 and graph.stats["lean_prefill"] == 1
        prompts, _ = _prompts(graph)
        lens = [5, 12, 3, 9, 7]
        outs = [_run(e, [_req(p, n, image=im, temperature=0, ignore_eos=True)
                         for (p, im), n in zip(prompts, lens, strict=True)]) for e in (plain, graph)]
        for a, b in zip(*outs, strict=True):
            assert a.output_ids == b.output_ids
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-3
        assert graph.stats["steps_ahead"] > 0  # steps were launched before the host read the last token
        assert graph.decoder.prefill_graphs  # the small prefills replayed graphs
    finally:
        for e in (plain, graph):
            e.stop()


def test_placeholder_tokens_are_never_generated(engines):
    _, graph = engines
    assert graph.adapter.image_token_id in graph.decoder.banned.tolist()
    prompts, _ = _prompts(graph)
    first = _run(graph, [_req(prompts[0][0], 6, temperature=0, ignore_eos=True)])[0].output_ids
    saved = graph.decoder.banned
    try:  # ban what greedy decoding picked: the prefill and every decode step must avoid it
        graph.decoder.banned = torch.tensor(sorted(set(first)))
        again = _run(graph, [_req(prompts[0][0], 6, temperature=0, ignore_eos=True)])[0]
    finally:
        graph.decoder.banned = saved
    assert not set(again.output_ids) & set(first)
    assert all(lp > float("-inf") for lp in again.logprobs)


def test_host_mrope_positions_equal_those_of_the_models_batched_forward(engines):
    """The prefill's M-RoPE positions are computed per request on the host (models/mrope.py): they equal
    what transformers computes inside a padded batch of an image prompt and a text prompt."""
    from asyncwebrl.models.mrope import batch_positions

    _, graph = engines
    assert graph.stats["host_mrope"] == 1
    prompts, img = _prompts(graph)
    ad = graph.adapter
    encs = [ad.encode_with_images_for_ids(p, [im] if im is not None else []) for p, im in prompts[:3]]
    seen = {}
    inner = graph.model.model
    lm = graph.decoder.lm

    def capture(**kw):
        seen["pos"] = kw["position_ids"]
        raise StopIteration

    batch = ad.collate([p for p, _ in prompts[:3]], encs)
    inner.rope_deltas = None
    lm.forward = capture
    try:
        with pytest.raises(StopIteration), torch.no_grad():
            inner(**batch, use_cache=False)
    finally:
        del lm.forward
    ref = seen["pos"][-3:]  # newer transformers prepend the text positions as a 4th row
    host = [graph.mrope(p, e) for (p, _), e in zip(prompts[:3], encs, strict=True)]
    got = batch_positions([h[0] for h in host], ref.shape[-1])
    for i, (p, _) in enumerate(prompts[:3]):
        assert torch.equal(got[:, i, : len(p)], ref[:, i, : len(p)])
    assert [h[1] for h in host] == [int(d) for d in inner.rope_deltas.reshape(3, -1)[:, 0]]
    assert host[1][1] != 0  # the image prompt's delta is not the trivial one
