"""What /openapi.json says the server answers: a model for every JSON body it sends, and for each
route the statuses it can return.

The models document; they never serialize. Routes build their JSON as openai_format does and
name these models in `responses=`, so the bytes sent are the ones the tests check, and the
schema test (tests/server/test_schema.py, schemathesis) checks that the two agree. Statuses that
hold for many routes are added once, by `install`: 401 and the bearer scheme on /v1 when the
server has an API key, 413 and 415 wherever a body is read (ingress refuses those before any
route runs). FastAPI's 422 is removed: the server answers a validation error with 400.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict
from pydantic.json_schema import models_json_schema

REF = "#/components/schemas/{model}"
# "abort": the server shut down before the request finished (its text is what was written)
FinishReason = Literal["stop", "length", "abort"]
ChatFinishReason = Literal["stop", "length", "tool_calls", "abort"]


class Sent(BaseModel):
    """A body the server sends: exactly these fields, so a field added or renamed in
    openai_format shows as a mismatch."""

    model_config = ConfigDict(extra="forbid")


class ErrorDetail(Sent):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(Sent):
    error: ErrorDetail


class PromptTokensDetails(Sent):
    cached_tokens: int  # prompt tokens whose KV came from the prefix cache


class Usage(Sent):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(Sent):
    tokens: list[str]
    token_logprobs: list[float | None]  # None for an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(Sent):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason


class Completion(Sent):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunkChoice(CompletionChoice):
    finish_reason: FinishReason | None


class CompletionChunk(Sent):
    """One SSE event; with stream_options.include_usage, the last one has no choices and the
    usage."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: Usage | None = None


class TopLogprob(Sent):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Sent):
    content: list[TokenLogprob] | None


class FunctionCall(Sent):
    name: str
    arguments: str  # JSON text


class ToolCall(Sent):
    id: str
    type: Literal["function"]
    function: FunctionCall


class FunctionCallDelta(Sent):
    name: str | None = None  # in the call's first chunk only
    arguments: str  # the next piece of the arguments' JSON text ("" in the first chunk)


class ToolCallDelta(Sent):
    """A streamed call: its first chunk has the id, type and name; each chunk after it only a
    piece of the arguments, which joined in order are the call's arguments."""

    index: int
    id: str | None = None  # in the call's first chunk only
    type: Literal["function"] | None = None  # in the call's first chunk only
    function: FunctionCallDelta


class AssistantMessage(Sent):
    role: Literal["assistant"]
    content: str | None  # None when tool calls are all the answer
    tool_calls: list[ToolCall] | None = None


class ChatChoice(Sent):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: ChatFinishReason


class ChatCompletion(Sent):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(Sent):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None  # one entry a chunk


class ChatChunkChoice(Sent):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: ChatFinishReason | None


class ChatCompletionChunk(Sent):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(Sent):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    parent: str | None  # None for the base model
    # adapters only: where it lives ("gpu": in a slot, "cpu": host memory, "disk": its folder
    # only) and its queues
    residency: Literal["gpu", "cpu", "disk"] | None = None
    num_requests_running: int | None = None
    num_requests_waiting: int | None = None


class ModelList(Sent):
    object: Literal["list"]
    data: list[ModelCard]


DESCRIPTIONS = {
    400: "Bad request: the message names the field (`param`) and what was expected",
    401: "Missing or wrong API key",
    403: "Runtime adapter loading is off, or the path is outside every --lora-root",
    404: "No model or adapter of that name",
    409: "The adapter has requests in flight",
    413: "The request body is larger than --max-request-bytes",
    415: "The Content-Type is neither application/json nor absent (a body without one, or "
    "typed application/x-www-form-urlencoded as `curl -d` types it, is read as JSON)",
    500: "The engine failed while serving",
    503: "The engine has stopped, or the server is shutting down",
}
BODY_STATUSES = (413, 415)


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """Always JSON, also on a route whose answer is text."""
    return {s: error_response(s) for s in statuses}


def error_response(status: int) -> dict[str, Any]:
    content = {"application/json": {"schema": {"$ref": REF.format(model="ErrorBody")}}}
    return {"description": DESCRIPTIONS[status], "content": content}


def generation(whole: type[Sent], chunk: type[Sent]) -> dict[int | str, dict[str, Any]]:
    """A generation route's responses: the answer whole, or as SSE when `stream` is true."""
    ok = {
        "model": whole,
        "description": f"The answer; with `stream: true`, server-sent events: each `data:` a "
        f"{chunk.__name__} (or an ErrorBody, if the engine fails), then `data: [DONE]`",
        "content": {"text/event-stream": {"itemSchema": _sse_item(chunk)}},
    }
    return {200: ok, **errors(400, 404, 500, 503)}


def text(description: str, media_type: str = "text/plain") -> dict[str, Any]:
    return {"description": description, "content": {media_type: {"schema": {"type": "string"}}}}


def _sse_item(chunk: type[Sent]) -> dict[str, Any]:
    """An SSE event as OpenAPI 3.2's itemSchema (and FastAPI's own SSE routes) write it: its
    data is JSON, or the [DONE] that ends the stream."""
    json_data = {
        "type": "string",
        "contentMediaType": "application/json",
        "contentSchema": {
            "oneOf": [
                {"$ref": REF.format(model=chunk.__name__)},
                {"$ref": REF.format(model="ErrorBody")},
            ]
        },
    }
    data = {"anyOf": [{"const": "[DONE]"}, json_data]}
    return {"type": "object", "required": ["data"], "properties": {"data": data}}


def install(app: FastAPI, *, api_key: bool) -> None:
    """Serve the finished schema at /openapi.json (built once, on the first request)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            spec = get_openapi(title=app.title, version=app.version, routes=app.routes)
            _finish(spec, api_key=api_key)
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented override


def _finish(spec: dict[str, Any], *, api_key: bool) -> None:
    components = spec.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    _, defs = models_json_schema(
        [(m, "serialization") for m in (CompletionChunk, ChatCompletionChunk, ErrorBody)],
        ref_template=REF,
    )
    schemas.update(defs.get("$defs", {}))
    _integral_bounds(spec)
    if api_key:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    for path, methods in spec["paths"].items():
        for operation in methods.values():
            _finish_operation(operation, auth=api_key and path.startswith("/v1"))


def _finish_operation(operation: dict[str, Any], *, auth: bool) -> None:
    responses = operation["responses"]
    responses.pop("422", None)
    added = [*(BODY_STATUSES if "requestBody" in operation else ()), *((401,) if auth else ())]
    for status in added:
        responses[str(status)] = error_response(status)
    if auth:
        operation["security"] = [{"bearer": []}]
    operation["responses"] = dict(sorted(responses.items()))


BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def _integral_bounds(node: Any) -> None:
    """FastAPI's OpenAPI model holds bounds as floats: 2**64 came out 1.8446744073709552e+19,
    which a validator compares as a float. Bounds that are whole numbers go back to ints, exact
    (those of the request fields are powers of two or small)."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in BOUNDS and isinstance(value, float) and value.is_integer():
                node[key] = int(value)
            else:
                _integral_bounds(value)
    elif isinstance(node, list):
        for item in node:
            _integral_bounds(item)
