"""The inference HTTP protocol: SGLang's native API subset that the whole system speaks (SPEC section 3).

This is the ONE schema module shared by the embedded `hf` server and the rollout-side client, so
the two cannot drift. Every request body is a dataclass whose field names are SGLang's exact
names; `parse_request(cls, body)` turns untrusted JSON into one of them or raises `ProtocolError`
(the server answers HTTP 400 with its message). Builders produce the JSON the client sends.

Invariant: a body that parses has only known fields, each of the declared type, within range;
anything else is a `ProtocolError` with a message naming the field. No pickle anywhere: bodies are
JSON, tensors travel by torch.distributed broadcast, images as base64 / data-URI strings.
"""

from __future__ import annotations

import base64
import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

ENDPOINTS_POST = (
    "/generate",
    "/pause_generation",
    "/continue_generation",
    "/flush_cache",
    "/abort_request",
    "/init_weights_update_group",
    "/update_weights_from_distributed",
    "/destroy_weights_update_group",
    "/update_weights_from_disk",
    "/update_weight_version",
    "/begin_weight_update",
    "/end_weight_update",
)
ENDPOINTS_GET = ("/health", "/model_info", "/get_model_info", "/server_info", "/weights_checksum")

TORCH_DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int8", "uint8", "bool")


class ProtocolError(ValueError):
    """A request that does not follow the protocol (HTTP 400 on the server side)."""


# ---- request bodies ------------------------------------------------------------------------------


@dataclass(kw_only=True)
class SamplingParams:
    """`sampling_params` of /generate (SGLang names and defaults)."""

    max_new_tokens: int = 128
    """most tokens to generate (clamped to the context window)"""
    temperature: float = 1.0
    """0 = greedy"""
    top_p: float = 1.0
    """nucleus sampling mass, in (0, 1]"""
    top_k: int = -1
    """keep the k most likely tokens; -1 or 0 = all"""
    min_p: float = 0.0
    """drop tokens whose probability is below min_p * max probability"""
    stop: str | list[str] | None = None
    """stop strings; the text is cut before the match unless no_stop_trim"""
    stop_token_ids: list[int] | None = None
    """token ids that end generation (the token is kept in output_ids)"""
    ignore_eos: bool = False
    """keep generating past the model's end-of-sequence tokens"""
    skip_special_tokens: bool = True
    """drop special tokens from the returned text"""
    min_new_tokens: int = 0
    """EOS and stop tokens are not honoured before this many tokens"""
    no_stop_trim: bool = False
    """keep the matched stop string in the text"""
    n: int = 1
    """samples per request (only 1 is supported)"""

    def validate(self) -> None:
        if self.max_new_tokens < 0:
            raise ProtocolError("sampling_params.max_new_tokens must be >= 0")
        if self.temperature < 0:
            raise ProtocolError("sampling_params.temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ProtocolError("sampling_params.top_p must be in (0, 1]")
        if self.top_k < -1:
            raise ProtocolError("sampling_params.top_k must be -1 (all) or >= 0")
        if not 0 <= self.min_p <= 1:
            raise ProtocolError("sampling_params.min_p must be in [0, 1]")
        if self.min_new_tokens < 0:
            raise ProtocolError("sampling_params.min_new_tokens must be >= 0")
        if self.n != 1:
            raise ProtocolError("sampling_params.n must be 1 (send several requests instead)")
        if self.stop_token_ids and any(t < 0 for t in self.stop_token_ids):
            raise ProtocolError("sampling_params.stop_token_ids must be non-negative")

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]


@dataclass(kw_only=True)
class GenerateRequest:
    """Body of POST /generate."""

    input_ids: list[int] | None = None
    """prompt token ids, image placeholders already expanded (VLMAdapter.encode)"""
    text: str | None = None
    """prompt text (the server tokenizes and expands image placeholders)"""
    image_data: list[str] | str | None = None
    """prompt images: base64 or data-URI strings, in placeholder order"""
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    """see SamplingParams"""
    return_logprob: bool = False
    """return meta_info.output_token_logprobs = [[logprob, token_id, null], ...]"""
    logprob_start_len: int = -1
    """accepted for compatibility; prompt logprobs are never returned"""
    top_logprobs_num: int = 0
    """accepted for compatibility; must be 0"""
    return_text_in_logprobs: bool = False
    """accepted for compatibility; the third logprob element is always null"""
    rid: str | None = None
    """request id (for /abort_request); generated when absent"""
    stream: bool = False
    """server-sent events with the cumulative output, ending with 'data: [DONE]'"""

    def validate(self) -> None:
        if (self.input_ids is None) == (self.text is None):
            raise ProtocolError("give exactly one of 'input_ids' or 'text'")
        if self.input_ids is not None:
            if not self.input_ids:
                raise ProtocolError("'input_ids' is empty")
            if any(t < 0 for t in self.input_ids):
                raise ProtocolError("'input_ids' holds a negative token id")
        if self.text is not None and not self.text:
            raise ProtocolError("'text' is empty")
        if self.top_logprobs_num != 0:
            raise ProtocolError("top_logprobs_num is not supported (must be 0)")
        if isinstance(self.image_data, str):
            self.image_data = [self.image_data]
        self.sampling_params.validate()


@dataclass(kw_only=True)
class PauseGenerationRequest:
    """Body of POST /pause_generation."""

    mode: Literal["in_place", "retract", "abort"] = "abort"
    """SGLang's modes and default: abort = running requests end now with finish_reason abort;
    in_place/retract: they are kept and continue after /continue_generation"""


@dataclass(kw_only=True)
class EmptyRequest:
    """Body of endpoints that take no parameters (/continue_generation, /flush_cache)."""


@dataclass(kw_only=True)
class AbortRequest:
    """Body of POST /abort_request."""

    rid: str = ""
    """request id to abort"""
    abort_all: bool = False
    """abort every queued and running request"""

    def validate(self) -> None:
        if not self.rid and not self.abort_all:
            raise ProtocolError("give 'rid' or 'abort_all': true")


@dataclass(kw_only=True)
class InitWeightsUpdateGroupRequest:
    """Body of POST /init_weights_update_group."""

    master_address: str
    """host of the trainer's rank 0 (the TCPStore master)"""
    master_port: int
    """TCPStore port on the trainer's rank 0"""
    rank_offset: int
    """this server's rank in the group (1 + server index for tp=1)"""
    world_size: int
    """trainer rank 0 + every server"""
    group_name: str = "weight_update_group"
    """store prefix and name of the group"""
    backend: Literal["gloo", "nccl"] = "nccl"
    """gloo on CPU, nccl on GPU"""

    def validate(self) -> None:
        if not 0 < self.master_port < 65536:
            raise ProtocolError("master_port must be in 1..65535")
        if self.world_size < 2:
            raise ProtocolError("world_size must be >= 2 (trainer rank 0 + servers)")
        if not 0 < self.rank_offset < self.world_size:
            raise ProtocolError("rank_offset must be in 1..world_size-1 (rank 0 is the trainer)")


@dataclass(kw_only=True)
class UpdateWeightsFromDistributedRequest:
    """Body of POST /update_weights_from_distributed (inside a /begin_weight_update session)."""

    names: list[str]
    """parameter names (the model's named_parameters()), in broadcast order"""
    dtypes: list[str]
    """torch dtype names without 'torch.' (e.g. 'bfloat16'), one per name"""
    shapes: list[list[int]]
    """tensor shapes, one per name"""
    group_name: str = "weight_update_group"
    """the group formed by /init_weights_update_group"""
    flush_cache: bool = True
    """drop cached prefixes afterwards"""
    abort_all_requests: bool = False
    """end in-flight requests with finish_reason abort instead of pausing them"""
    weight_version: str | int | None = None
    """new weight version once this announcement is in (the refresh bracket sets it once, at the end)"""
    load_format: Literal["flattened_bucket"] | None = None
    """null: one broadcast per tensor; "flattened_bucket": one broadcast of the tensors' bytes laid end to end"""
    bucket_sizes: list[int] | None = None
    """extension (hf backend, advertised in /server_info weight_update_extensions): tensors per
    flattened bucket, so one announcement covers every bucket of a refresh"""
    selector: Literal["target", "draft", "all"] = "all"
    """accepted for compatibility (no draft model here)"""
    torch_empty_cache: bool = False
    """accepted for compatibility"""

    def validate(self) -> None:
        if not (len(self.names) == len(self.dtypes) == len(self.shapes)):
            raise ProtocolError("names, dtypes and shapes must have the same length")
        for d in self.dtypes:
            if d.removeprefix("torch.") not in TORCH_DTYPES:
                raise ProtocolError(f"unknown dtype '{d}'; one of {', '.join(TORCH_DTYPES)}")
        for s in self.shapes:
            if any(x < 0 for x in s):
                raise ProtocolError(f"negative dimension in shape {s}")
        if len(set(self.names)) != len(self.names):
            raise ProtocolError("names must be unique within one announcement")
        if self.bucket_sizes is not None:
            if self.load_format != "flattened_bucket":
                raise ProtocolError("bucket_sizes needs load_format 'flattened_bucket'")
            if any(n <= 0 for n in self.bucket_sizes) or sum(self.bucket_sizes) != len(self.names):
                raise ProtocolError("bucket_sizes must be positive and add up to the number of names")
        if self.weight_version is not None:
            self.weight_version = str(self.weight_version)


@dataclass(kw_only=True)
class BeginWeightUpdateRequest:
    """Body of POST /begin_weight_update (opens the update session SGLang 0.5.x requires)."""

    selector: Literal["target", "draft", "all"] = "all"
    """accepted for compatibility (no draft model here)"""


@dataclass(kw_only=True)
class DestroyWeightsUpdateGroupRequest:
    """Body of POST /destroy_weights_update_group."""

    group_name: str = "weight_update_group"
    """the group to tear down"""


@dataclass(kw_only=True)
class UpdateWeightsFromDiskRequest:
    """Body of POST /update_weights_from_disk."""

    model_path: str
    """HF model folder with safetensors weights"""
    weight_version: str | int | None = None
    """new weight version once loaded"""
    abort_all_requests: bool = False
    """end in-flight requests with finish_reason abort instead of pausing them"""
    load_format: str | None = None
    """accepted for compatibility; must be null"""

    def validate(self) -> None:
        if self.load_format is not None:
            raise ProtocolError("load_format is not supported by the hf backend")
        if self.weight_version is not None:
            self.weight_version = str(self.weight_version)


@dataclass(kw_only=True)
class UpdateWeightVersionRequest:
    """Body of POST /update_weight_version."""

    new_version: str | int
    """the version to report from now on"""
    abort_all_requests: bool = False
    """end in-flight requests with finish_reason abort"""

    def validate(self) -> None:
        self.new_version = str(self.new_version)


REQUEST_TYPES: dict[str, type] = {
    "/generate": GenerateRequest,
    "/pause_generation": PauseGenerationRequest,
    "/continue_generation": EmptyRequest,
    "/flush_cache": EmptyRequest,
    "/abort_request": AbortRequest,
    "/init_weights_update_group": InitWeightsUpdateGroupRequest,
    "/update_weights_from_distributed": UpdateWeightsFromDistributedRequest,
    "/destroy_weights_update_group": DestroyWeightsUpdateGroupRequest,
    "/update_weights_from_disk": UpdateWeightsFromDiskRequest,
    "/update_weight_version": UpdateWeightVersionRequest,
    "/begin_weight_update": BeginWeightUpdateRequest,
    "/end_weight_update": EmptyRequest,
}


# ---- parsing -------------------------------------------------------------------------------------


def parse_request(cls: type, body: Any, where: str = "") -> Any:
    """Untrusted JSON value -> dataclass `cls`; ProtocolError on unknown, missing or wrong-typed fields."""
    if body is None:
        body = {}
    if not isinstance(body, dict):
        raise ProtocolError(f"{where or 'body'} must be a JSON object, got {type(body).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(body) - set(fields))
    if unknown:
        raise ProtocolError(
            f"unknown field(s) {', '.join(repr(u) for u in unknown)} in {where or cls.__name__}; "
            f"known: {', '.join(fields)}"
        )
    kwargs = {}
    for name, f in fields.items():
        path = f"{where}.{name}" if where else name
        if name not in body:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ProtocolError(f"missing required field '{path}'")
            continue
        kwargs[name] = _check(hints[name], body[name], path)
    obj = cls(**kwargs)
    if hasattr(obj, "validate"):
        obj.validate()
    return obj


def _check(tp: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        errors = []
        for alt in typing.get_args(tp):
            try:
                return _check(alt, value, path)
            except ProtocolError as e:
                errors.append(str(e))
        deeper = [e for e in errors if not e.startswith(f"'{path}' ")]
        if deeper:  # the value had the right shape; an element inside it is wrong
            raise ProtocolError(deeper[0])
        raise ProtocolError(f"'{path}' has the wrong type ({_json_type(value)}); expected {_type_name(tp)}")
    if tp is type(None):
        if value is not None:
            raise ProtocolError(f"'{path}' must be null")
        return None
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ProtocolError(f"'{path}' must be one of {list(typing.get_args(tp))}, got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ProtocolError(f"'{path}' must be a list, got {_json_type(value)}")
        (inner,) = typing.get_args(tp)
        return [_check(inner, v, f"{path}[{i}]") for i, v in enumerate(value)]
    if dataclasses.is_dataclass(tp):
        return parse_request(tp, value, path)
    if tp is bool:
        if not isinstance(value, bool):
            raise ProtocolError(f"'{path}' must be a boolean, got {_json_type(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ProtocolError(f"'{path}' must be an integer, got {_json_type(value)}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ProtocolError(f"'{path}' must be a number, got {_json_type(value)}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ProtocolError(f"'{path}' must be a string, got {_json_type(value)}")
        return value
    raise TypeError(f"protocol type {tp} of {path} is not supported by the checker")


def _json_type(v: Any) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "list", dict: "object"}.get(
        type(v), "null" if v is None else type(v).__name__
    )


def _type_name(tp: Any) -> str:
    return str(tp).replace("typing.", "")


# ---- responses -----------------------------------------------------------------------------------


def finish_reason(kind: Literal["stop", "length", "abort"], **extra: Any) -> dict[str, Any]:
    """SGLang's finish_reason object: {"type": kind, ...} (matched / length / message)."""
    return {"type": kind, **extra}


def ok(message: str = "", **extra: Any) -> dict[str, Any]:
    return {"success": True, "message": message, **extra}


def error(message: str) -> dict[str, Any]:
    return {"success": False, "message": message}


@dataclass
class GenerationOutput:
    """What the client returns for one prompt, after any abort-resubmit rounds.

    Invariant: output_ids, output_logprobs and output_versions have equal length; output_versions[i]
    is the weight version that produced output_ids[i].
    """

    output_ids: list[int]
    """generated token ids (a matched EOS / stop token is included)"""
    output_logprobs: list[float]
    """logprob of each generated token under the raw (temperature 1) distribution that sampled it"""
    output_versions: list[int]
    """weight version that produced each token"""
    text: str
    """decoded text of all generated tokens (stop string trimmed)"""
    finish_reason: Literal["stop", "length"]
    """why generation ended"""
    prompt_tokens: int
    """length of the original prompt"""
    server: str
    """address of the server that finished the request"""
    latency_s: float
    """wall time from the first submission to the final answer"""
    n_resubmits: int = 0
    """how many times the request came back aborted and was resubmitted"""


def build_generate_payload(
    input_ids: list[int],
    image_data: list[str | bytes] | None,
    sampling: dict[str, Any],
    rid: str | None = None,
    return_logprob: bool = True,
) -> dict[str, Any]:
    """The JSON body of /generate the client sends; checked against GenerateRequest before sending."""
    images = None
    if image_data:
        images = [base64.b64encode(im).decode() if isinstance(im, bytes) else im for im in image_data]
    body: dict[str, Any] = {
        "input_ids": [int(t) for t in input_ids],
        "sampling_params": dict(sampling),
        "return_logprob": return_logprob,
    }
    if images:
        body["image_data"] = images
    if rid is not None:
        body["rid"] = rid
    parse_request(GenerateRequest, body)  # fail on the client side, with the same message
    return body


def parse_version(v: Any) -> int:
    """SGLang reports weight_version as a string ('default' before any update); ours are integers."""
    try:
        return int(v)
    except (TypeError, ValueError):
        return 0
