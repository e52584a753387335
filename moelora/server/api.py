"""The OpenAI-compatible HTTP API (FastAPI), in front of an AsyncEngine.

The `model` field picks the adapter: the base model's name means no adapter, an adapter's name
means that adapter. Errors answer with OpenAI's error JSON; the server keeps serving.

Unloading an adapter that still has running or waiting requests answers 409 (it does not wait
for them to drain): the caller retries when the traffic on that adapter has stopped.
"""

from __future__ import annotations

import dataclasses
import hmac
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from moelora.errors import AdapterExistsError
from moelora.sampling_params import SamplingParams, StructuredOutputsParams
from moelora.server import protocol, schema
from moelora.server.async_engine import AsyncEngine, GenerateInput, RequestStream
from moelora.server.errors import add_error_handlers
from moelora.server.json_body import StrictJsonRoute
from moelora.server.lora_gate import LoraGate
from moelora.server.metrics import CONTENT_TYPE
from moelora.server.openai_format import Answer, ChatAnswer, CompletionAnswer, prompt_tokens
from moelora.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    LoadLoraRequest,
    SamplingFields,
    UnloadLoraRequest,
)
from moelora.server.streaming import (
    EngineStreamingResponse,
    last_outputs,
    sse_events,
    unless_disconnected,
)
from moelora.server.tool_calls import tool_plan, tools_for_template


class ApiKeyMiddleware:
    """Every /v1 request needs `Authorization: Bearer <key>` (plain ASGI: streaming untouched)."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                body = protocol.error_body(
                    "missing or wrong API key: expected 'Authorization: Bearer <key>'",
                    "AuthenticationError",
                    code="invalid_api_key",
                )
                await JSONResponse(body, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(
    engine: AsyncEngine, *, api_key: str | None = None, lora_roots: tuple[Path | str, ...] = ()
) -> FastAPI:
    """`lora_roots`: the folders /v1/load_lora_adapter may load from (lora_gate says who may
    load what)."""
    app = FastAPI(title="moelora", docs_url=None, redoc_url=None)
    app.router.route_class = StrictJsonRoute  # every body read by json_body.parse_json
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    add_error_handlers(app)
    gate = LoraGate.of(tuple(lora_roots), has_api_key=bool(api_key))
    _add_generation_routes(app, engine)
    _add_adapter_routes(app, engine, gate)
    _add_service_routes(app, engine)
    schema.install(app, api_key=bool(api_key))
    return app


def _add_generation_routes(app: FastAPI, engine: AsyncEngine) -> None:
    @app.post(
        "/v1/completions",
        response_model=None,
        responses=schema.generation(schema.Completion, schema.CompletionChunk),
    )
    async def completions(body: CompletionRequest, raw: Request) -> Any:
        params, inputs = _completion_inputs(body, _lora_of(engine, body.model))
        request_id = protocol.new_id("cmpl")
        streams = await _start(engine, inputs, body.model, request_id)
        echo = [inp.prompt for inp in inputs] if body.echo else None
        tokens = prompt_tokens(streams, body.n)
        answer = CompletionAnswer(engine.tokenizer, request_id, body.model, tokens, echo, n=body.n)
        return await _respond(raw, body, streams, answer, params.stop)

    @app.post(
        "/v1/chat/completions",
        response_model=None,
        responses=schema.generation(schema.ChatCompletion, schema.ChatCompletionChunk),
    )
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Any:
        template = engine.tokenizer.chat_template if engine.tokenizer is not None else None
        constraint, parser = tool_plan(body, template)
        params, inputs = _chat_inputs(body, _lora_of(engine, body.model), constraint)
        request_id = protocol.new_id("chatcmpl")
        streams = await _start(engine, inputs, body.model, request_id)
        top, tokens = body.top_logprobs or 0, prompt_tokens(streams, body.n)
        answer = ChatAnswer(engine.tokenizer, request_id, body.model, tokens, top, parser, n=body.n)
        return await _respond(raw, body, streams, answer, params.stop)


def _completion_inputs(
    body: CompletionRequest, lora: str | None
) -> tuple[SamplingParams, list[GenerateInput]]:
    """Choice i is sample i % n of prompt i // n, as OpenAI numbers them."""
    default_max = body.max_tokens is None
    params = body.sampling_params(1 if default_max else body.max_tokens, body.logprobs)
    if body.echo and body.logprobs is not None:
        params = dataclasses.replace(params, prompt_logprobs=body.logprobs)
    prompts = [p for p in body.prompts() for _ in range(body.n)]
    samples = body.samples(params) * (len(prompts) // body.n)
    return params, [GenerateInput(p, s, lora, default_max) for p, s in zip(prompts, samples)]


def _chat_inputs(
    body: ChatCompletionRequest, lora: str | None, constraint: StructuredOutputsParams | None
) -> tuple[SamplingParams, list[GenerateInput]]:
    """constraint: what the tool choice constrains the output to, if anything."""
    max_tokens = body.requested_max_tokens
    params = body.sampling_params(1 if max_tokens is None else max_tokens, body.num_logprobs)
    if constraint is not None:
        params = dataclasses.replace(params, structured_outputs=constraint)
    messages = [m.for_template() for m in body.messages]
    default_max = max_tokens is None
    field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    tools = tools_for_template(body)
    return params, [
        GenerateInput(messages, p, lora, default_max, max_tokens_param=field, tools=tools)
        for p in body.samples(params)
    ]


def _lora_of(engine: AsyncEngine, model: str) -> str | None:
    """The base model's name means no adapter."""
    return None if model == engine.model_name else model


async def _start(
    engine: AsyncEngine, inputs: list[GenerateInput], model: str, request_id: str
) -> list[RequestStream]:
    """One engine request per choice; if admitting one fails, those admitted before it are
    aborted, so that no request runs for an answer nobody gets."""
    streams: list[RequestStream] = []
    try:
        for i, inp in enumerate(inputs):
            streams.append(await engine.generate(f"{request_id}-{i}", inp, model))
    except BaseException:
        for stream in streams:
            stream.abort()
        raise
    return streams


async def _respond(
    raw: Request,
    body: SamplingFields,
    streams: list[RequestStream],
    answer: Answer,
    stop: list[str] | None,
) -> Any:
    """SSE, or the whole answer once every choice has finished."""
    if body.stream:
        events = sse_events(streams, answer, stop=stop, include_usage=body.include_usage)
        return EngineStreamingResponse(events, streams)
    return await unless_disconnected(raw, _whole(streams, answer))


async def _whole(streams: list[RequestStream], answer: Answer) -> dict:
    return answer.response(await last_outputs(streams))


def _add_adapter_routes(app: FastAPI, engine: AsyncEngine, gate: LoraGate) -> None:
    @app.get(
        "/v1/models",
        response_model=None,
        responses={200: {"model": schema.ModelList, "description": "The base model first"}},
    )
    async def models() -> dict:
        base = engine.model_name
        cards = [protocol.model_card(base, parent=None, root=base)]
        where = {a.name: a for a in (await engine.stats()).adapters}
        for name, path in sorted(engine.adapter_paths().items()):
            card = protocol.model_card(name, parent=base, root=path)
            if name in where:  # where it lives and its queue, for a router
                card["residency"] = where[name].level
                card["num_requests_running"] = where[name].num_running
                card["num_requests_waiting"] = where[name].num_waiting
            cards.append(card)
        return {"object": "list", "data": cards}

    load_errors = (400, 403, 500, 503) if gate.may_refuse else (400, 500, 503)
    unload_errors = (
        (400, 403, 404, 409, 500, 503) if gate.updates_off else (400, 404, 409, 500, 503)
    )

    @app.post(
        "/v1/load_lora_adapter",
        response_class=PlainTextResponse,
        responses={200: schema.text("Loaded"), **schema.errors(*load_errors)},
    )
    async def load_lora_adapter(body: LoadLoraRequest) -> PlainTextResponse:
        path = gate.allowed_path(body.lora_path)  # before anything reads the path
        if body.lora_name == engine.model_name:
            raise AdapterExistsError(f"lora_name={body.lora_name!r} is the base model's name")
        await engine.load_lora(body.lora_name, path, replace=body.replace)
        done = "replaced" if body.replace else "added"
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' {done} successfully.")

    @app.post(
        "/v1/unload_lora_adapter",
        response_class=PlainTextResponse,
        responses={200: schema.text("Unloaded"), **schema.errors(*unload_errors)},
    )
    async def unload_lora_adapter(body: UnloadLoraRequest) -> PlainTextResponse:
        gate.check_unload()
        await engine.unload_lora(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def _add_service_routes(app: FastAPI, engine: AsyncEngine) -> None:
    @app.get(
        "/health",
        response_class=Response,
        responses={
            200: {"description": "Serving (an empty body)"},
            503: {
                "description": "The engine has stopped or the server is shutting down "
                "(an empty body)"
            },
        },
    )
    async def health() -> Response:
        return Response(status_code=200 if engine.admitting else 503)

    @app.get(
        "/metrics",
        response_class=Response,
        responses={
            200: schema.text("Prometheus text format", CONTENT_TYPE),
            **schema.errors(500, 503),
        },
    )
    async def metrics() -> Response:
        stats = await engine.stats()
        text = engine.metrics.render(stats, num_loras=len(engine.adapter_paths()))
        return Response(text, media_type=CONTENT_TYPE)
