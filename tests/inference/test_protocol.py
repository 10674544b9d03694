"""The shared schema: what parses, what is rejected with a message naming the field."""

from __future__ import annotations

import pytest

from asyncwebrl.protocol import (
    REQUEST_TYPES,
    GenerateRequest,
    InitWeightsUpdateGroupRequest,
    ProtocolError,
    UpdateWeightsFromDistributedRequest,
    build_generate_payload,
    parse_request,
    parse_version,
)


def test_generate_request_with_sglang_field_names_parses():
    r = parse_request(GenerateRequest, {
        "input_ids": [1, 2, 3], "image_data": "data:image/png;base64,AAAA", "return_logprob": True, "rid": "x",
        "sampling_params": {"max_new_tokens": 4, "temperature": 0, "top_p": 0.9, "top_k": 5,
                            "stop": ["\n"], "stop_token_ids": [2], "ignore_eos": True, "skip_special_tokens": False},
    })
    assert r.input_ids == [1, 2, 3] and r.split()[0].image_data == ["data:image/png;base64,AAAA"]
    assert r.sampling_params.temperature == 0.0 and r.sampling_params.stop_strings == ["\n"]


@pytest.mark.parametrize("body, needle", [
    ({"input_ids": [1], "bogus": 1}, "'bogus'"),
    ({"input_ids": [1], "sampling_params": {"max_new_token": 3}}, "'sampling_params.max_new_token'"),
    ({"input_ids": "1 2 3"}, "'input_ids'"),
    ({"input_ids": [1, "2"]}, "'input_ids[1]'"),
    ({"input_ids": [1], "sampling_params": {"temperature": "hot"}}, "'sampling_params.temperature'"),
    ({"input_ids": [1], "return_logprob": 1}, "'return_logprob'"),
    ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "top_p"),
    ({"input_ids": [1], "text": "hi"}, "exactly one"),
    ({}, "exactly one"),
    ({"input_ids": []}, "empty"),
    ([1, 2], "JSON object"),
    ({"input_ids": [1], "sampling_params": {"top_k": 0}}, "top_k must be -1"),
    ({"input_ids": [1], "sampling_params": {"temperature": float("nan")}}, "finite"),
    ({"input_ids": [1], "sampling_params": {"temperature": float("inf")}}, "finite"),
    ({"input_ids": [1], "sampling_params": {"temperature": -1}}, "non-negative"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": 2, "min_new_tokens": 3}}, "min_new_tokens"),
    ({"input_ids": [1], "sampling_params": {"frequency_penalty": 0.5}}, "not supported"),
    ({"input_ids": [[1], [2]], "rid": ["a"]}, "'rid' has 1 entries"),
    ({"input_ids": [[1], [2]], "rid": ["a", "a"]}, "duplicate"),
    ({"text": ["a", "b"], "image_data": ["x"]}, "'image_data' has 1 entries"),
    ({"text": ["a", "b"], "stream": True}, "stream"),
    ({"text": "a", "rid": ["x"]}, "not a batch"),
    ({"text": "a", "image_data": [["x"]]}, "single prompt"),
    ({"text": "a", "sampling_params": {"stop": ["x"] * 65}}, "at most 64 stop strings"),
    ({"text": "a", "sampling_params": {"stop": "x" * 513}}, "at most 64 stop strings"),
    ({"text": "a", "rid": "r" * 257}, "longer than 256"),
])
def test_bad_generate_bodies_name_the_problem(body, needle):
    with pytest.raises(ProtocolError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        parse_request(GenerateRequest, body)


def test_weight_update_bodies():
    r = parse_request(UpdateWeightsFromDistributedRequest, {
        "names": ["a", "b"], "dtypes": ["bfloat16", "torch.float32"], "shapes": [[2, 3], [4]], "weight_version": 7})
    assert r.weight_version == "7" and r.flush_cache and not r.abort_all_requests
    with pytest.raises(ProtocolError, match="same length"):
        parse_request(UpdateWeightsFromDistributedRequest, {"names": ["a"], "dtypes": [], "shapes": [[1]]})
    with pytest.raises(ProtocolError, match="unknown dtype"):
        parse_request(UpdateWeightsFromDistributedRequest, {"names": ["a"], "dtypes": ["float8"], "shapes": [[1]]})
    with pytest.raises(ProtocolError, match="missing required field 'master_port'"):
        parse_request(InitWeightsUpdateGroupRequest, {"master_address": "x", "rank_offset": 1, "world_size": 2})
    with pytest.raises(ProtocolError, match="rank_offset"):
        parse_request(InitWeightsUpdateGroupRequest,
                      {"master_address": "x", "master_port": 5, "rank_offset": 0, "world_size": 2})
    with pytest.raises(ProtocolError, match="backend"):
        parse_request(InitWeightsUpdateGroupRequest,
                      {"master_address": "x", "master_port": 5, "rank_offset": 1, "world_size": 2, "backend": "mpi"})


def test_every_post_endpoint_has_a_schema_that_accepts_its_minimal_body():
    minimal = {
        "/generate": {"text": "hi"},
        "/abort_request": {"abort_all": True},
        "/init_weights_update_group": {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
                                       "world_size": 2},
        "/update_weights_from_distributed": {"names": [], "dtypes": [], "shapes": []},
        "/update_weights_from_tensor": {"serialized_named_tensors": ["eA=="]},
        "/update_weights_from_disk": {"model_path": "/x"},
        "/update_weight_version": {"new_version": "3"},
    }
    for path, cls in REQUEST_TYPES.items():
        parse_request(cls, minimal.get(path, {}))


def test_client_payload_builder_checks_before_sending():
    body = build_generate_payload([1, 2], [b"\x89PNG"], {"max_new_tokens": 3}, rid="r")
    assert body["image_data"] == ["iVBORw=="] and body["return_logprob"] and body["rid"] == "r"
    with pytest.raises(ProtocolError, match="max_new_tokens"):
        build_generate_payload([1], None, {"max_new_tokens": -1})
    assert parse_version("4") == 4 and parse_version("default") == 0


def test_batches_split_into_one_request_per_prompt_as_sglang_does():
    r = parse_request(GenerateRequest, {
        "text": ["a", "b", "c"], "rid": "job", "return_logprob": [True, False, True],
        "image_data": ["img0", None, ["img2a", "img2b"]],
        "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": 2}, {"max_new_tokens": 3}]})
    assert r.is_batch and r.batch_size == 3
    parts = r.split()
    assert [p.text for p in parts] == ["a", "b", "c"] and [p.rid for p in parts] == ["job_0", "job_1", "job_2"]
    assert [p.image_data for p in parts] == [["img0"], None, ["img2a", "img2b"]]
    assert [p.return_logprob for p in parts] == [True, False, True]
    assert [p.sampling_params.max_new_tokens for p in parts] == [1, 2, 3]
    shared = parse_request(GenerateRequest, {"input_ids": [[1, 2], [3]], "image_data": "one",
                                             "sampling_params": {"max_new_tokens": 4}}).split()
    assert [p.input_ids for p in shared] == [[1, 2], [3]] and [p.image_data for p in shared] == [["one"], ["one"]]
    assert all(p.sampling_params.max_new_tokens == 4 and p.rid is None for p in shared)
    single = parse_request(GenerateRequest, {"input_ids": [5, 6], "image_data": ["i1", "i2"]})
    assert not single.is_batch and single.split()[0].image_data == ["i1", "i2"]


def test_sampling_conventions_follow_sglang():
    sp = parse_request(GenerateRequest, {"text": "a", "sampling_params": {"temperature": 3e-39}}).sampling_params
    assert sp.temperature == 0.0  # below 1e-6 is greedy: dividing logits by it would overflow
    sp = parse_request(GenerateRequest, {"text": "a", "sampling_params": {"temperature": None, "top_k": None,
                                                                          "max_new_tokens": None}}).sampling_params
    assert (sp.temperature, sp.top_k, sp.max_new_tokens) == (1.0, -1, 128)  # null = the default
    assert parse_request(GenerateRequest, {"text": "a", "sampling_params": {"top_k": 1}}).sampling_params.top_k == 1


def test_raw_json_parsing_refuses_what_json_loads_would_crash_on():
    from asyncwebrl.protocol import parse_json

    for raw, needle in [(b"[" * 100_000 + b"]" * 100_000, "malformed JSON"), (b'{"text": "\\ud800"}', "malformed JSON"),
                        (b'{"text": "a", "sampling_params": {"temperature": NaN}}', "finite"),
                        (b"\xff\xfe", "malformed JSON"), (b"{not json", "malformed JSON")]:
        with pytest.raises(ProtocolError, match=needle):
            parse_json(GenerateRequest, raw)
    assert parse_json(GenerateRequest, b'{"text": "\\u00e9t\\u00e9"}').text == "\u00e9t\u00e9"


def test_error_bodies_have_sglang_shape_and_every_shape_is_read():
    from asyncwebrl.protocol import error, error_message

    body = error("bad top_k")
    assert body["error"]["message"] == "bad top_k" and body["message"] == "bad top_k" and body["success"] is False
    assert error_message({"error": {"message": "from sglang"}}) == "from sglang"
    assert error_message({"error": "Unauthorized"}) == "Unauthorized"
    assert error_message({"detail": [{"msg": "field required"}]}).startswith("[{")
    assert error_message({"success": False, "message": "ours"}) == "ours"
