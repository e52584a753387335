"""Streaming plumbing between RequestStreams and HTTP: SSE, text deltas, disconnects, and the
one loop that streams both generation endpoints (openai_format says what each chunk holds).

A client that goes away, streamed or not, gets its engine requests aborted, which frees their KV
pages and adapter-slot references.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import anyio
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from moelora.errors import EngineDeadError
from moelora.server.async_engine import EngineError, RequestStream
from moelora.server.errors import exception_body

if TYPE_CHECKING:
    from moelora.step.request import RequestOutput


class EngineStreamingResponse(StreamingResponse):
    """SSE that aborts its engine requests when it ends early, whatever the ASGI version.

    The disconnect listener runs beside the stream, so a client that leaves while its request
    still waits for its first token is noticed at once.
    """

    def __init__(self, content: AsyncIterator[str], streams: list[RequestStream]) -> None:
        super().__init__(content, media_type="text/event-stream")
        self.streams = streams

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream_then_stop() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:  # the client left mid-send
                        pass
                    group.cancel_scope.cancel()

                group.start_soon(stream_then_stop)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            for stream in self.streams:
                stream.abort()


async def until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Any) -> Any:
    """Await `work`; if the client disconnects first, cancel it (which aborts its requests)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(until_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
    return task.result()


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


@dataclass(frozen=True)
class Delta:
    """What one output adds to a streamed choice."""

    start: int  # characters of the choice's generated text sent before this delta's
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None


class TextDeltas:
    """Turns cumulative outputs into deltas that are never taken back.

    Held back until the next token: a trailing U+FFFD (an incomplete UTF-8 sequence) and, when
    there are stop strings, as many characters as a stop string could still claim.
    """

    def __init__(self, stop: list[str] | None) -> None:
        self.holdback = max((len(s) for s in stop or []), default=1) - 1
        self.sent_text = 0
        self.sent_tokens = 0

    def next(self, out: RequestOutput) -> Delta:
        start = self.sent_text
        text = self._text(out)
        token_ids, logprobs = self._tokens(out)
        return Delta(start, text, token_ids, logprobs)

    def _text(self, out: RequestOutput) -> str:
        text = out.text
        end = len(text)
        if not out.finished:
            end = len(text.rstrip("\ufffd")) - self.holdback
        if end <= self.sent_text:
            return ""
        delta = text[self.sent_text : end]
        self.sent_text = end
        return delta

    def _tokens(self, out: RequestOutput) -> tuple[list[int], list[dict[int, float]] | None]:
        start, self.sent_tokens = self.sent_tokens, len(out.token_ids)
        logprobs = out.logprobs[start:] if out.logprobs is not None else None
        return out.token_ids[start:], logprobs


class ChunkFormat(Protocol):
    """How a streamed answer's outputs become its SSE chunks (openai_format's answers)."""

    def opening(self, num_choices: int) -> list[dict]: ...

    def chunks(self, index: int, out: RequestOutput, delta: Delta) -> Iterator[dict]: ...

    def usage_chunk(self, finals: list[RequestOutput | None]) -> dict: ...


async def sse_events(
    streams: list[RequestStream],
    answer: ChunkFormat,
    *,
    stop: list[str] | None,
    include_usage: bool,
) -> AsyncIterator[str]:
    """The SSE events of a streamed answer, one stream a choice: the opening chunks, each
    output's chunks in arrival order, the usage chunk when asked for, and `data: [DONE]` last,
    also after an engine failure, which is told in an error chunk of its own (the error JSON of
    a 500, or of a 503 when the engine is dead)."""
    deltas = [TextDeltas(stop) for _ in streams]
    finals: list[RequestOutput | None] = [None] * len(streams)
    try:
        for chunk in answer.opening(len(streams)):
            yield sse(chunk)
        async for i, out in merged(streams):
            if out.finished:
                finals[i] = out
            for chunk in answer.chunks(i, out, deltas[i].next(out)):
                yield sse(chunk)
        if include_usage:
            yield sse(answer.usage_chunk(finals))
    except (EngineError, EngineDeadError) as e:
        yield sse(exception_body(e)[1])
    yield "data: [DONE]\n\n"


async def last_outputs(streams: list[RequestStream]) -> list[RequestOutput]:
    return list(await asyncio.gather(*(_last_output(s) for s in streams)))


async def _last_output(stream: RequestStream) -> RequestOutput:
    last = None
    async for out in stream:
        last = out
    return last


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(index, output) pairs from several streams, in arrival order."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                await queue.put((i, out))
        except BaseException as e:
            await queue.put((i, e))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
