"""/openapi.json against the server itself: schemathesis 4.32 (`st run`, every check, every phase)
on the shared demo server, bounded (20 examples an operation, a fixed seed, one worker).

It must find no 5xx, no response that does not match the schema (status, Content-Type, body),
no schema-invalid request accepted, and no schema-valid request refused but for what a schema
cannot say: a prompt longer than max_model_len once tokenized, a token id outside the
vocabulary, an adapter folder that does not hold an adapter. Those 400s are allowed only with
one of the messages in SEMANTIC_REFUSALS (the check `only_semantic_refusals`).

This file is also the run's hooks module: `st run` loads it by path (SCHEMATHESIS_HOOKS), in its
own process, where the hooks below register. Before each call they
- keep POST /v1/unload_lora_adapter away from the adapters the other tests use (it is run like
  every operation, on names that are not loaded: 404, 400 or 409 are what it can answer);
- name a served model in most generation requests (random names would only ever get 404), and
  cap n and max_tokens so the generations stay short. Each change keeps a valid request valid
  and an invalid one invalid: a string stays a string, a count in range stays in range.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

API_KEY = "test-key"  # conftest's; not imported: schemathesis loads this file on its own
PROTECTED_ADAPTERS = frozenset({"sql", "chat", "extra", "hot", "misshapen"})
SERVED = ("demo", "sql", "chat", "extra")
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
# a grammar xgrammar cannot compile, two constraints at once, a tool choice the tools do not
# allow: what a JSON schema of the body cannot say
_CONSTRAINTS = (
    r"|structured outputs are asked for by"
    r"|^(structured_outputs|response_format|guided_json|tools)[^:]* is (not a valid|invalid)"
    r"|tool_choice"
)
# what a schema-valid request may be refused for (HTTP 400; a `param` only for a schema that
# names the field it came in), and why
SEMANTIC_REFUSALS = {
    "/v1/completions": r"max_model_len|maximum context length|token id \d+ is invalid"
    + _CONSTRAINTS,
    "/v1/chat/completions": r"max_model_len|maximum context length|token id \d+ is invalid"
    + _CONSTRAINTS,
    "/v1/load_lora_adapter": r"^adapter .*: |already loaded",  # the folder, not the schema
}
# schemathesis's default, and 400, which only_semantic_refusals checks
ALLOWED = ["2xx", "3xx", "401", "403", "404", "409", "429", "5xx", "400"]
MAX_EXAMPLES = 20
MAX_TOKENS = 8
SEED = 21


def test_schemathesis_finds_nothing(server, tmp_path: Path) -> None:
    config = tmp_path / "schemathesis.toml"
    config.write_text(_config())
    cmd = [
        sys.executable,
        "-m",
        "schemathesis.cli",
        "--config-file",
        str(config),
        "run",
        f"{server.url}/openapi.json",
        "--header",
        f"Authorization: Bearer {API_KEY}",
        "--max-examples",
        str(MAX_EXAMPLES),
        "--seed",
        str(SEED),
        "--workers",
        "1",
        "--request-timeout",
        "60",
        "--report",
        "ndjson",
        "--report-dir",
        str(tmp_path / "report"),
    ]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": __file__, "NO_COLOR": "1"}
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-20000:]
    assert "Tested: 7" in output, output[-5000:]  # every operation, none skipped
    loaded = {m["id"] for m in httpx.get(f"{server.url}/v1/models", headers=_auth()).json()["data"]}
    assert {"sql", "chat", "extra"} <= loaded


def _config() -> str:
    blocks = []
    for path in SEMANTIC_REFUSALS:
        blocks.append(
            f'[[operations]]\ninclude-name = "POST {path}"\n'
            f"checks.positive_data_acceptance.expected-statuses = {json.dumps(ALLOWED)}\n"
        )
    return "\n".join(blocks)


def _auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


# ----------------------------------------------------------------------------- the schema itself

ROUTES = {
    ("/v1/completions", "post"): {200, 400, 401, 404, 413, 415, 500, 503},
    ("/v1/chat/completions", "post"): {200, 400, 401, 404, 413, 415, 500, 503},
    ("/v1/models", "get"): {200, 401},
    ("/v1/load_lora_adapter", "post"): {200, 400, 401, 413, 415, 500, 503},
    ("/v1/unload_lora_adapter", "post"): {200, 400, 401, 404, 409, 413, 415, 500, 503},
    ("/health", "get"): {200, 503},
    ("/metrics", "get"): {200, 500, 503},
}


def _spec(server) -> dict:
    return httpx.get(f"{server.url}/openapi.json", timeout=10).json()


def _ref(content: dict) -> str:
    return content["schema"]["$ref"].rsplit("/", 1)[-1]


def test_each_route_documents_the_statuses_it_answers(server) -> None:
    spec = _spec(server)
    assert "422" not in json.dumps(spec) and "HTTPValidationError" not in spec["components"]
    documented = {
        (path, method): {int(s) for s in op["responses"]}
        for path, methods in spec["paths"].items()
        for method, op in methods.items()
    }
    assert documented == ROUTES
    for (path, method), statuses in ROUTES.items():
        op = spec["paths"][path][method]
        for status in statuses - {200} - ({503} if path == "/health" else set()):
            assert _ref(op["responses"][str(status)]["content"]["application/json"]) == "ErrorBody"
        assert (op.get("security") == [{"bearer": []}]) == path.startswith("/v1")
    assert spec["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    health = spec["paths"]["/health"]["get"]["responses"]
    assert "content" not in health["200"] and "content" not in health["503"]  # empty bodies


def test_answers_are_typed(server) -> None:
    spec = _spec(server)
    paths = spec["paths"]
    for path, whole, chunk in [
        ("/v1/completions", "Completion", "CompletionChunk"),
        ("/v1/chat/completions", "ChatCompletion", "ChatCompletionChunk"),
    ]:
        ok = paths[path]["post"]["responses"]["200"]["content"]
        assert _ref(ok["application/json"]) == whole
        done, data = ok["text/event-stream"]["itemSchema"]["properties"]["data"]["anyOf"]
        assert done == {"const": "[DONE]"}
        refs = {r["$ref"].rsplit("/", 1)[-1] for r in data["contentSchema"]["oneOf"]}
        assert refs == {chunk, "ErrorBody"}
    models = paths["/v1/models"]["get"]["responses"]["200"]["content"]["application/json"]
    assert _ref(models) == "ModelList"
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        text = paths[path]["post"]["responses"]["200"]["content"]["text/plain"]
        assert text["schema"] == {"type": "string"}


def _bounds(schema: dict) -> dict:
    """The bounds of a field, through its `anyOf: [..., null]`."""
    for option in schema.get("anyOf", [schema]):
        if option.get("type") in ("integer", "number"):
            keys = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
            return {k: option[k] for k in keys if k in option}
    raise AssertionError(schema)


def test_the_request_schemas_state_the_limits(server) -> None:
    schemas = _spec(server)["components"]["schemas"]
    completion = schemas["CompletionRequest"]["properties"]
    chat = schemas["ChatCompletionRequest"]["properties"]
    assert _bounds(completion["n"]) == {"minimum": 1, "maximum": 128}
    assert _bounds(completion["logprobs"]) == {"minimum": 0, "maximum": 20}
    assert _bounds(chat["top_logprobs"]) == {"minimum": 0, "maximum": 20}
    assert _bounds(completion["max_tokens"]) == {"minimum": 1}
    assert _bounds(chat["max_completion_tokens"]) == {"minimum": 1}
    assert _bounds(completion["temperature"]) == {"minimum": 0}
    assert _bounds(completion["top_p"]) == {"exclusiveMinimum": 0, "maximum": 1}
    assert _bounds(completion["presence_penalty"]) == {"minimum": -2, "maximum": 2}
    assert _bounds(completion["seed"]) == {"minimum": -(2**63), "exclusiveMaximum": 2**64}
    bias = completion["logit_bias"]["anyOf"][0]["additionalProperties"]
    assert (bias["minimum"], bias["maximum"]) == (-100, 100)
    assert schemas["ChatCompletionRequest"]["then"]["properties"]["logprobs"] == {"const": True}


def _validator(spec: dict, model: str):
    import jsonschema_rs  # schemathesis's validator

    root = {"$ref": f"#/components/schemas/{model}", "components": spec["components"]}
    return jsonschema_rs.validator_for(root)


def _sse(r: httpx.Response) -> list[dict]:
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_answers_match_their_schemas(server) -> None:
    """The bodies whole and streamed (schemathesis reads no SSE), logprobs and echo included."""
    spec, url, headers = _spec(server), server.url, server.headers
    completion = {"model": "sql", "prompt": "SELECT", "max_tokens": 3, "logprobs": 2, "n": 2}
    chat = {
        "model": "chat",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "logprobs": True,
        "top_logprobs": 2,
    }
    tools = [{"type": "function", "function": {"name": "f"}}]  # no parameters: {}
    tool_call = {**chat, "max_tokens": 80, "tools": tools, "tool_choice": "required"}
    tool_call["parallel_tool_calls"] = False  # one call, [{"name": "f", "parameters": {}}]
    cases = [
        ("/v1/completions", {**completion, "echo": True}, "Completion", "CompletionChunk"),
        ("/v1/chat/completions", chat, "ChatCompletion", "ChatCompletionChunk"),
        ("/v1/chat/completions", tool_call, "ChatCompletion", "ChatCompletionChunk"),
    ]
    for path, body, whole, chunk in cases:
        r = httpx.post(f"{url}{path}", json=body, headers=headers, timeout=60)
        _validator(spec, whole).validate(r.json())
        calls = "tools" in body  # the call ends the answer before max_tokens
        assert not calls or r.json()["choices"][0]["finish_reason"] == "tool_calls", r.json()
        streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
        r = httpx.post(f"{url}{path}", json=streamed, headers=headers, timeout=60)
        assert r.headers["content-type"].startswith("text/event-stream")
        chunks = _sse(r)
        if not calls:
            assert chunks[-1]["usage"]["completion_tokens"] == 3 * body.get("n", 1)
        assert not calls or chunks[-2]["choices"][0]["finish_reason"] == "tool_calls"
        for event in chunks:
            _validator(spec, chunk).validate(event)
    models = httpx.get(f"{url}/v1/models", headers=headers, timeout=10).json()
    _validator(spec, "ModelList").validate(models)
    refused = httpx.post(f"{url}/v1/completions", json={"model": "sql"}, headers=headers)
    _validator(spec, "ErrorBody").validate(refused.json())


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [
        ("PUT", "/v1/completions", "POST"),
        ("DELETE", "/health", "GET"),
        ("POST", "/v1/models", "GET"),
    ],
)
def test_405_names_the_allowed_methods(server, method: str, path: str, allow: str) -> None:
    r = httpx.request(method, f"{server.url}{path}", headers=server.headers, timeout=10)
    assert r.status_code == 405
    assert allow in r.headers["allow"].split(", ")
    assert r.json()["error"]["type"] == "MethodNotAllowedError"


def test_403_is_documented_where_loading_can_be_refused() -> None:
    from moelora.server.api import build_app

    from .test_strict import RecordingEngine

    def statuses(**kw) -> set[str]:
        spec = build_app(RecordingEngine(), **kw).openapi()
        return set(spec["paths"]["/v1/load_lora_adapter"]["post"]["responses"])

    assert "403" in statuses()  # no key, no root: loading is off
    assert "403" in statuses(api_key="k", lora_roots=("/tmp",))
    assert "403" not in statuses(api_key="k")  # every path loads


# ----------------------------------------------------------------------------- the hooks


def protect_adapters(body: Any) -> None:
    name = body.get("lora_name") if isinstance(body, dict) else None
    if isinstance(name, str) and name in PROTECTED_ADAPTERS:
        body["lora_name"] = f"not-{name}"  # non-empty still: as valid as before


def served_and_short(body: Any) -> None:
    if not isinstance(body, dict):
        return
    model = body.get("model")
    if isinstance(model, str) and len(model) % 5 != 4:  # one in five keeps its random name
        body["model"] = SERVED[len(model) % len(SERVED)]
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = MAX_TOKENS  # not the room max_model_len leaves
    for key, cap in (("n", 2), ("max_tokens", MAX_TOKENS), ("max_completion_tokens", MAX_TOKENS)):
        value = body.get(key)
        if _is_count(value) and value > cap:
            body[key] = cap


def _is_count(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 1


def semantic_refusal(path: str, status: int, body: bytes) -> str | None:
    """None when a 400 to a schema-valid request is one SEMANTIC_REFUSALS allows; else why not."""
    if status != 400:
        return None
    pattern = SEMANTIC_REFUSALS.get(path)
    try:
        error = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return f"a 400 that is not OpenAI's error JSON: {body[:200]!r}"
    message, param = error.get("message", ""), error.get("param")
    if pattern and (param is None or message.startswith(param)) and re.search(pattern, message):
        return None
    return f"a schema-valid request was refused: {error}"


if __name__ == "_schemathesis_hooks":  # loaded by `st run`, not by pytest
    import schemathesis

    @schemathesis.hook
    def before_call(ctx, case, kwargs) -> None:
        if case.operation.path == "/v1/unload_lora_adapter":
            protect_adapters(case.body)
        elif case.operation.path in GENERATION_PATHS:
            served_and_short(case.body)

    @schemathesis.check
    def only_semantic_refusals(ctx, response, case) -> bool | None:
        meta = case.meta
        if meta is None or not meta.generation.mode.is_positive:
            return None
        why = semantic_refusal(case.operation.path, response.status_code, response.content)
        if why is not None:
            raise AssertionError(why)
        return None
