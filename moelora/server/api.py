"""The OpenAI-compatible HTTP API (FastAPI), in front of an AsyncEngine.

The `model` field picks the adapter: the base model's name means no adapter, an adapter's name
means that adapter. Errors answer with OpenAI's error JSON; the server keeps serving.

Unloading an adapter that still has running or waiting requests answers 409 (it does not wait
for them to drain): the caller retries when the traffic on that adapter has stopped.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from moelora.errors import (
    AdapterBusyError,
    AdapterError,
    AdapterExistsError,
    AdapterNotFoundError,
    InvalidRequestError,
    MoeloraError,
)
from moelora.server import protocol
from moelora.server.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineError,
    GenerateInput,
    RequestStream,
)
from moelora.server.metrics import CONTENT_TYPE
from moelora.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    LoadLoraRequest,
    UnloadLoraRequest,
)
from moelora.server.streaming import (
    EngineStreamingResponse,
    TextDeltas,
    last_output,
    merged,
    sse,
    unless_disconnected,
)

log = logging.getLogger("moelora.server")

# status, OpenAI error type, code; the most specific class first
ERRORS: list[tuple[type[Exception], int, str, str | None]] = [
    (AdapterNotFoundError, 404, "NotFoundError", "model_not_found"),
    (AdapterBusyError, 409, "ConflictError", "adapter_busy"),
    (AdapterExistsError, 400, "BadRequestError", "adapter_exists"),
    (AdapterError, 400, "BadRequestError", "invalid_adapter"),
    (InvalidRequestError, 400, "BadRequestError", None),
    (MoeloraError, 400, "BadRequestError", None),
    (EngineDeadError, 503, "ServiceUnavailableError", None),
    (EngineError, 500, "InternalServerError", None),
]


def error_response(status: int, message: str, type_: str, **kw: Any) -> JSONResponse:
    return JSONResponse(protocol.error_body(message, type_, **kw), status_code=status)


def exception_response(e: Exception) -> JSONResponse:
    for cls, status, type_, code in ERRORS:
        if isinstance(e, cls):
            return error_response(status, str(e), type_, code=code)
    log.exception("unexpected error", exc_info=e)
    return error_response(500, f"internal error: {e!r}", "InternalServerError")


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


def build_app(engine: AsyncEngine, *, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="moelora", docs_url=None, redoc_url=None)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    _add_error_handlers(app)

    def lora_of(model: str) -> str | None:
        return None if model == engine.model_name else model

    def token_text(token_id: int) -> str:
        return engine.tokenizer.decode([token_id])

    async def start(
        inputs: list[GenerateInput], model: str, request_id: str
    ) -> list[RequestStream]:
        streams: list[RequestStream] = []
        try:
            for i, inp in enumerate(inputs):
                streams.append(await engine.generate(f"{request_id}-{i}", inp, model))
        except BaseException:
            for stream in streams:
                stream.abort()
            raise
        return streams

    # ------------------------------------------------------------------ completions

    def completion_logprobs(
        token_ids: list[int], logprobs: list[dict[int, float]] | None, offset: int
    ) -> dict | None:
        if logprobs is None:
            return None
        tokens = [token_text(t) for t in token_ids]
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.get(t) for t, lp in zip(token_ids, logprobs)],
            "top_logprobs": [{token_text(k): v for k, v in lp.items()} for lp in logprobs],
            "text_offset": offsets,
        }

    def echoed(prompt: str | list[int], out: Any) -> tuple[str, dict | None]:
        """echo=true: the prompt's text (as sent, or decoded from its ids) and, with logprobs,
        its tokens' entries (the first token has none, as in OpenAI's and vLLM's answers)."""
        text = prompt if isinstance(prompt, str) else engine.tokenizer.decode(prompt)
        if out.prompt_logprobs is None:
            return text, None
        ids = out.prompt_token_ids
        rest = completion_logprobs(ids[1:], out.prompt_logprobs[1:], len(token_text(ids[0])))
        first = token_text(ids[0])
        return text, {
            "tokens": [first, *rest["tokens"]],
            "token_logprobs": [None, *rest["token_logprobs"]],
            "top_logprobs": [None, *rest["top_logprobs"]],
            "text_offset": [0, *rest["text_offset"]],
        }

    def with_echo(choice: dict, echo: tuple[str, dict | None]) -> dict:
        """The choice with the echoed prompt in front of its text and logprobs."""
        text, logprobs = echo
        choice = {**choice, "text": text + choice["text"]}
        if logprobs is not None and choice["logprobs"] is not None:
            gen = choice["logprobs"]
            shift = [o + len(text) for o in gen["text_offset"]]
            choice["logprobs"] = {k: logprobs[k] + gen[k] for k in logprobs if k != "text_offset"}
            choice["logprobs"]["text_offset"] = logprobs["text_offset"] + shift
        return choice

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Any:
        default_max = body.max_tokens is None
        params = body.sampling_params(1 if default_max else body.max_tokens, body.logprobs)
        if body.echo and body.logprobs is not None:
            params = dataclasses.replace(params, prompt_logprobs=body.logprobs)
        lora = lora_of(body.model)
        # choice i is sample i % n of prompt i // n, as OpenAI numbers them
        prompts = [p for p in body.prompts() for _ in range(body.n)]
        samples = body.samples(params) * (len(prompts) // body.n)
        inputs = [GenerateInput(p, s, lora, default_max) for p, s in zip(prompts, samples)]
        request_id = protocol.new_id("cmpl")
        streams = await start(inputs, body.model, request_id)
        head = {"id": request_id, "object": "text_completion", "created": protocol.now()}
        head["model"] = body.model
        echo = prompts if body.echo else None
        if body.stream:
            return EngineStreamingResponse(
                stream_completion(head, streams, params.stop, body.include_usage, body.n, echo),
                streams,
            )
        return await unless_disconnected(raw, complete_completion(head, streams, body.n, echo))

    async def complete_completion(
        head: dict, streams: list[RequestStream], n: int, echo: list | None
    ) -> dict:
        finals = await asyncio.gather(*(last_output(s) for s in streams))
        choices = []
        for i, out in enumerate(finals):
            choice = {
                "index": i,
                "text": out.text,
                "logprobs": completion_logprobs(out.token_ids, out.logprobs, 0),
                "finish_reason": out.finish_reason,
            }
            choices.append(with_echo(choice, echoed(echo[i], out)) if echo else choice)
        return {**head, "choices": choices, "usage": total_usage(streams, finals, n)}

    async def stream_completion(
        head: dict,
        streams: list[RequestStream],
        stop: list[str] | None,
        include_usage: bool,
        n: int,
        echo: list | None,
    ) -> AsyncIterator[str]:
        deltas = [TextDeltas(stop) for _ in streams]
        finals: list[Any] = [None] * len(streams)
        echoing = [echo is not None] * len(streams)  # the prompt goes first, once per choice
        try:
            async for i, out in merged(streams):
                if echoing[i]:
                    echoing[i] = False
                    text, logprobs = echoed(echo[i], out)
                    choice = {"index": i, "text": text, "logprobs": logprobs}
                    yield sse({**head, "choices": [{**choice, "finish_reason": None}]})
                    deltas[i].offset = len(text)
                text_offset = deltas[i].offset + deltas[i].sent_text
                text = deltas[i].text(out)
                token_ids, logprobs = deltas[i].tokens(out)
                if not text and not out.finished and logprobs is None:
                    continue
                choice = {
                    "index": i,
                    "text": text,
                    "logprobs": completion_logprobs(token_ids, logprobs, text_offset),
                    "finish_reason": out.finish_reason if out.finished else None,
                }
                if out.finished:
                    finals[i] = out
                yield sse({**head, "choices": [choice]})
            if include_usage:
                yield sse({**head, "choices": [], "usage": total_usage(streams, finals, n)})
        except EngineError as e:
            yield sse(protocol.error_body(str(e), "InternalServerError"))
        yield "data: [DONE]\n\n"

    # ------------------------------------------------------------------ chat

    def chat_logprobs(
        token_ids: list[int], logprobs: list[dict[int, float]] | None, top: int
    ) -> dict | None:
        if logprobs is None:
            return None

        def entry(token_id: int, logprob: float) -> dict:
            text = token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        content = []
        for t, lp in zip(token_ids, logprobs):
            best = sorted(lp.items(), key=lambda kv: -kv[1])[:top]
            content.append({**entry(t, lp[t]), "top_logprobs": [entry(k, v) for k, v in best]})
        return {"content": content}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Any:
        max_tokens = body.requested_max_tokens
        params = body.sampling_params(max_tokens or 1, body.num_logprobs)
        messages = [m.for_template() for m in body.messages]
        lora, default_max = lora_of(body.model), max_tokens is None
        inputs = [GenerateInput(messages, p, lora, default_max) for p in body.samples(params)]
        request_id = protocol.new_id("chatcmpl")
        streams = await start(inputs, body.model, request_id)
        head = {"id": request_id, "object": "chat.completion", "created": protocol.now()}
        head["model"] = body.model
        top = body.top_logprobs or 0
        if body.stream:
            chunks = stream_chat(head, streams, params.stop, top, body.include_usage)
            return EngineStreamingResponse(chunks, streams)
        return await unless_disconnected(raw, complete_chat(head, streams, top))

    async def complete_chat(head: dict, streams: list[RequestStream], top: int) -> dict:
        finals = await asyncio.gather(*(last_output(s) for s in streams))
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": out.text},
                "logprobs": chat_logprobs(out.token_ids, out.logprobs, top),
                "finish_reason": out.finish_reason,
            }
            for i, out in enumerate(finals)
        ]
        return {**head, "choices": choices, "usage": total_usage(streams, finals, len(streams))}

    async def stream_chat(
        head: dict,
        streams: list[RequestStream],
        stop: list[str] | None,
        top: int,
        include_usage: bool,
    ) -> AsyncIterator[str]:
        head = {**head, "object": "chat.completion.chunk"}

        def chunk(i: int, delta: dict, finish_reason: str | None = None, logprobs: Any = None):
            choice = {"index": i, "delta": delta, "logprobs": logprobs}
            return sse({**head, "choices": [{**choice, "finish_reason": finish_reason}]})

        deltas = [TextDeltas(stop) for _ in streams]
        finals: list[Any] = [None] * len(streams)
        try:
            for i in range(len(streams)):
                yield chunk(i, {"role": "assistant", "content": ""})
            async for i, out in merged(streams):
                text = deltas[i].text(out)
                token_ids, logprobs = deltas[i].tokens(out)
                logprobs_json = chat_logprobs(token_ids, logprobs, top)
                if out.finished:
                    finals[i] = out
                    delta = {"content": text} if text else {}
                    yield chunk(i, delta, out.finish_reason, logprobs_json)
                elif text or logprobs_json:
                    yield chunk(i, {"content": text}, None, logprobs_json)
            if include_usage:
                usage = total_usage(streams, finals, len(streams))
                yield sse({**head, "choices": [], "usage": usage})
        except EngineError as e:
            yield sse(protocol.error_body(str(e), "InternalServerError"))
        yield "data: [DONE]\n\n"

    # ------------------------------------------------------------------ adapters, models

    @app.get("/v1/models")
    async def models() -> dict:
        base = engine.model_name
        cards = [protocol.model_card(base, parent=None, root=base)]
        for name, path in sorted(engine.adapter_paths().items()):
            cards.append(protocol.model_card(name, parent=base, root=path))
        return {"object": "list", "data": cards}

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoraRequest) -> PlainTextResponse:
        if body.lora_name == engine.model_name:
            raise AdapterExistsError(f"lora_name={body.lora_name!r} is the base model's name")
        await engine.load_lora(body.lora_name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoraRequest) -> PlainTextResponse:
        await engine.unload_lora(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    # ------------------------------------------------------------------ health, metrics

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.alive else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        stats = await engine.stats()
        text = engine.metrics.render(stats, num_loras=len(engine.adapter_paths()))
        return Response(text, media_type=CONTENT_TYPE)

    return app


def total_usage(streams: list[RequestStream], finals: list[Any], n: int) -> dict[str, int]:
    """Prompt tokens once per prompt (its n samples share it, as OpenAI counts), completion
    tokens of every sample."""
    prompt = sum(len(s.prompt_token_ids) for s in streams[::n])
    completion = sum(len(out.token_ids) for out in finals if out is not None)
    return protocol.usage(prompt, completion)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(MoeloraError)
    @app.exception_handler(EngineError)
    async def engine_error(_: Request, e: Exception) -> JSONResponse:
        return exception_response(e)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        message = first.get("msg", "invalid request")
        if param:
            message = f"{param}: {message}"
        return error_response(400, message, "BadRequestError", param=param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = {404: "NotFoundError", 405: "MethodNotAllowedError"}.get(e.status_code, "Error")
        return error_response(e.status_code, str(e.detail), kind)

    @app.exception_handler(Exception)
    async def unexpected(_: Request, e: Exception) -> JSONResponse:
        return exception_response(e)
