"""One EngineDeadError (moelora.errors) for an engine that cannot go on, a dead rank or a stopped
engine thread: HTTP 503, though it is a MoeloraError, whose others are the user's doing (400)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from moelora import demo
from moelora.errors import EngineDeadError, InvalidRequestError, MoeloraError
from moelora.server.api import build_app
from moelora.server.async_engine import AsyncEngine
from moelora.server.errors import exception_response
from moelora.server.metrics import ServerMetrics
from moelora.step.request import RequestOutput

from .conftest import _free_port, _worker_pids, serve


def test_a_dead_engine_is_503_and_a_users_error_400():
    dead = exception_response(EngineDeadError("rank 1 (pid 7) exited with code -9"))
    assert dead.status_code == 503
    assert json.loads(dead.body)["error"]["type"] == "ServiceUnavailableError"
    assert exception_response(MoeloraError("bad value")).status_code == 400


class _DyingEngine:
    """Builds, then fails in the engine thread's loop: a bug in the loop itself."""

    model_name, max_model_len, tokenizer, grammars = "m", 8, None, None

    def list_loras(self) -> list[str]:
        return []

    def has_unfinished_requests(self) -> bool:
        raise RuntimeError("boom")

    def close(self) -> None:
        pass


def test_a_call_into_a_stopped_engine_thread_raises_engine_dead_error():
    engine = AsyncEngine(_DyingEngine, metrics=None)
    engine._thread.join(timeout=10)
    try:
        with pytest.raises(EngineDeadError, match="the engine thread has stopped"):
            asyncio.run(engine.call(lambda e: e.model_name))
    finally:
        engine.shutdown(timeout=1)


# --------------------------------------------------------------- over real HTTP, a fake engine


class _FakeEngine:
    """One token a step for each request, until the test makes it fail: `dead` (a rank died)
    or `bug` (one step raises). A prompt of [13] fails its own admission; a guided regex fails
    its own grammar compile."""

    model_name, max_model_len, tokenizer = "m", 1 << 20, None

    def __init__(self) -> None:
        self.requests: dict[str, tuple[list[int], Any]] = {}
        self.generated: dict[str, list[int]] = {}
        self.dead: str | None = None
        self.bug = False
        self.grammars = _FailingGrammars()

    def list_loras(self) -> list[str]:
        return []

    def add_request(self, request_id, prompt_ids, params, *, lora, grammar) -> None:
        if prompt_ids == [13]:
            raise InvalidRequestError("prompt: [13] is refused, expected anything else")
        self.requests[request_id] = (prompt_ids, params)
        self.generated[request_id] = []

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def abort_request(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def step(self) -> list[RequestOutput]:
        time.sleep(0.01)
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        if self.bug:
            self.bug = False
            raise RuntimeError("a bug in one step")
        outputs = []
        for request_id, (prompt, params) in list(self.requests.items()):
            tokens = self.generated[request_id]
            tokens.append(7)
            done = len(tokens) >= params.max_tokens
            if done:
                del self.requests[request_id]
            text = "x" * len(tokens)
            reason = "length" if done else None
            outputs.append(RequestOutput(request_id, prompt, list(tokens), text, reason, None))
        return outputs

    def close(self) -> None:
        pass


class _FailingGrammars:
    def compile(self, spec: Any) -> Any:
        raise InvalidRequestError("guided_regex: not a valid regular expression")


@contextlib.contextmanager
def _http_server(fake: _FakeEngine) -> Iterator[str]:
    """The app around an AsyncEngine over `fake`, served by uvicorn on a free port."""
    engine = AsyncEngine(lambda: fake, metrics=ServerMetrics())
    port = _free_port()
    config = uvicorn.Config(build_app(engine), port=port, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        yield url
    finally:
        server.should_exit = True
        thread.join(10)
        engine.shutdown(timeout=5)


def _complete(url: str, **body: Any) -> httpx.Response:
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 2, **body}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=_TIMEOUT)


_TIMEOUT = 10.0


def test_a_dead_rank_fails_what_is_in_flight_and_what_comes_after_with_503():
    fake = _FakeEngine()
    with _http_server(fake) as url:
        assert _complete(url).status_code == 200
        assert httpx.get(f"{url}/health", timeout=_TIMEOUT).status_code == 200
        with (
            concurrent.futures.ThreadPoolExecutor(1) as pool,
            httpx.stream(
                "POST",
                f"{url}/v1/completions",
                json={"model": "m", "prompt": [1], "max_tokens": 10_000, "stream": True},
                timeout=_TIMEOUT,
            ) as stream,
        ):
            whole = pool.submit(_complete, url, max_tokens=10_000)
            events = stream.iter_lines()
            assert next(e for e in events if e.startswith("data: "))  # the stream is running
            while len(fake.requests) < 2:  # the non-streamed one is admitted too
                time.sleep(0.01)
            fake.dead = "tensor-parallel rank 1 (pid 7) exited with code -9"
            rest = [e.removeprefix("data: ") for e in events if e.startswith("data: ")]
            assert whole.result(_TIMEOUT).status_code == 503
        assert rest[-1] == "[DONE]"
        error = json.loads(rest[-2])["error"]
        assert error["type"] == "ServiceUnavailableError"
        assert "rank 1 (pid 7) exited with code -9" in error["message"]
        late = _complete(url)
        assert late.status_code == 503
        assert late.json()["error"]["type"] == "ServiceUnavailableError"
        assert _complete(url, stream=True).status_code == 503
        assert httpx.get(f"{url}/health", timeout=_TIMEOUT).status_code == 503


def test_an_engine_thread_that_raises_makes_the_server_unhealthy():
    with _http_server(_DyingEngine()) as url:
        response = _complete(url)
        assert response.status_code == 503
        assert "the engine thread has stopped" in response.json()["error"]["message"]
        assert httpx.get(f"{url}/health", timeout=_TIMEOUT).status_code == 503


def test_a_requests_own_failure_fails_only_that_request():
    fake = _FakeEngine()
    with _http_server(fake) as url:
        assert _complete(url, prompt=[13]).status_code == 400  # its admission
        assert _complete(url, guided_regex="(").status_code == 400  # its grammar
        fake.bug = True  # one step's bug fails the requests in that step, not the engine
        assert _complete(url).status_code == 500
        assert _complete(url).status_code == 200
        assert httpx.get(f"{url}/health", timeout=_TIMEOUT).status_code == 200


# --------------------------------------------------------------- a killed rank, the real server


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds ranks through /proc")
def test_a_killed_rank_makes_the_real_server_answer_503(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    demo.ensure_demo(cache / "demo")
    port = _free_port()
    cmd = [sys.executable, "-m", "moelora.cli", "serve", "demo", "--tensor-parallel-size", "2"]
    cmd += ["--device", "cpu", "--port", str(port), "--log-level", "warning"]
    env = {**os.environ, "MOELORA_CACHE": str(cache)}
    with serve(cmd, port, tmp_path / "server.log", cache, {}, env=env) as srv:
        body = {"model": "demo", "prompt": "Hello", "max_tokens": 2}
        completions = f"{srv.url}/v1/completions"
        assert httpx.post(completions, json=body, timeout=60).status_code == 200
        (worker,) = _worker_pids(srv.process.pid)
        os.kill(worker, signal.SIGKILL)
        response = httpx.post(completions, json=body, timeout=90)  # the collective timeout
        assert response.status_code == 503, response.text
        assert response.json()["error"]["type"] == "ServiceUnavailableError"
        assert f"rank 1 (pid {worker}) exited with code -9" in response.json()["error"]["message"]
        assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 503
        assert httpx.post(completions, json=body, timeout=10).status_code == 503
    assert srv.log.read_text().count("the engine is dead") == 1
