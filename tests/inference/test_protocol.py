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
    assert r.input_ids == [1, 2, 3] and r.image_data == ["data:image/png;base64,AAAA"]
    assert r.sampling_params.temperature == 0.0 and r.sampling_params.stop_strings == ["\n"]


@pytest.mark.parametrize("body, needle", [
    ({"input_ids": [1], "bogus": 1}, "'bogus'"),
    ({"input_ids": [1], "sampling_params": {"max_new_token": 3}}, "'max_new_token'"),
    ({"input_ids": "1 2 3"}, "'input_ids'"),
    ({"input_ids": [1, "2"]}, "'input_ids[1]'"),
    ({"input_ids": [1], "sampling_params": {"temperature": "hot"}}, "'sampling_params.temperature'"),
    ({"input_ids": [1], "return_logprob": 1}, "'return_logprob'"),
    ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "top_p"),
    ({"input_ids": [1], "text": "hi"}, "exactly one"),
    ({}, "exactly one"),
    ({"input_ids": []}, "empty"),
    ([1, 2], "JSON object"),
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
