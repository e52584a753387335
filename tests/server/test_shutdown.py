"""SIGTERM (or SIGINT) drains the server: nothing new is admitted (503, /health too), running
requests get up to --shutdown-timeout seconds to finish, the rest end with finish_reason "abort",
and the process exits with 0, its tensor-parallel ranks joined."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import os
import re
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

from moelora import cli, demo
from moelora.server.api import build_app
from moelora.server.async_engine import AsyncEngine
from moelora.server.metrics import ServerMetrics
from moelora.server.serve import DrainingServer
from moelora.step.request import RequestOutput

from .conftest import Server, _free_port, _worker_pids, serve

API_KEY = "drain-key"
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
TIMEOUT = 60.0  # for one HTTP call
# far more tokens than a few seconds of CPU steps make: these run until the drain aborts them
ENDLESS = {"max_tokens": 2000, "ignore_eos": True}
EXIT_MARGIN = 15.0  # seconds past the drain's timeout for uvicorn and the engine to stop


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("drain-cache")
    demo.ensure_demo(root / "demo")
    return root


@contextlib.contextmanager
def _demo_server(cache: Path, log: Path, *flags: str) -> Iterator[Server]:
    port = _free_port()
    cmd = [sys.executable, "-m", "moelora.cli", "serve", "demo", "--device", "cpu"]
    cmd += ["--port", str(port), "--api-key", API_KEY, "--log-level", "info", *flags]
    env = {**os.environ, "MOELORA_CACHE": str(cache)}
    with serve(cmd, port, log, cache, {}, env=env) as srv:
        yield srv


def _events(
    url: str, body: dict, started: threading.Event | None = None, *, after: int = 1
) -> list[str]:
    """The `data:` payloads of a streamed answer; `started` is set once `after` have come."""
    with httpx.stream("POST", url, json=body, headers=HEADERS, timeout=TIMEOUT) as response:
        assert response.status_code == 200, response.read()
        events = []
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))
                if started is not None and len(events) >= after:
                    started.set()
    return events


def _finish_reason(events: list[str]) -> str:
    """The stream's last chunk's, checked to come right before `[DONE]`."""
    assert events[-1] == "[DONE]", events[-3:]
    return json.loads(events[-2])["choices"][0]["finish_reason"]


def _wait_running(srv: Server, count: int) -> None:
    deadline = time.monotonic() + TIMEOUT
    while srv.metrics()["moelora_num_requests_running"] < count:
        assert time.monotonic() < deadline, f"fewer than {count} requests running"
        time.sleep(0.05)


def _wait_unhealthy(url: str) -> None:
    deadline = time.monotonic() + 10
    while httpx.get(f"{url}/health", timeout=TIMEOUT).status_code != 503:
        assert time.monotonic() < deadline, "/health still answers 200 after SIGTERM"
        time.sleep(0.02)


def test_sigterm_refuses_new_requests_lets_running_ones_finish_then_aborts_the_rest(
    cache: Path, tmp_path: Path
) -> None:
    # the short stream's last 4 tokens fit it even on a loaded 2-core box, and the endless ones'
    # 2000 do not, even where the demo decodes 250 tokens a second (10 s let them finish)
    drain_timeout = 4
    log = tmp_path / "server.log"
    with (
        _demo_server(cache, log, "--shutdown-timeout", str(drain_timeout)) as srv,
        concurrent.futures.ThreadPoolExecutor(4) as pool,
    ):
        completions, chat = f"{srv.url}/v1/completions", f"{srv.url}/v1/chat/completions"
        prompt = {"model": "demo", "prompt": "Hello"}
        messages = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}
        stream = pool.submit(_events, completions, {**prompt, **ENDLESS, "stream": True})
        chat_stream = pool.submit(_events, chat, {**messages, **ENDLESS, "stream": True})
        whole = pool.submit(
            httpx.post, completions, json={**prompt, **ENDLESS}, headers=HEADERS, timeout=TIMEOUT
        )
        _wait_running(srv, 3)
        # SIGTERM once the short one is a few tokens from its end (a chunk a token, but for
        # tokens that end inside a character): it finishes well within the drain's timeout
        started = threading.Event()
        short_body = {**prompt, "max_tokens": 10, "ignore_eos": True, "stream": True}
        short = pool.submit(_events, completions, short_body, started, after=6)
        assert started.wait(TIMEOUT)

        srv.process.send_signal(signal.SIGTERM)
        _wait_unhealthy(srv.url)
        refused = [
            httpx.post(completions, json={**prompt, "max_tokens": 2}, headers=HEADERS),
            httpx.post(chat, json={**messages, "max_tokens": 2, "stream": True}, headers=HEADERS),
            httpx.post(
                f"{srv.url}/v1/load_lora_adapter",
                json={"lora_name": "late", "lora_path": str(cache / "demo" / "adapters" / "sql")},
                headers=HEADERS,
            ),
            httpx.post(
                f"{srv.url}/v1/unload_lora_adapter", json={"lora_name": "sql"}, headers=HEADERS
            ),
        ]
        for response in refused:
            assert response.status_code == 503, response.text
            error = response.json()["error"]
            assert error["type"] == "ServiceUnavailableError"
            assert "shutting down" in error["message"]

        assert srv.process.wait(drain_timeout + EXIT_MARGIN) == 0
        assert _finish_reason(short.result(TIMEOUT)) == "length"
        assert _finish_reason(stream.result(TIMEOUT)) == "abort"
        assert _finish_reason(chat_stream.result(TIMEOUT)) == "abort"
        answer = whole.result(TIMEOUT)
        assert answer.status_code == 200, answer.text
        choice = answer.json()["choices"][0]
        assert choice["finish_reason"] == "abort" and choice["text"]
    text = log.read_text()
    running = rf"shutting down: [34] requests running, up to {drain_timeout} s to finish"
    assert re.search(running, text), text
    assert re.search(r"shut down: [01] requests finished, 3 aborted", text), text


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds ranks through /proc")
def test_a_drain_whose_requests_finish_in_time_exits_at_once_with_its_ranks_joined(
    cache: Path, tmp_path: Path
) -> None:
    """A drain timeout ten times the test's bound on the exit: the server must not wait it
    out once its one request has finished."""
    log = tmp_path / "server.log"
    flags = ("--shutdown-timeout", "600", "--tensor-parallel-size", "2")
    with (
        _demo_server(cache, log, *flags) as srv,
        concurrent.futures.ThreadPoolExecutor(1) as pool,
    ):
        (worker,) = _worker_pids(srv.process.pid)
        started = threading.Event()
        body = {"model": "sql", "prompt": "SELECT", "max_tokens": 20, "stream": True}
        body["ignore_eos"] = True
        stream = pool.submit(_events, f"{srv.url}/v1/completions", body, started)
        assert started.wait(TIMEOUT)
        srv.process.send_signal(signal.SIGTERM)
        assert srv.process.wait(TIMEOUT) == 0
        assert _finish_reason(stream.result(TIMEOUT)) == "length"
    assert not Path(f"/proc/{worker}").exists()  # joined: exited and reaped by the server
    assert re.search(r"shut down: [01] requests finished, 0 aborted", log.read_text())


def test_a_negative_shutdown_timeout_is_refused_naming_the_flag() -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["serve", "demo", "--shutdown-timeout", "-1"])
    message = str(exit_.value.code)
    assert message.startswith("moelora: --shutdown-timeout -1 is invalid: expected"), message
    args = cli._parser().parse_args(["serve", "demo", "--shutdown-timeout", "2.5"])
    assert cli._server_options(args, "info").shutdown_timeout == 2.5


# --------------------------------------------------------------- in process, a fake engine


class _EndlessEngine:
    """One token a step for each request; none finishes by itself."""

    model_name, max_model_len, tokenizer, grammars = "m", 1 << 20, None, None

    def __init__(self) -> None:
        self.running: dict[str, RequestOutput] = {}

    def list_loras(self) -> list[str]:
        return []

    def add_request(self, request_id, prompt_ids, params, *, lora, grammar) -> None:
        self.running[request_id] = RequestOutput(request_id, prompt_ids, [], "", None, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running)

    def step(self) -> list[RequestOutput]:
        time.sleep(0.01)
        for request_id, out in self.running.items():
            self.running[request_id] = dataclasses.replace(
                out, token_ids=[*out.token_ids, 7], text=out.text + "x"
            )
        return list(self.running.values())

    def abort_request(self, request_id: str) -> RequestOutput | None:
        out = self.running.pop(request_id, None)
        return None if out is None else dataclasses.replace(out, finish_reason="abort")

    def close(self) -> None:
        pass


@contextlib.contextmanager
def _draining_server(
    fake: _EndlessEngine, shutdown_timeout: float
) -> Iterator[tuple[DrainingServer, str, threading.Thread]]:
    """The app around an AsyncEngine over `fake`, served by a DrainingServer on a side thread,
    where no signal reaches it: a test calls handle_exit as the signal would."""
    engine = AsyncEngine(lambda: fake, metrics=ServerMetrics())
    port = _free_port()
    config = uvicorn.Config(build_app(engine), port=port, log_level="warning", lifespan="off")
    server = DrainingServer(config, engine, shutdown_timeout)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        yield server, f"http://127.0.0.1:{port}/v1/completions", thread
    finally:
        server.should_exit = True
        thread.join(10)
        engine.shutdown(timeout=5)


def _wait_admitted(fake: _EndlessEngine, count: int) -> None:
    """`count` requests running, each with text written."""
    deadline = time.monotonic() + TIMEOUT
    while len(fake.running) < count or not all(o.text for o in fake.running.values()):
        assert time.monotonic() < deadline, f"fewer than {count} requests running"
        time.sleep(0.01)


ENDLESS_FAKE: dict[str, Any] = {"model": "m", "prompt": [1, 2], "max_tokens": 10_000}


def test_a_zero_shutdown_timeout_aborts_at_once() -> None:
    fake = _EndlessEngine()
    with (
        _draining_server(fake, shutdown_timeout=0) as (server, url, thread),
        concurrent.futures.ThreadPoolExecutor(2) as pool,
    ):
        stream = pool.submit(_events, url, {**ENDLESS_FAKE, "stream": True})
        whole = pool.submit(httpx.post, url, json=ENDLESS_FAKE, timeout=TIMEOUT)
        _wait_admitted(fake, 2)
        server.handle_exit(signal.SIGTERM, None)
        thread.join(TIMEOUT)
        assert not thread.is_alive()
        assert _finish_reason(stream.result(TIMEOUT)) == "abort"
        choice = whole.result(TIMEOUT).json()["choices"][0]
        assert choice["finish_reason"] == "abort" and choice["text"].startswith("x")
        assert not server.engine.admitting


def test_a_second_signal_stops_at_once() -> None:
    fake = _EndlessEngine()
    with (
        _draining_server(fake, shutdown_timeout=600) as (server, url, thread),
        concurrent.futures.ThreadPoolExecutor(1) as pool,
    ):
        stream = pool.submit(_events, url, {**ENDLESS_FAKE, "stream": True})
        _wait_admitted(fake, 1)
        server.handle_exit(signal.SIGTERM, None)
        while server.draining is None:  # the drain has begun
            time.sleep(0.01)
        server.handle_exit(signal.SIGINT, None)
        thread.join(TIMEOUT)  # far less than the drain's 600 s
        assert not thread.is_alive()
        with pytest.raises(httpx.RemoteProtocolError):  # cut off, without its answer's end
            stream.result(TIMEOUT)
