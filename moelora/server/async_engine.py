"""AsyncEngine: the Engine on its own thread, driven from asyncio.

Every call into the Engine happens on the engine thread, which only ever sees token ids: a
prompt is tokenized (and a chat templated) in a worker pool first, and refused there when its
text could not fit max_model_len tokens (ingress.prompt_char_limit) or its max_tokens does not
fit what the prompt leaves. The tokenizer is shared by those workers and the engine thread
(which decodes). What that relies on: a Hugging Face fast tokenizer is read-only while nobody
changes its truncation or padding (moelora never does; a change takes Rust's exclusive borrow and
would fail a concurrent encode with "Already borrowed"), and its encode runs in Rust without the
GIL, holding it only to build the Python list of ids (bounded by the character limit).

The HTTP side puts commands on a thread-safe queue; a command that answers carries a
concurrent.futures.Future the caller awaits. Outputs go back to each request's asyncio.Queue
through `loop.call_soon_threadsafe`, so the engine thread never touches asyncio objects directly.

The engine thread blocks on the command queue while the engine is idle and drains it without
blocking between steps while requests are in flight.

An engine that cannot go on (an EngineDeadError: a tensor-parallel rank died or a collective
failed; or the loop itself raised) is dead for good: the cause is logged once, every request in
flight and every waiting command fails with an EngineDeadError (HTTP 503), and so does every
later call, while `alive` turns False (/health 503). A failure of one step that leaves the engine
able to go on fails only the requests in that step (EngineError, HTTP 500).

A drain (the server's shutdown) stops admitting at once: every new request, adapter load and
unload fails with a ShuttingDownError (HTTP 503), and `admitting` turns False (/health 503). The
requests already running go on until they finish or the drain's timeout passes; then each one
still running is aborted and ends with its last output, finish_reason "abort".
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import os
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from moelora.errors import EngineDeadError
from moelora.sampling_params import SamplingParams
from moelora.server.ingress import prompt_char_limit
from moelora.server.protocol import FieldError
from moelora.tokenizer import Tokenizer

if TYPE_CHECKING:  # the engine (torch, the kernels) is imported where one is built
    from moelora.engine.engine import Engine, EngineStats
    from moelora.step.request import RequestOutput

log = logging.getLogger("moelora.server")

Prompt = str | list[int] | list[dict[str, Any]]  # text, token ids, or chat messages


@dataclass(frozen=True)
class GenerateInput:
    prompt: Prompt
    params: SamplingParams
    lora: str | None
    default_max_tokens: bool = False  # max_tokens: whatever room max_model_len leaves
    max_tokens_param: str = "max_tokens"  # the field that set it, named when it is refused
    tools: list[dict[str, Any]] | None = None  # a chat's tools, for its template to show


@dataclass
class _Tracked:
    """Engine-thread bookkeeping of one request in flight."""

    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue
    model: str
    arrival: float
    last_token_time: float | None = None
    num_tokens: int = 0


@dataclass(frozen=True)
class _Drain:
    """Engine-thread bookkeeping of a drain: `done` is set once nothing is running."""

    loop: asyncio.AbstractEventLoop
    done: asyncio.Event


@dataclass
class _Command:
    fn: Callable[[], Any]
    future: concurrent.futures.Future | None = field(default=None)


class EngineError(RuntimeError):
    """The engine failed while serving (a bug, not the user's doing): HTTP 500."""


class ShuttingDownError(RuntimeError):
    """The server is shutting down and admits nothing new: HTTP 503."""


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
        self, build: Callable[[], Engine], metrics: Any, lora_modules: dict[str, str] | None = None
    ) -> None:
        """`build` makes the Engine; it runs on the engine thread, like every later call.

        `lora_modules` (name -> path) are the adapters `build` registers; /v1/models shows them.
        """
        self.metrics = metrics
        self._commands: queue.SimpleQueue[_Command | None] = queue.SimpleQueue()
        self._tracked: dict[str, _Tracked] = {}  # engine thread only
        self._adapter_paths: dict[str, str] = {}  # engine thread writes; readers copy
        self._engine: Engine | None = None  # built on the engine thread
        self._dead: BaseException | None = None
        self._draining = False  # set once, from any thread (a signal handler too)
        self._drain: _Drain | None = None  # engine thread only
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
        self.tokenizer = self._engine.tokenizer  # read only, by the workers and the engine thread
        self.max_prompt_chars = _prompt_char_limit(self.tokenizer, self.max_model_len)
        # encodes run without the GIL, so up to one a core; the engine thread is not one of them
        self._workers = concurrent.futures.ThreadPoolExecutor(
            max_workers=max(1, min(8, os.cpu_count() or 1)), thread_name_prefix="moelora-tokenize"
        )

    # ------------------------------------------------------------------ asyncio side

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self._dead is None

    @property
    def admitting(self) -> bool:
        """Alive and not draining: what /health answers."""
        return self.alive and not self._draining

    def check_alive(self) -> None:
        """An EngineDeadError (HTTP 503) saying why, once the engine cannot serve."""
        if not self.alive:
            raise self._death()

    def check_admitting(self) -> None:
        """check_alive, then a ShuttingDownError (HTTP 503) once a drain has begun."""
        self.check_alive()
        if self._draining:
            raise ShuttingDownError("the server is shutting down: it admits no new requests")

    async def call(self, fn: Callable[[Engine], Any]) -> Any:
        """Run fn(engine) on the engine thread and return its result (or raise its error)."""
        self.check_alive()
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(_Command(lambda: fn(self._engine), future))
        if not self.alive:  # it died after the check: its thread may have drained the queue
            self._fail_pending_commands()
        return await asyncio.wrap_future(future)

    def _death(self) -> EngineDeadError:
        if self._dead is None:
            return EngineDeadError("the engine has shut down")
        return EngineDeadError(str(self._dead))

    async def generate(self, request_id: str, inp: GenerateInput, model: str) -> RequestStream:
        """Tokenize and admit a request; raises InvalidRequestError for a prompt or max_tokens
        that cannot fit max_model_len, and what Engine.add_request raises (before any output)."""
        self.check_admitting()  # before any tokenizing
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()
        tracked = _Tracked(loop, outputs, model, arrival=time.perf_counter())
        prompt_ids = await self._prompt_ids(inp.prompt, inp.tools)
        params = self._fitted_params(inp, len(prompt_ids))
        grammar = await self._grammar(params)
        add = functools.partial(
            self._add, request_id, prompt_ids, params, inp.lora, tracked, grammar
        )
        try:
            await self.call(add)
        except asyncio.CancelledError:  # the client left while the request was being admitted
            self.abort(request_id)
            raise
        return RequestStream(self, request_id, outputs, prompt_ids)

    async def _grammar(self, params: SamplingParams) -> Any:
        """The request's grammar compiled by a worker (from the cache when its spec was seen
        before), so the engine thread never compiles; None for an unconstrained request, or a
        model without a tokenizer, which the engine refuses itself."""
        spec, grammars = params.structured_outputs, self._engine.grammars
        if spec is None or grammars is None:
            return None
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._workers, grammars.compile, spec)

    async def _prompt_ids(self, prompt: Prompt, tools: list[dict[str, Any]] | None) -> list[int]:
        """Token ids as given, or the text's or the chat's, encoded by a worker."""
        if isinstance(prompt, str):
            needed_for, encode = "text prompts", self._encode_text
        elif prompt and isinstance(prompt[0], dict):
            needed_for = "chat messages"
            encode = functools.partial(self._encode_chat, tools=tools)
        else:
            return list(prompt)
        if self.tokenizer is None:  # the engine's own refusal, which names what to send instead
            await self.call(lambda engine: engine.text_tokenizer(needed_for))
        self._check_prompt_chars(prompt)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._workers, encode, prompt)

    def _encode_text(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def _encode_chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> list[int]:
        return self.tokenizer.apply_chat_template(messages, tools)

    def _check_prompt_chars(self, prompt: str | list[dict[str, Any]]) -> None:
        """A chat counts its messages' contents, which a template wraps in more text. A template
        that drops text (Qwen3's drops earlier turns' reasoning) could make this refuse a chat
        whose rendered prompt fits: counting that instead needs the rendering on its own."""
        limit = self.max_prompt_chars
        if limit is None:
            return
        if isinstance(prompt, str):
            field, chars = "prompt", len(prompt)
        else:
            contents = (m.get("content") for m in prompt)
            field, chars = "messages", sum(len(c) for c in contents if isinstance(c, str))
        if chars > limit:
            raise FieldError(
                field,
                f"{field}: {chars} characters, expected at most {limit}, the most that "
                f"max_model_len={self.max_model_len} tokens of this model's tokenizer can hold",
            )

    def _fitted_params(self, inp: GenerateInput, num_prompt_tokens: int) -> SamplingParams:
        """max_tokens as asked, refused (as vLLM does) when it does not fit what the prompt
        leaves of max_model_len; none asked: whatever the prompt leaves. A prompt that is too
        long itself, or an unknown model, is left to the engine's own refusal."""
        room = self.max_model_len - num_prompt_tokens
        if inp.default_max_tokens:
            return dataclasses.replace(inp.params, max_tokens=max(1, room))
        asked = inp.params.max_tokens
        known = inp.lora is None or inp.lora in self._adapter_paths
        if 0 <= room < asked and known:
            chat = bool(inp.prompt) and isinstance(inp.prompt[0], dict)
            where, param = "messages" if chat else "prompt", inp.max_tokens_param
            raise FieldError(
                param,
                f"{param}: this model's maximum context length is {self.max_model_len} tokens, "
                f"but {num_prompt_tokens + asked} were requested: {num_prompt_tokens} in the "
                f"{where} and {asked} in the completion: expected {param} <= {room}, or a "
                f"shorter {where}",
            )
        return inp.params

    def abort(self, request_id: str) -> None:
        self._commands.put(_Command(lambda: self._abort(request_id)))

    async def load_lora(self, name: str, path: str, *, replace: bool = False) -> None:
        self.check_admitting()
        await self.call(lambda engine: self._load(engine, name, path, replace))

    async def unload_lora(self, name: str) -> None:
        self.check_admitting()
        await self.call(lambda engine: self._unload(engine, name))

    def adapter_paths(self) -> dict[str, str]:
        return dict(self._adapter_paths)

    async def stats(self) -> EngineStats:
        return await self.call(lambda engine: engine.stats())

    def stop_admitting(self) -> None:
        """The first step of a drain, safe in a signal handler: it only sets a flag."""
        self._draining = True

    async def drain(self, timeout: float) -> None:
        """Stop admitting, let the running requests finish for up to `timeout` seconds, then
        abort the rest; returns once every request has its last output on its stream."""
        self.stop_admitting()
        drain = _Drain(asyncio.get_running_loop(), asyncio.Event())
        try:
            running = await self.call(lambda _: self._begin_drain(drain))
            log.info("shutting down: %d requests running, up to %g s to finish", running, timeout)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(drain.done.wait(), timeout)
            aborted = await self.call(lambda _: self._abort_running())
        except EngineDeadError:  # its death has failed every request: nothing left to drain
            return
        log.info("shut down: %d requests finished, %d aborted", running - aborted, aborted)

    def shutdown(self, timeout: float = 10.0) -> None:
        self._workers.shutdown(wait=False, cancel_futures=True)
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
                self._note_drained()
        except BaseException as e:  # a dead rank, or a bug in the loop itself
            self._die(e)
        finally:
            self._engine.close()  # a tensor-parallel engine's workers stop with it

    def _die(self, error: BaseException) -> None:
        """Record once why the engine cannot go on (an EngineDeadError from a tensor-parallel
        engine names the rank, its pid and exit code), then fail everything waiting on it."""
        if isinstance(error, EngineDeadError):
            log.error("the engine is dead, every request now answers 503: %s", error)
            dead = error
        else:
            log.error("the engine thread stopped, every request now answers 503", exc_info=error)
            dead = EngineDeadError(f"the engine thread has stopped: {error!r}")
        self._dead = dead  # first: a call from now on fails itself, or drains what it queued
        self._fail_tracked(dead)
        self._fail_pending_commands()
        self._note_drained()

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
            self._run_command(command)

    @staticmethod
    def _run_command(command: _Command) -> None:
        """Run one command and answer its caller; an EngineDeadError also stops the loop."""
        # a caller that has gone (its asyncio side cancelled) is not answered; the command
        # still runs, as an admission the caller aborts must be there to abort
        answer = command.future is not None and command.future.set_running_or_notify_cancel()
        try:
            result = command.fn()
        except Exception as e:
            if answer:
                command.future.set_exception(e)
            elif command.future is None and not isinstance(e, EngineDeadError):
                log.exception("engine command failed")
            if isinstance(e, EngineDeadError):
                raise
        else:
            if answer:
                command.future.set_result(result)

    def _add(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        lora: str | None,
        tracked: _Tracked,
        grammar: Any,
        engine: Engine,
    ) -> None:
        if self._draining:  # the drain waits for exactly the requests admitted before it
            raise ShuttingDownError("the server is shutting down: it admits no new requests")
        engine.add_request(request_id, prompt_ids, params, lora=lora, grammar=grammar)
        self._tracked[request_id] = tracked
        self.metrics.prompt_tokens.inc(len(prompt_ids), model=tracked.model)

    def _abort(self, request_id: str) -> None:
        tracked = self._tracked.pop(request_id, None)
        self._engine.abort_request(request_id)
        if tracked is not None:
            self.metrics.requests.inc(model=tracked.model, status="abort")

    def _begin_drain(self, drain: _Drain) -> int:
        """The requests running when the drain began are the ones it waits for: how many."""
        self._drain = drain
        return len(self._tracked)

    def _note_drained(self) -> None:
        if self._drain is not None and not self._tracked:
            self._call_soon(self._drain.loop, self._drain.done.set)
            self._drain = None

    def _abort_running(self) -> int:
        """The drain's end: each request still running ends with its last output; how many
        of them were aborted (one may have finished in the step its abort waited for)."""
        now, aborted = time.perf_counter(), 0
        for request_id in list(self._tracked):
            out = self._engine.abort_request(request_id)
            assert out is not None and out.finished, request_id  # it holds what it tracks
            aborted += out.finish_reason == "abort"
            self._emit(out, now)
        self._note_drained()
        return aborted

    def _load(self, engine: Engine, name: str, path: str, replace: bool) -> None:
        engine.load_lora(name, path, replace=replace)
        self._adapter_paths = {**self._adapter_paths, name: path}

    def _unload(self, engine: Engine, name: str) -> None:
        engine.unload_lora(name)
        self._adapter_paths = {n: p for n, p in self._adapter_paths.items() if n != name}

    def _step(self) -> None:
        try:
            outputs = self._engine.step()
        except EngineDeadError:
            raise
        except Exception as e:  # an engine bug: fail the requests in flight, keep serving
            log.exception("engine step failed; aborting %d requests", len(self._tracked))
            failed = self._fail_tracked(EngineError(f"the engine failed: {e!r}"))
            for request_id in failed:
                try:
                    self._engine.abort_request(request_id)
                except Exception:
                    log.exception("abort of %s failed", request_id)
            return
        now = time.perf_counter()
        for out in outputs:
            self._emit(out, now)

    def _emit(self, out: RequestOutput, now: float) -> None:
        """Hand `out` to its request's stream; a finished request is no longer tracked."""
        tracked = self._tracked.get(out.request_id)
        if tracked is None:  # aborted while the step ran
            return
        self._record_tokens(tracked, len(out.token_ids), now)
        if out.finished:
            del self._tracked[out.request_id]
            status = "error" if out.error else out.finish_reason
            self.metrics.requests.inc(model=tracked.model, status=status)
        # the engine aborted it (its adapter's folder could not be read): its stream raises
        self._deliver(tracked, EngineError(out.error) if out.error else out)

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

    @classmethod
    def _deliver(cls, tracked: _Tracked, item: Any) -> None:
        cls._call_soon(tracked.loop, tracked.outputs.put_nowait, item)

    @staticmethod
    def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> None:
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop has closed: the server is shutting down
            pass

    def _fail_tracked(self, failure: Exception) -> list[str]:
        """`failure` ends every request in flight (its stream raises it); their ids."""
        failed = list(self._tracked)
        for tracked in self._tracked.values():
            self._deliver(tracked, failure)
            self.metrics.requests.inc(model=tracked.model, status="error")
        self._tracked.clear()
        return failed

    def _fail_pending_commands(self) -> None:
        """Answer every queued command with the engine's death (from either thread)."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command is not None and command.future is not None:
                if command.future.set_running_or_notify_cancel():
                    command.future.set_exception(self._death())


def _prompt_char_limit(tokenizer: Tokenizer | None, max_model_len: int) -> int | None:
    """ingress.prompt_char_limit for the engine's tokenizer; None without one, or without a
    Hugging Face `tokenizers` backend to derive it from."""
    spec = tokenizer.backend_spec() if tokenizer is not None else None
    if spec is None:
        return None
    return prompt_char_limit(*spec, max_model_len)
