"""What a third-party client sees (the openai client, against the package's server): a tool call
cut by max_tokens comes back in `tool_calls` whether streamed or not, and a refusal names the
field the client sent, not one of the server's own."""

from __future__ import annotations

import json

import openai
import pytest

from .conftest import BASE, Server

WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city", "days"],
        },
    },
}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def _refusal(e: pytest.ExceptionInfo[openai.BadRequestError]) -> dict:
    assert e.value.status_code == 400
    return e.value.response.json()["error"]


@pytest.mark.parametrize(
    ("choice", "max_tokens"),
    [({"type": "function", "function": {"name": "weather"}}, 12), ("required", 24)],
    ids=["named", "required"],
)
def test_a_call_cut_by_max_tokens_is_in_tool_calls_streamed_or_not(
    server: Server, choice: object, max_tokens: int
) -> None:
    """max_tokens cuts the call after its name (greedy on the demo): inside the arguments."""
    client = server.client()
    kw = dict(model=BASE, messages=ASK, tools=[WEATHER], tool_choice=choice, temperature=0.0)
    kw["max_tokens"] = max_tokens
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "length"
    streamed: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for choice_delta in chunk.choices:
            finish = choice_delta.finish_reason or finish
            for call in choice_delta.delta.tool_calls or []:
                entry = streamed.setdefault(call.index, {"name": None, "arguments": ""})
                entry["name"] = call.function.name or entry["name"]
                entry["arguments"] += call.function.arguments or ""
    assert finish == "length"
    calls = whole.message.tool_calls or []
    got = [{"name": c.function.name, "arguments": c.function.arguments} for c in calls]
    assert got == list(streamed.values())
    assert [c["name"] for c in got] == ["weather"] and whole.message.content is None
    if choice != "required":  # the named call's arguments begin with the first token
        with pytest.raises(json.JSONDecodeError):
            json.loads(got[0]["arguments"])  # as written: nothing is added to close it


def test_a_bad_response_format_schema_names_that_field(server: Server) -> None:
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}
    with pytest.raises(openai.BadRequestError) as e:
        server.client().chat.completions.create(
            model=BASE, messages=ASK, max_tokens=4, response_format=bad
        )
    error = _refusal(e)
    assert error["param"] == "response_format.json_schema.schema", error
    assert error["message"].startswith("response_format.json_schema.schema"), error
    assert "foo" in error["message"] and "structured_outputs" not in error["message"], error


def test_a_bad_tool_parameters_schema_names_that_field(server: Server) -> None:
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}
    with pytest.raises(openai.BadRequestError) as e:
        server.client().chat.completions.create(
            model=BASE, messages=ASK, max_tokens=4, tools=[WEATHER, bad], tool_choice="required"
        )
    assert _refusal(e)["param"] == "tools.1.function.parameters"


def test_tool_choice_naming_a_missing_function_names_that_field(server: Server) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        server.client().chat.completions.create(
            model=BASE,
            messages=ASK,
            max_tokens=4,
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )
    error = _refusal(e)
    assert error["param"] == "tool_choice.function.name", error
    assert "'nope'" in error["message"] and "'weather'" in error["message"], error


def test_an_unknown_role_is_400_naming_it_and_the_roles(server: Server) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "wizard", "content": "abracadabra"}]
    with pytest.raises(openai.BadRequestError) as e:
        server.client().chat.completions.create(model=BASE, messages=messages, max_tokens=4)
    error = _refusal(e)
    assert error["param"] == "messages.1.role", error
    for role in ("wizard", "system", "developer", "user", "assistant", "tool", "function"):
        assert role in error["message"], error


@pytest.mark.parametrize("role", ["system", "developer", "user"])
def test_openai_roles_are_accepted(server: Server, role: str) -> None:
    messages = [{"role": role, "content": "hi"}, {"role": "user", "content": "hi"}]
    r = server.client().chat.completions.create(model=BASE, messages=messages, max_tokens=2)
    assert r.choices[0].finish_reason in ("stop", "length")
