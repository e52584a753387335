"""Streamed tool calls without a server: the extractor (ToolParser.partial_calls) fed real calls
text a character at a time, and ChatAnswer's chunks fed outputs of random sizes, against the
whole answer to the same text. Inputs are drawn fresh each run; a failure prints its seed."""

from __future__ import annotations

import json
import os
import random
from typing import Any

import pytest

from moelora.server.openai_format import ChatAnswer
from moelora.server.streaming import TextDeltas
from moelora.server.tool_calls import HERMES_CLOSE, HERMES_OPEN, CallStream, ToolParser
from moelora.step.request import RequestOutput

# what breaks a scan that does not respect strings: brackets, quotes, escapes, separators
TRICKY = '{}[]":,\\ <>é\n'


def _rng() -> tuple[random.Random, int]:
    seed = int.from_bytes(os.urandom(4), "little")
    return random.Random(seed), seed


def _string(rng: random.Random) -> str:
    return "".join(rng.choice("ab " + TRICKY) for _ in range(rng.randint(0, 8)))


def _value(rng: random.Random, depth: int) -> Any:
    kinds = ["str", "int", "float", "bool", "null"] + ["obj", "arr"] * (depth < 3)
    kind = rng.choice(kinds)
    if kind == "obj":
        return {_string(rng): _value(rng, depth + 1) for _ in range(rng.randint(0, 3))}
    if kind == "arr":
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    scalars = {
        "str": _string,
        "int": lambda r: r.randint(-(10**6), 10**6),
        "float": lambda r: r.uniform(-1e3, 1e3),
        "bool": lambda r: r.random() < 0.5,
        "null": lambda r: None,
    }
    return scalars[kind](rng)


def _arguments(rng: random.Random) -> dict[str, Any]:
    """An object with a nested object and a string holding braces and an escaped quote."""
    args = {_string(rng): _value(rng, 1) for _ in range(rng.randint(0, 3))}
    args["nested"] = {"deeper": {_string(rng): _value(rng, 2)}, "list": [_value(rng, 2)]}
    args["tricky"] = '}{"' + _string(rng) + '\\"}]'
    return dict(rng.sample(list(args.items()), len(args)))


def _dumps(rng: random.Random):
    """json.dumps with separators and escaping drawn once: one text's calls share them."""
    separators = rng.choice([(", ", ": "), (",", ":")])
    ascii_only = rng.random() < 0.5
    return lambda v: json.dumps(v, separators=separators, ensure_ascii=ascii_only)


def _calls_text(mode: str, calls: list[tuple[str, dict]], rng: random.Random) -> tuple[str, list]:
    """The text a model writes for the calls in the mode, and each call's arguments text."""
    dumps = _dumps(rng)
    arguments = [dumps(a) for _, a in calls]
    if mode == "named":
        return arguments[0], arguments
    if mode == "required":
        return dumps([{"name": n, "parameters": a} for n, a in calls]), arguments
    text = "Let me look it up: {maybe} <b>.\n"
    for name, args in calls:
        space = rng.choice(["", "\n", " \n"])
        text += f"{HERMES_OPEN}{space}{dumps({'name': name, 'arguments': args})}{space}"
        text += f"{HERMES_CLOSE}\n"
    return text, arguments


def _draw(mode: str, rng: random.Random) -> tuple[ToolParser, list[tuple[str, dict]]]:
    if mode == "named":
        return ToolParser("named", "lookup"), [("lookup", _arguments(rng))]
    names = ["lookup", "get_weather"]  # two parallel calls
    return ToolParser(mode), [(rng.choice(names), _arguments(rng)) for _ in names]


@pytest.mark.parametrize("mode", ["named", "required", "auto"])
def test_calls_fed_a_character_at_a_time_stream_their_arguments_whole(mode: str) -> None:
    for _ in range(20):
        rng, seed = _rng()
        parser, calls = _draw(mode, rng)
        text, arguments = _calls_text(mode, calls, rng)
        stream, entries = CallStream(), []
        for k in range(len(text) + 1):
            partial = parser.partial_calls(text[:k])
            for i, call in enumerate(partial):  # never ahead of the text, never closed early
                assert arguments[i].startswith(call.arguments), (seed, text[:k], call)
            entries += stream.advance(partial)
        headers = [e for e in entries if "id" in e]
        assert [e["index"] for e in headers] == list(range(len(calls))), seed
        assert [e["function"]["name"] for e in headers] == [n for n, _ in calls], seed
        assert len({e["id"] for e in headers}) == len(calls), seed
        assert all(e["id"].startswith("call_") and e["type"] == "function" for e in headers)
        joined = [""] * len(calls)
        for e in entries:
            if "id" not in e:
                assert headers[e["index"]] in entries[: entries.index(e)], seed  # header first
                assert set(e) == {"index", "function"} and set(e["function"]) == {"arguments"}
            joined[e["index"]] += e["function"]["arguments"]
        assert joined == arguments, seed
        content, whole = parser.parse(text)
        assert [c.name for c in whole] == [n for n, _ in calls], seed
        assert [json.loads(c.arguments) for c in whole] == [json.loads(a) for a in joined], seed
        assert [json.loads(a) for a in joined] == [a for _, a in calls], seed


def test_a_hermes_call_without_arguments_streams_the_empty_object_parse_reads() -> None:
    parser = ToolParser("auto")
    text = f'{HERMES_OPEN}{{"name": "ping"}}{HERMES_CLOSE}'
    entries = _fed(parser, text)
    assert [e["function"]["arguments"] for e in entries] == ["", "{}"]
    assert parser.parse(text)[1][0].arguments == "{}"


def _fed(parser: ToolParser, text: str) -> list[dict]:
    stream = CallStream()
    return [e for k in range(len(text) + 1) for e in stream.advance(parser.partial_calls(text[:k]))]


@pytest.mark.parametrize("arguments_first", [False, True])
def test_fields_beside_name_and_arguments_are_skipped_whatever_their_strings_hold(
    arguments_first: bool,
) -> None:
    rng, seed = _rng()
    extra = {"why": 'say "hi", then {' + _string(rng), "x": {"y": "}}" + _string(rng)}}
    arguments = {"a": [1, {"b": "]" + _string(rng)}]}
    fields = [("name", "f"), *extra.items(), ("arguments", arguments)]
    if arguments_first:  # the header waits for the name, then the arguments come at once
        fields.reverse()
    text = f"{HERMES_OPEN}{json.dumps(dict(fields))}{HERMES_CLOSE}"
    entries = _fed(ToolParser("auto"), text)
    assert [e["function"].get("name") for e in entries if "id" in e] == ["f"], seed
    assert "".join(e["function"]["arguments"] for e in entries) == json.dumps(arguments), seed
    assert json.loads(ToolParser("auto").parse(text)[1][0].arguments) == arguments, seed


def test_the_scan_stops_at_what_cannot_be_a_call() -> None:
    required, auto = ToolParser("required"), ToolParser("auto")
    assert required.partial_calls('{"name": "f"}') == []  # not an array
    assert required.partial_calls('[{"name": 3, "parameters": {}}]') == []  # a name not a string
    cut = required.partial_calls('[{"name": "f", "parameters": {"a": "}')
    assert [(c.name, c.arguments) for c in cut] == [("f", '{"a": "}')]  # the brace is a string's
    cut = required.partial_calls('[{"name": "f", "parameters": {"a": "\\"}')
    assert [c.arguments for c in cut] == ['{"a": "\\"}']  # the quote is escaped: still open
    assert auto.partial_calls(f"{HERMES_OPEN} [1]") == []
    assert auto.partial_calls(f'{HERMES_OPEN}{{"name": "f') == []  # the name not yet whole


class _NoDecoder:
    """The chunks below ask for no logprobs: nothing is decoded."""

    def decode(self, ids: list[int]) -> str:
        raise AssertionError("decoded")

    token_bytes = leading_bytes = decode


def _streamed(parser: ToolParser, text: str, finish_reason: str, rng: random.Random) -> list:
    """ChatAnswer's chunks for the text arriving in outputs of 1 to 4 characters."""
    answer = ChatAnswer(_NoDecoder(), "chatcmpl-1", "m", 1, 0, parser)
    deltas, chunks, k = TextDeltas(None), [], 0
    while k < len(text):
        k = min(len(text), k + rng.randint(1, 4))
        finished = finish_reason if k == len(text) else None
        out = RequestOutput("r", [1], list(range(k)), text[:k], finished, None)
        chunks += [c["choices"][0] for c in answer.chunks(0, out, deltas.next(out))]
    return chunks


def _joined(chunks: list) -> tuple[str, dict[int, dict]]:
    """The content and the calls (by index) that a client puts together from the chunks."""
    content, calls = "", {}
    for chunk in chunks:
        content += chunk["delta"].get("content", "")
        for entry in chunk["delta"].get("tool_calls", []):
            call = calls.setdefault(entry["index"], {"id": entry.get("id"), "arguments": ""})
            call.setdefault("name", entry["function"].get("name"))
            call["arguments"] += entry["function"]["arguments"]
    return content, calls


@pytest.mark.parametrize("mode", ["named", "required", "auto"])
def test_streamed_chunks_add_up_to_the_whole_answer(mode: str) -> None:
    for _ in range(10):
        rng, seed = _rng()
        parser, calls = _draw(mode, rng)
        text, arguments = _calls_text(mode, calls, rng)
        chunks = _streamed(parser, text, "stop", rng)
        content, streamed = _joined(chunks)
        whole = ChatAnswer(_NoDecoder(), "chatcmpl-1", "m", 1, 0, parser).choice(
            0, RequestOutput("r", [1], [0] * len(text), text, "stop", None)
        )
        assert whole["finish_reason"] == "tool_calls", seed
        assert [c["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["tool_calls"]
        assert content.strip() == (whole["message"]["content"] or ""), seed
        assert "<" not in content.replace("<b>", ""), (seed, content)  # no part of a tag
        assert [c["arguments"] for c in streamed.values()] == arguments, seed
        wanted = [c["function"] for c in whole["message"]["tool_calls"]]
        assert [c["name"] for c in streamed.values()] == [w["name"] for w in wanted], seed
        assert [json.loads(c["arguments"]) for c in streamed.values()] == [
            json.loads(w["arguments"]) for w in wanted
        ], seed


@pytest.mark.parametrize("mode", ["named", "required", "auto"])
def test_a_call_cut_by_max_tokens_keeps_its_pieces_and_says_length(mode: str) -> None:
    rng, seed = _rng()
    parser, calls = _draw(mode, rng)
    text, arguments = _calls_text(mode, calls, rng)
    end = text.index(arguments[-1]) + rng.randrange(1, len(arguments[-1]))  # inside the last
    chunks = _streamed(parser, text[:end], "length", rng)
    _, streamed = _joined(chunks)
    assert chunks[-1]["finish_reason"] == "length", seed
    assert [c["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1), seed
    *whole, last = [c["arguments"] for c in streamed.values()]
    assert whole == arguments[:-1], seed
    assert arguments[-1].startswith(last) and last != arguments[-1], (seed, last)  # nothing added


def test_auto_without_a_call_streams_all_of_its_text_as_content() -> None:
    rng, seed = _rng()
    text = "a <b> and a <tool" + _string(rng) + "<tool_ca"
    chunks = _streamed(ToolParser("auto"), text, "stop", rng)
    content, calls = _joined(chunks)
    assert (content, calls) == (text, {}), seed
    assert chunks[-1]["finish_reason"] == "stop", seed
