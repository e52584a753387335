"""Tool calls for chat: what `tools` and `tool_choice` ask the engine for, and how the text the
model writes becomes OpenAI's `tool_calls`.

- "required": the output is constrained to a JSON array of calls, `[{"name": ..., "parameters":
  {...}}]`, each name one of the tools and its parameters valid for that tool's schema (vLLM's
  form); one call at most with parallel_tool_calls false.
- a named function: the output is constrained to that function's parameters: the arguments.
- "auto": unconstrained; the calls are parsed from the model's own format, known from its chat
  template. Qwen's Hermes format, `<tool_call>{"name": ..., "arguments": ...}</tool_call>`, is
  the one moelora knows; any other template is refused for "auto" rather than guessed.
- "none": the tools go to the template and nothing is parsed.

Streamed, calls go out as OpenAI sends them: a call's first chunk names it (index, id, type,
function.name, arguments ""), the chunks after add pieces of its arguments' JSON text. Where they
come from is `ToolParser.partial_calls`, a pure function of the text so far (each call once its
name is whole, its arguments as far as written), which a `CallStream` diffs against what the
choice has sent. Streamed arguments are the model's own text of the value; a whole answer
writes the parsed value again with json.dumps (for "required" and "auto"): the same JSON value,
whose text may differ in spacing, escapes and number spellings. A whole answer whose calls do
not parse (cut by max_tokens) gives the calls as `partial_calls` reads them, as its stream did.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from moelora.errors import InvalidRequestError
from moelora.sampling_params import StructuredOutputsParams
from moelora.server.protocol import (
    ChatCompletionRequest,
    FieldError,
    NamedToolChoice,
    ToolSpec,
    check_json_schema,
)

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
# a function without `parameters` takes none: its arguments are {} (a bare {"type": "object"}
# would let a model write any object, as long as it likes)
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
# a JSON string with its escapes (not checked), and what a bracket count must see: strings,
# a quote that opens a string the text has not closed, brackets
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|["{}\[\]]')
_SCALAR = re.compile(r'[^\s,:"{}\[\]]*')
_SPACE = re.compile(r"\s*")


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def json(self) -> dict[str, Any]:
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": function}


@dataclass(frozen=True)
class PartialCall:
    """A call as far as the text so far writes it: the name whole, the arguments a prefix of the
    JSON text they will have (all of it once the value closes)."""

    name: str
    arguments: str


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolParser:
    """How one chat's output becomes tool calls."""

    mode: str  # "required" | "named" | "auto"
    name: str | None = None  # the named function's

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(the content left, the calls); no calls when the text holds none that parse."""
        try:
            if self.mode == "named":
                json.loads(text)
                return None, [ToolCall(new_call_id(), self.name, text)]
            if self.mode == "required":
                calls = [_call(c["name"], c["parameters"]) for c in json.loads(text)]
                return None, calls
            found = [json.loads(m) for m in _HERMES_CALL.findall(text)]
            calls = [_call(c["name"], c.get("arguments", {})) for c in found]
        except (ValueError, KeyError, TypeError):
            return text, []
        if not calls:
            return text, []
        return text[: text.index(HERMES_OPEN)].strip() or None, calls

    def partial_calls(self, text: str) -> list[PartialCall]:
        """The calls the text so far has begun, in order, each from the moment its name is whole.
        As the text grows, a call's arguments only grow: nothing is closed that the text has
        not closed. The scan stops at the first thing that cannot be a call."""
        if self.mode == "named":
            return [PartialCall(self.name, text)]
        if self.mode == "required":
            return _array_calls(text)
        return _hermes_calls(text)

    def streamed_text_end(self, text: str) -> int:
        """How much of the text so far may stream as content: none of a constrained call, and
        in "auto" nothing from a `<tool_call>` on (or from a `<` that may start one)."""
        if self.mode != "auto":
            return 0
        start = text.find(HERMES_OPEN)
        if start >= 0:
            return start
        for keep in range(min(len(HERMES_OPEN) - 1, len(text)), 0, -1):
            if HERMES_OPEN.startswith(text[-keep:]):
                return len(text) - keep
        return len(text)


class CallStream:
    """What a streamed choice has sent of its calls: each call's id, and how many characters of
    its arguments."""

    def __init__(self) -> None:
        self.ids: list[str] = []
        self.sent: list[int] = []

    def advance(self, calls: list[PartialCall]) -> list[dict[str, Any]]:
        """The `tool_calls` entries, one a chunk, that bring the client from what was sent to
        `calls`: a call's header when it first appears, then the characters its arguments add."""
        entries = []
        for i, call in enumerate(calls):
            if i == len(self.ids):
                self.ids.append(new_call_id())
                self.sent.append(0)
                header = {"index": i, "id": self.ids[i], "type": "function"}
                header["function"] = {"name": call.name, "arguments": ""}
                entries.append(header)
            if len(call.arguments) > self.sent[i]:
                piece = call.arguments[self.sent[i] :]
                entries.append({"index": i, "function": {"arguments": piece}})
                self.sent[i] = len(call.arguments)
        return entries


def _array_calls(text: str) -> list[PartialCall]:
    """The calls of "required": `[{"name": ..., "parameters": {...}}, ...]`."""
    calls: list[PartialCall] = []
    pos = _skip_space(text, 0)
    if not text.startswith("[", pos):
        return calls
    pos += 1
    while True:
        call, end = _scan_call(text, _skip_space(text, pos), "parameters")
        if call is None:
            return calls
        calls.append(call)
        if end is None:
            return calls
        pos = _skip_space(text, end)
        if not text.startswith(",", pos):
            return calls
        pos += 1


def _hermes_calls(text: str) -> list[PartialCall]:
    """The calls of "auto": `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` each."""
    calls: list[PartialCall] = []
    start = text.find(HERMES_OPEN)
    while start >= 0:
        call, end = _scan_call(text, _skip_space(text, start + len(HERMES_OPEN)), "arguments")
        if call is None:
            return calls
        calls.append(call)
        if end is None:
            return calls
        start = text.find(HERMES_OPEN, end)
    return calls


def _scan_call(text: str, start: int, arguments_key: str) -> tuple[PartialCall | None, int | None]:
    """The call object at text[start]: the call once its name is whole (else None), and where
    the object ends (None while the text has not closed it). Without its arguments key, a closed
    object's arguments are {}, as `parse` reads it."""
    if not text.startswith("{", start):
        return None, None
    name, arguments, end, pos = None, None, None, start + 1
    while True:
        pos = _skip_space(text, pos)
        if text.startswith("}", pos):
            end = pos + 1
            break
        key = _STRING.match(text, pos)
        if key is None:
            break
        pos = _skip_space(text, key.end())
        if not text.startswith(":", pos):
            break
        value = _skip_space(text, pos + 1)
        value_end, field = _value_end(text, value), _string(key.group())
        if field == arguments_key and arguments is None:
            arguments = text[value:value_end]
        elif field == "name" and value_end is not None:
            name = _string(text[value:value_end])
        if value_end is None:
            break
        pos = _skip_space(text, value_end)
        if text.startswith(",", pos):
            pos += 1
        elif not text.startswith("}", pos):
            break
    if name is None:
        return None, end
    if arguments is None:
        arguments = "" if end is None else "{}"
    return PartialCall(name, arguments), end


def _value_end(text: str, start: int) -> int | None:
    """Where the JSON value at text[start] ends; None while the text so far does not end it.
    Brackets are counted outside strings (escaped quotes stay inside), not matched by kind: the
    text is a call's, which a grammar or the final parse checks."""
    if text.startswith('"', start):
        string = _STRING.match(text, start)
        return string.end() if string else None
    if text.startswith(("{", "["), start):
        depth = 0
        for token in _TOKEN.finditer(text, start):
            t = token.group()
            if t == '"':
                return None
            if t[0] != '"':
                depth += 1 if t in "{[" else -1
                if depth == 0:
                    return token.end()
        return None
    end = _SCALAR.match(text, start).end()  # a number or literal ends at what follows it
    return end if end < len(text) else None


def _string(token: str) -> str | None:
    try:
        value = json.loads(token)
    except ValueError:
        return None
    return value if isinstance(value, str) else None


def _skip_space(text: str, pos: int) -> int:
    return _SPACE.match(text, pos).end()


def _call(name: Any, arguments: Any) -> ToolCall:
    if not isinstance(name, str):
        raise TypeError(name)
    return ToolCall(new_call_id(), name, json.dumps(arguments, ensure_ascii=False))


def tool_format(chat_template: str | None) -> str | None:
    """The tool-call format a chat template teaches its model: "hermes" or None (unknown)."""
    return "hermes" if chat_template and HERMES_OPEN in chat_template else None


def tool_plan(
    body: ChatCompletionRequest, chat_template: str | None
) -> tuple[StructuredOutputsParams | None, ToolParser | None]:
    """The constraint the request's tool_choice puts on the output, and how its output is read.
    Refuses a choice the request cannot have (InvalidRequestError)."""
    tools, choice = body.tools or [], body.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if choice != "none" and not tools:
        raise InvalidRequestError(f"tool_choice={_shown(choice)} needs tools: none were given")
    if choice == "none":
        return None, None
    if body.structured_spec() is not None:
        raise InvalidRequestError(
            f"tool_choice={_shown(choice)} and structured outputs are both set: expected one"
        )
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        named = [t for t in tools if t.function.name == name]
        if not named:
            raise FieldError(
                "tool_choice.function.name",
                f"tool_choice.function.name: the function {name!r} is not among the tools: "
                f"expected one of {[t.function.name for t in tools]}",
            )
        _check_parameters(tools, only=name)
        schema = named[0].function.parameters or NO_PARAMETERS
        return StructuredOutputsParams(json=schema), ToolParser("named", name)
    if choice == "required":
        _check_parameters(tools)
        return StructuredOutputsParams(json=_calls_schema(body)), ToolParser("required")
    if tool_format(chat_template) is None:
        raise InvalidRequestError(
            "tool_choice='auto' needs the model's tool-call format, and this model's chat "
            "template uses none that moelora knows (Hermes <tool_call>): expected "
            "tool_choice 'required', 'none' or a named function"
        )
    return None, ToolParser("auto")


def _check_parameters(tools: list[ToolSpec], *, only: str | None = None) -> None:
    """Refuses a `parameters` schema the output would be constrained to, naming its field."""
    for i, tool in enumerate(tools):
        parameters = tool.function.parameters
        if parameters is not None and only in (None, tool.function.name):
            check_json_schema(f"tools.{i}.function.parameters", parameters)


def _calls_schema(body: ChatCompletionRequest) -> dict[str, Any]:
    """vLLM's schema for tool_choice="required": an array of calls of the given tools."""
    one_of = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t.function.name]},
                "parameters": t.function.parameters or NO_PARAMETERS,
            },
            "required": ["name", "parameters"],
        }
        for t in body.tools
    ]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": one_of}}
    if not body.parallel_tool_calls:
        schema["maxItems"] = 1
    return schema


def tools_for_template(body: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    if not body.tools:
        return None
    return [t.model_dump(exclude_none=True) for t in body.tools]


def _shown(choice: Any) -> str:
    return repr(choice) if isinstance(choice, str) else repr(choice.model_dump())
