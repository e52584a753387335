"""Structured outputs and tool calls over real HTTP, with the clients people use: the official
openai client and langchain-openai, on the demo server (random weights: whatever the output
says, it keeps to its grammar because the sampler allows nothing else)."""

from __future__ import annotations

import asyncio
import json
import os
import re
from typing import Literal

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

from moelora.server.protocol import ChatCompletionRequest
from moelora.server.tool_calls import ToolParser, tool_format, tool_plan

from .conftest import API_KEY, BASE

# short keys and values: the demo's tokenizer spells most characters as tokens of their own
ORDER = {
    "type": "object",
    "properties": {
        "s": {"enum": ["new", "paid"]},
        "c": {
            "type": "object",
            "properties": {
                "t": {"enum": ["A", "B"]},
                "a": {"type": "integer", "minimum": 18, "maximum": 99},
            },
            "required": ["t", "a"],
        },
        "i": {"type": "array", "items": {"enum": ["x", "y"]}, "minItems": 1, "maxItems": 3},
        "n": {"type": "string", "maxLength": 3},
    },
    "required": ["s", "c", "i"],
}
MODELS = [BASE, "sql", "chat", "extra"]
MIXED = [BASE, "sql", "chat"]  # the server has two adapter slots: these run in one batch
MESSAGES = [{"role": "user", "content": "Place an order"}]


class Pet(BaseModel):
    kind: Literal["cat", "dog", "fish"]
    age: int = Field(ge=0, le=20)
    name: str = Field(max_length=5)


class Weather(BaseModel):
    """Look up the weather of a city."""

    city: Literal["Paris", "Rome"]
    days: int = Field(ge=1, le=7)


class Alarm(BaseModel):
    """Set an alarm."""

    hour: int = Field(ge=0, le=23)


def test_a_json_schema_always_validates_over_50_sampled_requests(server):
    async def ask(client, i: int):
        fmt = {"type": "json_schema", "json_schema": {"name": "order", "schema": ORDER}}
        return await client.chat.completions.create(
            model=MIXED[i % len(MIXED)],
            messages=MESSAGES,
            response_format=fmt,
            temperature=1.0,
            seed=i,
            max_tokens=80,
        )

    async def run():
        async with server.async_client(timeout=300) as client:
            return await asyncio.gather(*(ask(client, i) for i in range(50)))

    answers = asyncio.run(run())
    texts = [a.choices[0].message.content for a in answers]
    assert [a.choices[0].finish_reason for a in answers] == ["stop"] * 50, texts
    for text in texts:
        jsonschema.validate(json.loads(text), ORDER)
    assert len(set(texts)) > 25  # sampled at temperature 1, seeded apart


def test_langchain_structured_output_for_the_base_and_an_adapter_in_one_batch(server):
    from langchain_openai import ChatOpenAI

    async def ask(model: str, seed: int):
        llm = ChatOpenAI(
            model=model,
            base_url=f"{server.url}/v1",
            api_key=API_KEY,
            temperature=1.0,
            seed=seed,
            max_tokens=60,
            max_retries=0,
        )
        return await llm.with_structured_output(Pet).ainvoke("Describe a pet")

    async def run():
        return await asyncio.gather(*(ask(m, s) for s in range(3) for m in (BASE, "sql")))

    pets = asyncio.run(run())
    assert all(isinstance(p, Pet) for p in pets) and len(pets) == 6


def _langchain(server, **kw):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        model="chat",
        base_url=f"{server.url}/v1",
        api_key=API_KEY,
        max_retries=0,
        max_tokens=120,
        **kw,
    )


def _check_calls(calls: list[dict]) -> None:
    assert calls, "no tool call"
    for call in calls:
        assert call["name"] in ("Weather", "Alarm")
        schema = {"Weather": Weather, "Alarm": Alarm}[call["name"]]
        schema.model_validate(call["args"])
        assert call["id"].startswith("call_")


def _seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


def test_langchain_bind_tools_required_streams_the_call_it_returns_whole(server):
    seed = _seed()
    messages = []
    for stream in (False, True):
        llm = _langchain(server, temperature=1.0, seed=seed, streaming=stream)
        # one call: a random model might chain calls until max_tokens
        bound = llm.bind_tools([Weather, Alarm], tool_choice="required", parallel_tool_calls=False)
        if stream:
            chunks = list(bound.stream("What is the weather in Paris?"))
            assert sum(bool(c.tool_call_chunks) for c in chunks) > 2, seed  # header, pieces
            message = chunks[0]
            for chunk in chunks[1:]:
                message += chunk
        else:
            message = bound.invoke("What is the weather in Paris?")
        _check_calls(message.tool_calls)
        assert message.response_metadata.get("finish_reason") == "tool_calls", seed
        messages.append(message)
    whole, streamed = ([(c["name"], c["args"]) for c in m.tool_calls] for m in messages)
    assert streamed == whole, seed


def _tools(*models: type[BaseModel]) -> list[dict]:
    return [
        {"type": "function", "function": {"name": m.__name__, "parameters": m.model_json_schema()}}
        for m in models
    ]


@pytest.mark.parametrize("tool_choice", ["required", "Alarm", "Weather"])
def test_streamed_calls_come_in_pieces_that_add_up_to_the_whole_answer(server, tool_choice):
    """Seeded alike, the stream and the whole answer make the same call: the stream sends its
    header first, then its arguments in pieces, and every token's logprobs once."""
    client, seed = server.client(timeout=60), _seed()
    named = {"type": "function", "function": {"name": tool_choice}}
    request = {
        "model": "chat",
        "messages": MESSAGES,
        "tools": _tools(Weather, Alarm),
        "tool_choice": tool_choice if tool_choice == "required" else named,
        "parallel_tool_calls": False,  # one call: a random model might chain them
        "max_tokens": 120,
        "temperature": 1.0,
        "seed": seed,
        "logprobs": True,
    }
    whole = client.chat.completions.create(**request).choices[0]
    assert whole.finish_reason == "tool_calls", (seed, whole)
    [call] = whole.message.tool_calls
    stream = client.chat.completions.create(
        **request, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    entries = [e for c in chunks if c.choices for e in c.choices[0].delta.tool_calls or []]
    header, *pieces = entries
    assert (header.index, header.function.name, header.function.arguments) == (
        0,
        call.function.name,
        "",
    ), seed
    assert header.id.startswith("call_") and header.type == "function", seed
    assert all(e.index == 0 and e.id is None and e.function.name is None for e in pieces), seed
    assert len(pieces) > 1, seed
    arguments = "".join(e.function.arguments for e in pieces)
    assert json.loads(arguments) == json.loads(call.function.arguments), seed
    if tool_choice != "required":  # the constrained text is the arguments, whole or streamed
        assert arguments == call.function.arguments, seed
    {"Weather": Weather, "Alarm": Alarm}[call.function.name].model_validate_json(arguments)
    choices = [c.choices[0] for c in chunks if c.choices]
    assert [c.finish_reason for c in choices] == [None] * (len(choices) - 1) + ["tool_calls"]
    assert not "".join(c.delta.content or "" for c in choices), seed  # all of it is the call
    logprobs = [t for c in choices if c.logprobs for t in c.logprobs.content]
    assert [t.token for t in logprobs] == [t.token for t in whole.logprobs.content], seed
    assert len(logprobs) == chunks[-1].usage.completion_tokens, seed


def test_the_openai_stream_helper_parses_the_streamed_call_as_the_whole_one(server):
    import openai

    client, seed = server.client(timeout=60), _seed()
    request = {
        "model": BASE,
        "messages": MESSAGES,
        "tools": [openai.pydantic_function_tool(m) for m in (Weather, Alarm)],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_tokens": 120,
        "temperature": 1.0,
        "seed": seed,
    }
    [whole] = client.chat.completions.parse(**request).choices[0].message.tool_calls
    with client.chat.completions.stream(**request) as stream:
        events = list(stream)
        final = stream.get_final_completion().choices[0]
    [call] = final.message.tool_calls
    assert final.finish_reason == "tool_calls", seed
    assert isinstance(call.function.parsed_arguments, (Weather, Alarm)), seed
    assert call.function.parsed_arguments == whole.function.parsed_arguments, seed
    assert call.function.name == whole.function.name, seed
    deltas = [e for e in events if e.type == "tool_calls.function.arguments.delta"]
    [done] = [e for e in events if e.type == "tool_calls.function.arguments.done"]
    assert len(deltas) > 1, seed
    assert "".join(e.arguments_delta for e in deltas) == done.arguments, seed
    assert done.parsed_arguments == whole.function.parsed_arguments, seed


def test_regex_and_choice_hold_with_vllms_fields_and_their_old_names(server):
    client = server.client(timeout=60)
    regex = r"[a-z]{3}@[a-z]{2}\.(com|org)"
    for i, model in enumerate(MODELS):
        text = client.completions.create(
            model=model,
            prompt="email:",
            max_tokens=30,
            temperature=1.0,
            seed=i,
            extra_body={"structured_outputs": {"regex": regex}},
        ).choices[0]
        assert re.fullmatch(regex, text.text) and text.finish_reason == "stop", text
        chat = client.chat.completions.create(
            model=model,
            messages=MESSAGES,
            max_tokens=10,
            temperature=1.0,
            seed=i,
            extra_body={"guided_choice": ["yes", "no", "maybe"]},
        )
        assert chat.choices[0].message.content in ("yes", "no", "maybe")
    guided = client.completions.create(
        model=BASE, prompt="n", max_tokens=10, extra_body={"guided_regex": "[0-9]{4}"}
    )
    assert re.fullmatch("[0-9]{4}", guided.choices[0].text)


def _post(server, body: dict) -> httpx.Response:
    body = {"model": BASE, "messages": MESSAGES, "max_tokens": 8, **body}
    return httpx.post(
        f"{server.url}/v1/chat/completions", json=body, headers=server.headers, timeout=60
    )


@pytest.mark.parametrize(
    "body, says",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nope"}},
                }
            },
            r"^response_format.json_schema.schema is not a valid JSON schema: .*nope",
        ),
        ({"structured_outputs": {"regex": "(["}}, "not a valid regular expression"),
        ({"structured_outputs": {"grammar": "root ::= nothing"}}, "not a valid EBNF grammar"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one of"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "at most one of"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            "tool_choice.function.name: the function 'g' is not among the tools",
        ),
        ({"tool_choice": "required"}, "needs tools"),
    ],
)
def test_invalid_constraints_are_400s_that_say_what_is_wrong(server, body, says):
    r = _post(server, body)
    assert r.status_code == 400, r.text
    assert re.search(says, r.json()["error"]["message"]), r.json()


def test_tool_history_goes_through_the_chat_template(server, offline):
    tools = [{"type": "function", "function": {"name": "Alarm", "parameters": {"type": "object"}}}]
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "Alarm", "arguments": '{"hour": 7}'},
    }
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "set"},
    ]
    r = _post(server, {"messages": messages, "tools": tools, "tool_choice": "auto"})
    assert r.status_code == 200, r.text
    templated = [{**m, "content": m["content"] or ""} for m in messages]
    ids = offline.tokenizer.apply_chat_template(templated, tools)
    text = offline.tokenizer.hf_tokenizer.decode(ids)
    assert '"arguments": {"hour": 7}' in text and "<tool_response>\nset\n</tool_response>" in text
    assert r.json()["usage"]["prompt_tokens"] == len(ids)


def test_auto_parses_hermes_calls_and_is_refused_where_the_format_is_unknown():
    parser = ToolParser("auto")
    call = '{"name": "Weather", "arguments": {"city": "Rome"}}'
    text = f"Let me look.\n<tool_call>\n{call}\n</tool_call>"
    content, calls = parser.parse(text)
    assert content == "Let me look." and [c.name for c in calls] == ["Weather"]
    assert json.loads(calls[0].arguments) == {"city": "Rome"}
    assert parser.parse("no call here") == ("no call here", [])
    assert parser.streamed_text_end("Let me <tool") == len("Let me ")
    assert tool_format("{{ messages }}") is None
    body = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": MESSAGES,
            "tools": [{"type": "function", "function": {"name": "f"}}],
        }
    )
    with pytest.raises(Exception, match="tool_choice='auto' needs the model's tool-call format"):
        tool_plan(body, "{{ messages }}")
    assert tool_plan(body, "<tool_call>")[1] == ToolParser("auto")
