"""What a request must be before it costs anything, over real HTTP on the shared demo server: a
huge prompt stalls no other stream (it is refused by its length in characters, and any prompt
is tokenized off the engine thread), the body is limited (413) and typed (none is JSON, as vLLM
reads it; another type is 415), and max_tokens must fit what the prompt leaves of max_model_len
(400, as vLLM answers). Also the bound on characters and the server flags, in process."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import unicodedata
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from moelora import cli

from .conftest import BASE, MAX_MODEL_LEN, Server

HUGE_PROMPT = "a" * 5_242_880  # the issue's: 5 MiB, under the 8 MiB body limit
LIMIT = 8 * 2**20  # the default --max-request-bytes
MAX_GAP = 0.5  # seconds a stream may go without a chunk while the huge prompt is refused


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    return error


def _stream_until(server: Server, stop: threading.Event, started: threading.Event) -> list[float]:
    """Streams one completion after another until `stop`; the arrival time of each chunk."""
    body = {"model": "sql", "prompt": "SELECT", "max_tokens": 50, "temperature": 0}
    body |= {"ignore_eos": True, "stream": True}
    times: list[float] = []
    with httpx.Client(timeout=60) as client:
        while not stop.is_set():
            url = f"{server.url}/v1/completions"
            with client.stream("POST", url, json=body, headers=server.headers) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if stop.is_set():
                        break  # closing the stream aborts its request
                    if line.startswith("data:"):
                        times.append(time.perf_counter())
                        started.set()
    return times


HUGE_BODIES = {
    "prompt": ("/v1/completions", {"prompt": HUGE_PROMPT}),
    "messages": ("/v1/chat/completions", {"messages": [{"role": "user", "content": HUGE_PROMPT}]}),
}


@pytest.mark.parametrize("field", sorted(HUGE_BODIES))
def test_a_huge_prompt_stalls_no_other_stream(server: Server, field: str) -> None:
    path, body = HUGE_BODIES[field]
    # encoded before the clock starts: this process's own json.dumps would hold the streamer
    payload = json.dumps({"model": "sql", "max_tokens": 4, **body}).encode()
    headers = {**server.headers, "Content-Type": "application/json"}
    stop, started, times = threading.Event(), threading.Event(), []
    streamer = threading.Thread(
        target=lambda: times.extend(_stream_until(server, stop, started)), daemon=True
    )
    streamer.start()
    try:
        assert started.wait(60), "the stream never started"
        sent = time.perf_counter()
        r = httpx.post(f"{server.url}{path}", content=payload, headers=headers, timeout=120)
        answered = time.perf_counter()
        time.sleep(2 * MAX_GAP)  # the stream goes on after the answer: its gaps are measured
    finally:
        stop.set()
        streamer.join(60)
    assert [t for t in times if t > answered], "the stream ended before the answer"
    gaps = [b - a for a, b in zip(times, times[1:]) if b > sent]
    assert max(gaps) < MAX_GAP, f"a stream waited {max(gaps):.2f} s for the huge prompt"
    error = _error(r, 400)
    assert f"max_model_len={MAX_MODEL_LEN}" in error["message"], error
    assert "5242880 characters" in error["message"] and error["param"] == field, error


def _chunks(total: int, size: int = 2**20) -> Iterator[bytes]:
    """A JSON body of `total` bytes sent chunked: httpx sends no Content-Length for it."""
    head, tail = b'{"model": "sql", "max_tokens": 4, "prompt": "', b'"}'
    body = head + b"a" * (total - len(head) - len(tail)) + tail
    for i in range(0, len(body), size):
        yield body[i : i + size]


@pytest.mark.parametrize("how", ["content-length", "chunked"])
def test_a_body_over_the_limit_is_413(server: Server, how: str) -> None:
    url = f"{server.url}/v1/completions"
    total = LIMIT + 1
    if how == "content-length":
        content: bytes | Iterator[bytes] = b"".join(_chunks(total))
    else:
        content = _chunks(total)
    headers = {**server.headers, "Content-Type": "application/json"}
    r = httpx.post(url, content=content, headers=headers, timeout=60)
    error = _error(r, 413)
    assert str(LIMIT) in error["message"] and "--max-request-bytes" in error["message"]
    if how == "content-length":
        assert str(total) in error["message"]  # refused from the header, before the body
    ok = httpx.post(url, json=BODIES["/v1/completions"], headers=server.headers, timeout=60)
    assert ok.status_code == 200, ok.text


BODIES = {
    "/v1/completions": {"model": "sql", "prompt": "SELECT", "max_tokens": 3, "temperature": 0},
    "/v1/chat/completions": {
        "model": "chat",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
    },
}


@pytest.mark.parametrize("content_type", [None, "", "application/x-www-form-urlencoded"])
@pytest.mark.parametrize("path", sorted(BODIES))
def test_a_body_without_content_type_is_read_as_json(
    server: Server, path: str, content_type: str | None
) -> None:
    """What `requests.post(url, data=json.dumps(body))` sends (httpx sends no Content-Type for
    raw `content` either), `curl -H 'Content-Type: '`, and `curl -d` without -H (a form type):
    all read as JSON."""
    headers = dict(server.headers)
    if content_type is not None:
        headers["Content-Type"] = content_type
    url = f"{server.url}{path}"
    request = httpx.Request("POST", url, content=json.dumps(BODIES[path]), headers=headers)
    assert request.headers.get("content-type") == content_type
    with httpx.Client(timeout=60) as client:
        r = client.send(request)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize(
    "content_type", ["text/plain", "multipart/form-data; boundary=x", "application/xml"]
)
def test_a_content_type_that_is_not_json_is_415(server: Server, content_type: str) -> None:
    headers = {**server.headers, "Content-Type": content_type}
    for path, body in BODIES.items():
        r = httpx.post(f"{server.url}{path}", content=json.dumps(body), headers=headers)
        error = _error(r, 415)
        assert "Content-Type" in error["message"] and content_type in error["message"]
        assert "application/json" in error["message"]
    for json_type in ("application/json; charset=utf-8", "Application/JSON"):
        headers = {**server.headers, "Content-Type": json_type}
        path = "/v1/completions"
        r = httpx.post(f"{server.url}{path}", content=json.dumps(BODIES[path]), headers=headers)
        assert r.status_code == 200, r.text


def _prompt_tokens(server: Server, path: str, body: dict) -> int:
    r = httpx.post(f"{server.url}{path}", json={**body, "max_tokens": 1}, headers=server.headers)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens"]


@pytest.mark.parametrize(
    ("path", "field"),
    [
        ("/v1/completions", "max_tokens"),
        ("/v1/chat/completions", "max_tokens"),
        ("/v1/chat/completions", "max_completion_tokens"),
    ],
)
def test_max_tokens_past_the_context_is_400(server: Server, path: str, field: str) -> None:
    body = {k: v for k, v in BODIES[path].items() if k != "max_tokens"}
    body |= {"model": BASE, "ignore_eos": True}
    prompt = _prompt_tokens(server, path, body)
    room = MAX_MODEL_LEN - prompt
    url = f"{server.url}{path}"
    r = httpx.post(url, json={**body, field: room + 1}, headers=server.headers, timeout=60)
    error = _error(r, 400)
    for fact in (MAX_MODEL_LEN, MAX_MODEL_LEN + 1, prompt, room + 1, room):
        assert str(fact) in error["message"], (fact, error)
    assert error["param"] == field, error
    fits = httpx.post(url, json={**body, field: room}, headers=server.headers, timeout=60)
    assert fits.status_code == 200, fits.text
    assert fits.json()["usage"]["completion_tokens"] == room  # all of it: nothing clamped
    default = httpx.post(url, json={**body, field: None}, headers=server.headers, timeout=60)
    assert default.status_code == 200, default.text  # none asked: what the prompt leaves
    assert default.json()["usage"]["completion_tokens"] == room


class _ThreadSpy:
    """The engine's tokenizer, noting the thread of every encode."""

    def __init__(self, tokenizer, threads: list[str]) -> None:
        self._inner, self._threads = tokenizer, threads

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    def encode(self, text: str) -> list[int]:
        self._threads.append(threading.current_thread().name)
        return self._inner.encode(text)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None):
        self._threads.append(threading.current_thread().name)
        return self._inner.apply_chat_template(messages, tools)


def test_prompts_are_tokenized_off_the_engine_thread(server: Server) -> None:
    from moelora.config import EngineConfig
    from moelora.engine.engine import Engine
    from moelora.sampling_params import SamplingParams
    from moelora.server.async_engine import AsyncEngine, GenerateInput
    from moelora.server.metrics import ServerMetrics

    threads: list[str] = []

    def build() -> Engine:
        engine = Engine(EngineConfig(model=str(server.cache / "demo" / "model"), device="cpu"))
        engine.tokenizer = _ThreadSpy(engine.tokenizer, threads)
        return engine

    async def generate_both() -> None:
        engine = AsyncEngine(build, ServerMetrics())
        try:
            for i, prompt in enumerate(["SELECT", [{"role": "user", "content": "hi"}]]):
                inp = GenerateInput(prompt, SamplingParams(max_tokens=2), None)
                async for _ in await engine.generate(f"r{i}", inp, BASE):
                    pass
        finally:
            engine.shutdown()

    asyncio.run(generate_both())
    assert len(threads) == 2 and "moelora-engine" not in threads, threads


# ------------------------------------------------------------------- in process: bound, flags


def _backend(normalizer=None, pre_tokenizer=None, model=None, added=()) -> str:
    pre = pre_tokenizer or {"type": "ByteLevel"}
    model = model or {"type": "BPE", "byte_fallback": False}
    spec = {"normalizer": normalizer, "pre_tokenizer": pre, "model": model}
    return json.dumps({**spec, "added_tokens": list(added)})


def test_the_character_bound_is_the_longest_token_times_max_model_len(server: Server) -> None:
    from moelora.server.async_engine import _prompt_char_limit
    from moelora.server.ingress import MAX_COMPOSED, prompt_char_limit
    from moelora.tokenizer import Tokenizer

    vocab = ["a", "<|endoftext|>", "Ġchoosing"]
    assert prompt_char_limit(_backend(), vocab, 10) == 130
    nfc = {"type": "Sequence", "normalizers": [{"type": "NFC"}]}
    assert prompt_char_limit(_backend(normalizer=nfc), vocab, 10) == 130 * MAX_COMPOSED
    sentencepiece = {
        "normalizer": {
            "type": "Sequence",
            "normalizers": [
                {"type": "Prepend", "prepend": "▁"},
                {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
            ],
        },
        "pre_tokenizer": None,
        "model": {"type": "BPE", "byte_fallback": True},
    }
    assert prompt_char_limit(json.dumps(sentencepiece), ["<0xE6>", "▁the"], 4) == 24
    longest = max(range(0x110000), key=lambda c: len(unicodedata.normalize("NFD", chr(c))))
    assert len(unicodedata.normalize("NFD", chr(longest))) == MAX_COMPOSED
    # The demo's tokenizer, as the server derives it: 13 characters (<|endoftext|>) a token.
    demo_tokenizer = Tokenizer(str(server.cache / "demo" / "model"), [])
    assert _prompt_char_limit(demo_tokenizer, MAX_MODEL_LEN) == 13 * MAX_MODEL_LEN


@pytest.mark.parametrize(
    "backend",
    [
        _backend(normalizer={"type": "BertNormalizer"}),  # drops control characters
        _backend(normalizer={"type": "Strip"}),
        _backend(pre_tokenizer={"type": "Whitespace"}),  # drops spaces
        _backend(pre_tokenizer={"type": "Split", "behavior": "Removed"}),
        _backend(model={"type": "WordPiece"}),  # a long word is one [UNK]
        _backend(model={"type": "BPE", "byte_fallback": False}, pre_tokenizer={"type": "Digits"}),
        _backend(added=[{"content": "<mask>", "lstrip": True}]),  # eats the spaces before it
    ],
)
def test_no_character_bound_where_a_token_can_hide_characters(backend: str) -> None:
    from moelora.server.ingress import prompt_char_limit

    assert prompt_char_limit(backend, ["abc"], 10) is None


def test_server_flags_reach_the_server_options(tmp_path: Path) -> None:
    (tmp_path / "adapters").mkdir()
    (tmp_path / "more").mkdir()
    flags = [
        "--max-request-bytes",
        "1024",
        "--lora-root",
        str(tmp_path / "adapters" / ".." / "more"),
    ]
    args = cli._parser().parse_args(
        ["serve", "demo", *flags, "--lora-root", str(tmp_path / "adapters")]
    )
    options = cli._server_options(args, args.log_level)
    assert options.max_request_bytes == 1024
    assert options.lora_roots == ((tmp_path / "more").resolve(), (tmp_path / "adapters").resolve())
    defaults = cli._server_options(cli._parser().parse_args(["serve", "demo"]), "info")
    assert defaults.max_request_bytes == LIMIT and defaults.lora_roots == ()


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (
            ["--lora-root", "/nonexistent/adapters"],
            "--lora-root '/nonexistent/adapters' is invalid",
        ),
        (["--max-request-bytes", "0"], "--max-request-bytes 0 is invalid"),
    ],
)
def test_a_bad_server_flag_exits_with_one_line(flags: list[str], expected: str) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["serve", "demo", *flags])
    assert str(exit_.value.code).startswith(f"moelora: {expected}: expected")
