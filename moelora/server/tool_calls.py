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
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from moelora.errors import InvalidRequestError
from moelora.sampling_params import StructuredOutputsParams
from moelora.server.protocol import ChatCompletionRequest, NamedToolChoice

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
# a function without `parameters` takes none: its arguments are {} (a bare {"type": "object"}
# would let a model write any object, as long as it likes)
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def json(self, index: int | None = None) -> dict[str, Any]:
        call = {"id": self.id, "type": "function"}
        call["function"] = {"name": self.name, "arguments": self.arguments}
        return call if index is None else {"index": index, **call}


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
            raise InvalidRequestError(
                f"tool_choice names the function {name!r}: expected one of the tools "
                f"{[t.function.name for t in tools]}"
            )
        schema = named[0].function.parameters or NO_PARAMETERS
        return StructuredOutputsParams(json=schema), ToolParser("named", name)
    if choice == "required":
        return StructuredOutputsParams(json=_calls_schema(body)), ToolParser("required")
    if tool_format(chat_template) is None:
        raise InvalidRequestError(
            "tool_choice='auto' needs the model's tool-call format, and this model's chat "
            "template uses none that moelora knows (Hermes <tool_call>): expected "
            "tool_choice 'required', 'none' or a named function"
        )
    return None, ToolParser("auto")


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
