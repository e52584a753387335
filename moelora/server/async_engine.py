"""AsyncEngine: the Engine on its own thread, driven from asyncio.

Every call into the Engine (and its tokenizer's encode) happens on the engine thread. The HTTP
side puts commands on a thread-safe queue; a command that answers carries a
concurrent.futures.Future the caller awaits. Outputs go back to each request's asyncio.Queue
through `loop.call_soon_threadsafe`, so the engine thread never touches asyncio objects directly.

The engine thread blocks on the command queue while the engine is idle and drains it without
blocking between steps while requests are in flight.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from moelora.sampling_params import SamplingParams

log = logging.getLogger("moelora.server")

Prompt = str | list[int] | list[dict[str, Any]]  # text, token ids, or chat messages


@dataclass(frozen=True)
class GenerateInput:
    prompt: Prompt
    params: SamplingParams
    lora: str | None
    default_max_tokens: bool = False  # max_tokens: whatever room max_model_len leaves


@dataclass
class _Tracked:
    """Engine-thread bookkeeping of one request in flight."""

    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue
    model: str
    arrival: float
    last_token_time: float | None = None
    num_tokens: int = 0


@dataclass
class _Command:
    fn: Callable[[], Any]
    future: concurrent.futures.Future | None = field(default=None)


class EngineError(RuntimeError):
    """The engine failed while serving (a bug, not the user's doing): HTTP 500."""


class EngineDeadError(EngineError):
    """The engine thread has stopped: HTTP 503."""


class RequestStream:
    """The outputs of one request, as an async iterator; closing it early aborts the request."""

    def __init__(self, engine: AsyncEngine, request_id: str, outputs: asyncio.Queue, first):
        self.request_id = request_id
        self.prompt_token_ids: list[int] = first
        self.finished = False
        self._engine = engine
        self._outputs = outputs

    def __aiter__(self) -> AsyncIterator:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator:
        try:
            while not self.finished:
                out = await self._outputs.get()
                if isinstance(out, BaseException):
                    self.finished = True
                    raise out
                self.finished = out.finished
                yield out
        finally:  # cancelled, or closed early by the consumer
            self.abort()

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)


class AsyncEngine:
    def __init__(
        self, build: Callable[[], Any], metrics: Any, lora_modules: dict[str, str] | None = None
    ) -> None:
        """`build` makes the Engine; it runs on the engine thread, like every later call.

        `lora_modules` (name -> path) are the adapters `build` registers; /v1/models shows them.
        """
        self.metrics = metrics
        self._commands: queue.SimpleQueue[_Command | None] = queue.SimpleQueue()
        self._tracked: dict[str, _Tracked] = {}  # engine thread only
        self._adapter_paths: dict[str, str] = {}  # engine thread writes; readers copy
        self._engine: Any = None
        self._dead: BaseException | None = None
        ready: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=self._run,
            args=(build, dict(lora_modules or {}), ready),
            name="moelora-engine",
            daemon=True,
        )
        self._thread.start()
        ready.result()  # re-raises whatever building the engine raised
        self.model_name: str = self._engine.model_name
        self.max_model_len: int = self._engine.max_model_len
        self.tokenizer = self._engine.tokenizer  # decode only, off the engine thread

    # ------------------------------------------------------------------ asyncio side

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self._dead is None

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run fn(engine) on the engine thread and return its result (or raise its error)."""
        if not self.alive:
            raise EngineDeadError(f"the engine thread has stopped: {self._dead!r}")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(_Command(lambda: fn(self._engine), future))
        return await asyncio.wrap_future(future)

    async def generate(self, request_id: str, inp: GenerateInput, model: str) -> RequestStream:
        """Admit a request; raises what Engine.add_request raises (before any output)."""
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()
        tracked = _Tracked(loop, outputs, model, arrival=time.perf_counter())
        try:
            prompt_ids = await self.call(lambda e: self._add(e, request_id, inp, tracked))
        except asyncio.CancelledError:  # the client left while the request was being admitted
            self.abort(request_id)
            raise
        return RequestStream(self, request_id, outputs, prompt_ids)

    def abort(self, request_id: str) -> None:
        self._commands.put(_Command(lambda: self._abort(request_id)))

    async def load_lora(self, name: str, path: str) -> None:
        await self.call(lambda engine: self._load(engine, name, path))

    async def unload_lora(self, name: str) -> None:
        await self.call(lambda engine: self._unload(engine, name))

    def adapter_paths(self) -> dict[str, str]:
        return dict(self._adapter_paths)

    async def stats(self) -> Any:
        return await self.call(lambda engine: engine.stats())

    def shutdown(self, timeout: float = 10.0) -> None:
        self._commands.put(None)
        self._thread.join(timeout)

    # ------------------------------------------------------------------ engine thread

    def _run(self, build: Callable, paths: dict[str, str], ready: concurrent.futures.Future):
        try:
            self._engine = build()
            self._adapter_paths = {n: str(paths.get(n, "")) for n in self._engine.list_loras()}
        except BaseException as e:
            ready.set_exception(e)
            return
        ready.set_result(None)
        try:
            while self._serve_commands():
                if self._engine.has_unfinished_requests():
                    self._step()
        except BaseException as e:  # a bug in the loop itself: fail everything, then stop
            log.exception("engine thread stopped")
            self._dead = e
            self._fail_all(e)
            self._fail_pending_commands(e)

    def _serve_commands(self) -> bool:
        """Run queued commands; block for one only when the engine has nothing to do."""
        block = not self._engine.has_unfinished_requests()
        while True:
            try:
                command = self._commands.get(block=block)
            except queue.Empty:
                return True
            if command is None:
                return False
            block = False
            try:
                result = command.fn()
            except Exception as e:
                if command.future is None:
                    log.exception("engine command failed")
                else:
                    command.future.set_exception(e)
            else:
                if command.future is not None:
                    command.future.set_result(result)

    def _add(self, engine: Any, request_id: str, inp: GenerateInput, tracked: _Tracked) -> list:
        if isinstance(inp.prompt, str):
            prompt_ids = engine.text_tokenizer("text prompts").encode(inp.prompt)
        elif inp.prompt and isinstance(inp.prompt[0], dict):
            prompt_ids = engine.text_tokenizer("chat messages").apply_chat_template(inp.prompt)
        else:
            prompt_ids = list(inp.prompt)
        params = inp.params
        if inp.default_max_tokens:
            room = max(1, engine.max_model_len - len(prompt_ids))
            params = dataclasses.replace(params, max_tokens=room)
        engine.add_request(request_id, prompt_ids, params, lora=inp.lora)
        self._tracked[request_id] = tracked
        self.metrics.prompt_tokens.inc(len(prompt_ids), model=tracked.model)
        return prompt_ids

    def _abort(self, request_id: str) -> None:
        tracked = self._tracked.pop(request_id, None)
        self._engine.abort_request(request_id)
        if tracked is not None:
            self.metrics.requests.inc(model=tracked.model, status="abort")

    def _load(self, engine: Any, name: str, path: str) -> None:
        engine.load_lora(name, path)
        self._adapter_paths = {**self._adapter_paths, name: path}

    def _unload(self, engine: Any, name: str) -> None:
        engine.unload_lora(name)
        self._adapter_paths = {n: p for n, p in self._adapter_paths.items() if n != name}

    def _step(self) -> None:
        try:
            outputs = self._engine.step()
        except Exception as e:  # an engine bug: fail the requests in flight, keep serving
            log.exception("engine step failed; aborting %d requests", len(self._tracked))
            self._fail_all(e)
            return
        now = time.perf_counter()
        for out in outputs:
            tracked = self._tracked.get(out.request_id)
            if tracked is None:  # aborted while the step ran
                continue
            self._record_tokens(tracked, len(out.token_ids), now)
            if out.finished:
                del self._tracked[out.request_id]
                self.metrics.requests.inc(model=tracked.model, status=out.finish_reason)
            self._deliver(tracked, out)

    def _record_tokens(self, tracked: _Tracked, num_tokens: int, now: float) -> None:
        new = num_tokens - tracked.num_tokens
        if new <= 0:
            return
        if tracked.last_token_time is None:
            self.metrics.ttft.observe(now - tracked.arrival)
            new_gaps = new - 1
        else:
            new_gaps = new
        for _ in range(new_gaps):
            self.metrics.itl.observe((now - (tracked.last_token_time or now)) / new_gaps)
        tracked.last_token_time, tracked.num_tokens = now, num_tokens
        self.metrics.generation_tokens.inc(new, model=tracked.model)

    @staticmethod
    def _deliver(tracked: _Tracked, item: Any) -> None:
        try:
            tracked.loop.call_soon_threadsafe(tracked.outputs.put_nowait, item)
        except RuntimeError:  # the event loop has closed: the server is shutting down
            pass

    def _fail_all(self, error: BaseException) -> None:
        for request_id, tracked in list(self._tracked.items()):
            del self._tracked[request_id]
            self._deliver(tracked, EngineError(f"the engine failed: {error!r}"))
            self.metrics.requests.inc(model=tracked.model, status="error")
            try:
                self._engine.abort_request(request_id)
            except Exception:
                log.exception("abort of %s failed", request_id)

    def _fail_pending_commands(self, error: BaseException) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command is not None and command.future is not None:
                command.future.set_exception(EngineDeadError(f"the engine failed: {error!r}"))
