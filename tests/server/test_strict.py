"""Strict requests over real HTTP: a value of the wrong JSON type is a 400 that names its field
(in `param` and in the message) and quotes what was sent, never a conversion; text that is not
valid UTF-8 is a 400 naming where it sits, never a 500; and the runtime-LoRA gate (build_app in
process, on a stand-in engine that records what it was asked to load)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from moelora.server.api import build_app

from .conftest import BASE, Server

COMPLETION = {"model": "sql", "prompt": "hello", "max_tokens": 2}
CHAT = {"model": BASE, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _post(server: Server, path: str, body: dict | bytes) -> httpx.Response:
    """JSON as Python's json.dumps writes it: non-ASCII (and lone surrogates) as \\u escapes."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {**server.headers, "Content-Type": "application/json"}
    return httpx.post(f"{server.url}{path}", content=content, headers=headers, timeout=60)


def _refused(r: httpx.Response, param: str | None) -> str:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "BadRequestError"
    assert error["param"] == param, error
    if param is not None:
        assert error["message"].startswith(param), error
    return error["message"]


# (field changed, value sent, param expected[, the value inside it that is wrong])
WRONG_COMPLETION_TYPES = [
    ("max_tokens", "16", "max_tokens"),
    ("max_tokens", True, "max_tokens"),
    ("max_tokens", 2.5, "max_tokens"),
    ("temperature", "0.5", "temperature"),
    ("temperature", False, "temperature"),
    ("top_p", "1", "top_p"),
    ("stream", "yes", "stream"),
    ("stream", 1, "stream"),
    ("echo", "true", "echo"),
    ("n", "2", "n"),
    ("logprobs", "1", "logprobs"),
    ("seed", "7", "seed"),
    ("ignore_eos", "false", "ignore_eos"),
    ("user", 5, "user"),
    ("presence_penalty", "0", "presence_penalty"),
    ("stop", 5, "stop"),
    ("stop", ["a", 5], "stop.1", 5),
    ("stop_token_ids", ["1"], "stop_token_ids.0", "1"),
    ("prompt", 5, "prompt"),
    ("prompt", [1, "a"], "prompt.1", "a"),
    ("prompt", [[1, 2], [3, True]], "prompt.1.1", True),
    ("stream_options", {"include_usage": "yes"}, "stream_options.include_usage", "yes"),
    ("logit_bias", {"5": "1"}, "logit_bias.5", "1"),
]


@pytest.mark.parametrize("case", WRONG_COMPLETION_TYPES, ids=lambda c: f"{c[0]}={c[1]!r}")
def test_wrong_types_are_refused_not_converted(server: Server, case: tuple) -> None:
    field, value, param, *wrong = case
    message = _refused(_post(server, "/v1/completions", {**COMPLETION, field: value}), param)
    assert f"got {json.dumps(wrong[0] if wrong else value)}" in message  # as sent, in JSON


WRONG_CHAT_TYPES = [
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": 1, "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    (
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
        "messages.0.content.0.text",
    ),
    ({"logprobs": "true"}, "logprobs"),
    ({"logprobs": True, "top_logprobs": "2"}, "top_logprobs"),
    ({"max_completion_tokens": "4"}, "max_completion_tokens"),
]


@pytest.mark.parametrize(("change", "param"), WRONG_CHAT_TYPES)
def test_wrong_chat_types_name_their_field(server: Server, change: dict, param: str) -> None:
    message = _refused(_post(server, "/v1/chat/completions", {**CHAT, **change}), param)
    assert "got " in message


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/load_lora_adapter", {"lora_name": 5, "lora_path": "/x"}, "lora_name"),
        ("/v1/unload_lora_adapter", {"lora_name": True}, "lora_name"),
    ],
)
def test_adapter_routes_are_strict_too(server: Server, path: str, body: dict, param: str):
    assert f"got {json.dumps(body[param])}" in _refused(_post(server, path, body), param)


def test_integers_are_numbers_but_strings_are_not(server: Server) -> None:
    """An integer where a float is expected is fine, as in OpenAI's API, and so is 4.0 where an
    integer is (JSON has one kind of number); unknown fields are ignored. The strings of the
    same values are refused."""
    numbers = {"temperature": 1, "top_p": 1, "presence_penalty": 0, "max_tokens": 2.0}
    ok = _post(server, "/v1/completions", {**COMPLETION, **numbers, "no_such_field": [1]})
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] <= 2
    for field, value in numbers.items():
        body = {**COMPLETION, field: str(value)}
        _refused(_post(server, "/v1/completions", body), field)


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_chat_zero_max_tokens_is_400(server: Server, field: str) -> None:
    body = {**CHAT, field: 0}
    assert "greater than or equal to 1" in _refused(
        _post(server, "/v1/chat/completions", body), field
    )


def test_text_part_without_text_says_text_is_missing(server: Server) -> None:
    body = {**CHAT, "messages": [{"role": "user", "content": [{"type": "text"}]}]}
    message = _refused(_post(server, "/v1/chat/completions", body), "messages.0.content.0.text")
    assert "missing" in message and "not supported" not in message


# ----------------------------------------------------------------------------- UTF-8


LONE_SURROGATES = [
    ("/v1/completions", {**COMPLETION, "prompt": "SEL\ud800ECT"}, "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": ["fine", "SEL\udc00ECT"]}, "prompt.1"),
    ("/v1/completions", {**COMPLETION, "stop": ["ok", "\ud800"]}, "stop.1"),
    ("/v1/completions", {**COMPLETION, "stop": "x\udbff"}, "stop"),
    (
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": "hi \ud800"}]},
        "messages.0.content",
    ),
    (
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
        "messages.0.content.0.text",
    ),
    (
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": "hi", "name": "\ud800"}]},
        "messages.0.name",
    ),
]


@pytest.mark.parametrize(("path", "body", "param"), LONE_SURROGATES)
def test_a_lone_surrogate_is_400_naming_the_field(
    server: Server, path: str, body: dict, param: str
) -> None:
    assert "\\ud" in json.dumps(body)  # sent as a JSON escape
    assert "surrogate" in _refused(_post(server, path, body), param)


def test_encoded_surrogate_bytes_are_400_naming_the_field(server: Server) -> None:
    """The bytes ED A0 80 (CESU-8's U+D800) inside a string."""
    body = b'{"model": "sql", "max_tokens": 2, "prompt": "SEL\xed\xa0\x80ECT"}'
    assert "surrogate" in _refused(_post(server, "/v1/completions", body), "prompt")
    chat = b'{"model": "demo", "messages": [{"role": "user", "content": "\xed\xa0\x80"}]}'
    _refused(_post(server, "/v1/chat/completions", chat), "messages.0.content")


def test_a_body_that_is_not_utf8_is_400_saying_so(server: Server) -> None:
    body = b'{"model": "sql", "max_tokens": 2, "prompt": "caf\xe9"}'  # Latin-1
    message = _refused(_post(server, "/v1/completions", body), None)
    assert "UTF-8" in message and "0xe9" in message
    ok = _post(server, "/v1/completions", {**COMPLETION, "prompt": "café 日本 😀"})
    assert ok.status_code == 200, ok.text  # real non-ASCII text is fine, escaped or not
    raw = '{"model": "sql", "max_tokens": 2, "prompt": "café 😀"}'.encode()
    assert _post(server, "/v1/completions", raw).status_code == 200


def test_json_without_nan(server: Server) -> None:
    body = b'{"model": "sql", "max_tokens": 2, "prompt": "x", "temperature": NaN}'
    assert "NaN" in _refused(_post(server, "/v1/completions", body), None)


# ----------------------------------------------------------------------------- the LoRA gate


class RecordingEngine:
    """What build_app's adapter routes use of an AsyncEngine; records every load."""

    model_name = "demo"

    def __init__(self) -> None:
        self.loaded: list[tuple[str, str]] = []

    async def load_lora(self, name: str, path: str, *, replace: bool = False) -> None:
        self.loaded.append((name, path))

    def adapter_paths(self) -> dict[str, str]:
        return dict(self.loaded)


def _load(app, path: str, *, key: str | None = None) -> httpx.Response:
    async def call() -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            body = {"lora_name": "new", "lora_path": path}
            return await client.post("/v1/load_lora_adapter", json=body, headers=headers)

    return asyncio.run(call())


@pytest.fixture
def roots(tmp_path: Path) -> dict[str, Path]:
    """roots/allowed/{adapter, in-link -> adapter, out-link -> outside}, and outside/."""
    allowed, outside = tmp_path / "roots" / "allowed", tmp_path / "outside"
    (allowed / "adapter").mkdir(parents=True)
    outside.mkdir()
    (allowed / "in-link").symlink_to(allowed / "adapter")
    (allowed / "out-link").symlink_to(outside)
    return {"root": allowed, "outside": outside}


def _forbidden(r: httpx.Response, *flags: str) -> str:
    assert r.status_code == 403, r.text
    error = r.json()["error"]
    assert error["type"] == "PermissionDeniedError" and error["param"] is None
    for flag in flags:
        assert flag in error["message"], error
    return error["message"]


def test_a_path_inside_a_root_loads(roots: dict[str, Path]) -> None:
    engine = RecordingEngine()
    app = build_app(engine, lora_roots=(roots["root"],))
    assert _load(app, str(roots["root"] / "adapter")).status_code == 200
    assert _load(app, str(roots["root"] / "in-link")).status_code == 200  # a link that stays in
    resolved = str((roots["root"] / "adapter").resolve())
    assert engine.loaded == [("new", resolved), ("new", resolved)]  # the path that was checked


@pytest.mark.parametrize(
    "where",
    ["outside", "dot-dot", "symlink", "root-prefix"],
)
def test_a_path_outside_every_root_is_403(roots: dict[str, Path], where: str) -> None:
    root = roots["root"]
    path = {
        "outside": str(roots["outside"]),
        "dot-dot": f"{root}/adapter/../../../outside",
        "symlink": str(root / "out-link"),
        "root-prefix": f"{root}-evil/adapter",  # shares the root's name as a prefix only
    }[where]
    engine = RecordingEngine()
    _forbidden(_load(build_app(engine, lora_roots=(root,)), path), "--lora-root")
    assert engine.loaded == []


def test_without_a_root_the_api_key_decides(roots: dict[str, Path]) -> None:
    """No root and no key: off, for any path, before anything looks at it. With a key: every
    path the engine can read, as before (the roots still bind when given)."""
    engine = RecordingEngine()
    for path in (str(roots["outside"]), "/nonexistent"):
        _forbidden(_load(build_app(engine), path), "--lora-root", "--api-key")
    assert engine.loaded == []
    keyed = build_app(engine, api_key="k")
    assert _load(keyed, str(roots["outside"]), key="k").status_code == 200
    assert engine.loaded == [("new", str(roots["outside"]))]
    both = build_app(engine, api_key="k", lora_roots=(roots["root"],))
    _forbidden(_load(both, str(roots["outside"]), key="k"), "--lora-root")
