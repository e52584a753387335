"""The OpenAI wire format: request bodies the server accepts and the JSON it answers with.

Request fields are strict: a value of another JSON type is refused, never converted ("16" is not
16, true is not 1, 4.0 is not 4), except that an integer is a number where a float is expected,
as OpenAI's API allows. Every limit the server enforces on one field is that field's constraint,
so /openapi.json states it. Only the parameters moelora implements are fields; unknown fields are
ignored (as OpenAI's own server does), and known-but-unsupported ones are refused with a 400
when set to a non-default.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
import uuid
from typing import Annotated, Any, Literal

import xgrammar as xgr
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    WithJsonSchema,
)

from moelora.errors import InvalidRequestError
from moelora.sampling_params import SamplingParams, StructuredOutputsParams

MAX_N = 128  # samples per prompt: each is a request of its own (no shared prefix yet)
MAX_LOGPROBS = 20  # OpenAI's and vLLM's limit; more would only cost the engine time
MAX_LOGIT_BIAS = 100  # OpenAI's range, [-100, 100]
STRICT = ConfigDict(strict=True, allow_inf_nan=False)


class FieldError(InvalidRequestError):
    """A 400 about one field of the request body, named in the error's `param`."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class OpenAIBody(BaseModel):
    model_config = ConfigDict(extra="ignore", **STRICT)


# ----------------------------------------------------------------------------- unions
# A union picks its member by the JSON value's shape, so an error comes from that member alone
# (pydantic would report one error per member). Pydantic puts the member's tag in the error's
# location; field_path drops the tags, so that `param` is the field's path in the body.
STRING, STRINGS, TOKEN_IDS, TOKEN_ID_LISTS, PARTS = (
    "<string>",
    "<strings>",
    "<token ids>",
    "<token id lists>",
    "<parts>",
)
UNION_TAGS = frozenset({STRING, STRINGS, TOKEN_IDS, TOKEN_ID_LISTS, PARTS, "<function>"})
KEY_TAG = "[key]"  # where pydantic says that a dict's key, not its value, is wrong


def field_path(loc: tuple[str | int, ...]) -> str | None:
    """`('messages', 0, 'content', '<parts>', 0, 'text')` -> `'messages.0.content.0.text'`."""
    parts = [str(p) for p in loc if p not in UNION_TAGS and p != KEY_TAG]
    return ".".join(parts) or None


def _string_or_list(value: Any) -> str | None:
    if isinstance(value, str):
        return STRING
    return STRINGS if isinstance(value, list) else None


def _content_shape(value: Any) -> str | None:
    if isinstance(value, str):
        return STRING
    return PARTS if isinstance(value, list) else None


def _prompt_shape(value: Any) -> str | None:
    """Told by the first item: a list of ints, an empty list or a list of wrong items goes to the
    token ids, whose errors say what is wrong."""
    if isinstance(value, str):
        return STRING
    if not isinstance(value, list):
        return None
    first = value[0] if value else None
    if isinstance(first, str):
        return STRINGS
    return TOKEN_ID_LISTS if isinstance(first, list) else TOKEN_IDS


def _whole_number(value: Any) -> Any:
    """4.0 is the integer 4: JSON has one kind of number (JavaScript writes 4.0 as 4, and JSON
    Schema's "integer" is any number without a fraction). 4.5, "4" and true stay refused."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# The integer fields, bounds included. The validator comes last, so that the bounds stay in the
# JSON schema (pydantic drops a bound it cannot see through a validator).
_WHOLE = BeforeValidator(_whole_number)
Count = Annotated[int, Field(ge=1), _WHOLE]
NumSamples = Annotated[int, Field(ge=1, le=MAX_N), _WHOLE]
NumLogprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS), _WHOLE]
TopK = Annotated[int, Field(ge=-1), _WHOLE]
Seed = Annotated[int, Field(ge=-(2**63), lt=2**64), _WHOLE]  # what torch generators take
BestOf = Annotated[int, Field(ge=1, le=1), _WHOLE]
TokenId = Annotated[int, Field(ge=0), _WHOLE]
NonEmptyText = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]

Prompt = Annotated[
    Annotated[NonEmptyText, Tag(STRING)]
    | Annotated[list[NonEmptyText], Field(min_length=1), Tag(STRINGS)]
    | Annotated[TokenIds, Tag(TOKEN_IDS)]
    | Annotated[list[TokenIds], Field(min_length=1), Tag(TOKEN_ID_LISTS)],
    Discriminator(
        _prompt_shape,
        custom_error_type="invalid_type",
        custom_error_message="expected a non-empty string, a list of them, a list of token ids "
        "or a list of lists of token ids",
    ),
]
# "" and [] mean no stop string, as they always have here; a stop string in a list is not empty
Stop = Annotated[
    Annotated[str, Tag(STRING)] | Annotated[list[NonEmptyText], Tag(STRINGS)],
    Discriminator(
        _string_or_list,
        custom_error_type="invalid_type",
        custom_error_message="expected a string or a list of non-empty strings",
    ),
]
# OpenAI sends token ids as JSON object keys, so as strings: decimal digits only
LogitBias = Annotated[
    dict[
        Annotated[str, Field(pattern=r"^[0-9]+$")],
        Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)],
    ],
    WithJsonSchema(
        {
            "type": "object",
            "propertyNames": {"pattern": "^[0-9]+$"},
            "additionalProperties": {
                "type": "number",
                "minimum": -MAX_LOGIT_BIAS,
                "maximum": MAX_LOGIT_BIAS,
            },
        }
    ),
]
Penalty = Annotated[float, Field(ge=-2, le=2)]


# ----------------------------------------------------------------------------- requests


class StreamOptions(OpenAIBody):
    include_usage: bool = False


class JsonSchemaFormat(OpenAIBody):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextFormat(OpenAIBody):
    type: Literal["text"]


class JsonObjectFormat(OpenAIBody):
    type: Literal["json_object"]


class JsonSchemaResponseFormat(OpenAIBody):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormat = Annotated[
    TextFormat | JsonObjectFormat | JsonSchemaResponseFormat, Field(discriminator="type")
]


class StructuredOutputsField(OpenAIBody):
    """vLLM's `structured_outputs`: exactly one of its fields."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(default=None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None


# xgrammar prefixes its errors with a time and its C++ source line: the client needs neither
_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def check_json_schema(param: str, schema: dict[str, Any] | str) -> None:
    """Refuses (FieldError) a schema the output cannot be constrained to, naming the field that
    sent it: here, before the engine compiles it, whose error could only name its own field.
    Converting a schema to a grammar needs no tokenizer and costs little next to compiling."""
    text = schema if isinstance(schema, str) else json.dumps(schema)
    try:
        xgr.Grammar.from_json_schema(text, any_whitespace=False)
    except (RuntimeError, ValueError, TypeError) as e:
        reason = _XGRAMMAR_PREFIX.sub("", str(e).strip()).splitlines()[0][:300]
        raise FieldError(param, f"{param} is not a valid JSON schema: {reason}") from None


class SamplingFields(OpenAIBody):
    """The sampling parameters both generation endpoints share (vLLM's extensions included)."""

    model: str
    n: NumSamples = 1
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: TopK | None = Field(default=None, description="-1 or 0: every token")
    seed: Seed | None = None
    stop: Stop | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: float | None = Field(default=None, gt=0)  # vLLM's extension
    logit_bias: LogitBias | None = None
    user: str | None = None
    cache_salt: str | None = Field(
        default=None, description="vLLM's: a prefix-cache namespace of its own (a tenant's)"
    )
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    # vLLM's older names of structured_outputs' fields
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(default=None, min_length=1)
    guided_grammar: str | None = None

    def structured_spec(self) -> StructuredOutputsParams | None:
        """The one constraint the request asks for, from whichever field it is in; None for
        none. More than one is an InvalidRequestError naming them."""
        specs, schemas = {}, {}
        fmt = self.response_format
        if isinstance(fmt, JsonObjectFormat):
            specs["response_format"] = {"json_object": True}
        elif isinstance(fmt, JsonSchemaResponseFormat):
            schema = fmt.json_schema.schema_
            if schema:
                schemas["response_format.json_schema.schema"] = schema
            specs["response_format"] = {"json": schema} if schema else {"json_object": True}
        if self.structured_outputs is not None:
            given = self.structured_outputs.model_dump(exclude_none=True)
            specs["structured_outputs"] = {k.rstrip("_"): v for k, v in given.items()}
            if "json" in given:
                schemas["structured_outputs.json"] = given["json"]
        for name in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{name}")
            if value is not None:
                specs[f"guided_{name}"] = {name: value}
        if self.guided_json is not None:
            schemas["guided_json"] = self.guided_json
        if len(specs) > 1:
            raise InvalidRequestError(
                f"structured outputs are asked for by {sorted(specs)}: expected at most one of "
                "response_format, structured_outputs and the guided_* fields"
            )
        for param, schema in schemas.items():
            check_json_schema(param, schema)
        return StructuredOutputsParams(**next(iter(specs.values()))) if specs else None

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """Raises InvalidRequestError (HTTP 400) for values out of range."""
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k in (None, 0) else self.top_k,
            seed=self.seed,
            stop=self.stop or None,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=self._token_biases(),
            cache_salt=self.cache_salt,
            structured_outputs=self.structured_spec(),
        )

    def _token_biases(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        return {int(key): bias for key, bias in self.logit_bias.items()}

    def samples(self, params: SamplingParams) -> list[SamplingParams]:
        """The n samples of one prompt. With a seed, sample j is seeded seed + j, so the n
        samples differ from each other and the request repeats (vLLM draws them from one
        generator; its exact tokens are not ours anyway)."""
        if params.seed is None:
            return [params] * self.n
        seed = params.seed
        return [
            dataclasses.replace(params, seed=seed + j if seed + j < 2**64 else seed - j)
            for j in range(self.n)
        ]

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingFields):
    prompt: Prompt
    max_tokens: Count | None = Field(
        default=16, description="null: whatever room max_model_len leaves"
    )
    logprobs: NumLogprobs | None = None
    echo: bool = False
    suffix: str | None = Field(default=None, max_length=0, description="not supported")
    best_of: BestOf | None = None

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids."""
        p = self.prompt
        if isinstance(p, str) or isinstance(p[0], int):
            return [p]
        return list(p)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore", **STRICT)

    type: Literal["text"]
    text: str


Content = Annotated[
    Annotated[str, Tag(STRING)] | Annotated[list[ContentPart], Tag(PARTS)],
    Discriminator(
        _content_shape,
        custom_error_type="invalid_type",
        custom_error_message="expected a string or a list of content parts",
    ),
]


# OpenAI's chat roles; the template decides what each one means
Role = Literal["system", "developer", "user", "assistant", "tool", "function"]


class ChatMessage(BaseModel):
    """Fields beyond role and content (name, tool_calls, ...) go to the chat template as sent."""

    model_config = ConfigDict(extra="allow", **STRICT)

    role: Role
    content: Content | None = None

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates expect it: content as one string."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {**(self.model_extra or {}), "role": self.role, "content": content or ""}


# top_logprobs > 0 needs logprobs: true (OpenAI's rule), as JSON Schema says it
_TOP_LOGPROBS_NEED_LOGPROBS = {
    "if": {
        "properties": {"top_logprobs": {"type": "integer", "minimum": 1}},
        "required": ["top_logprobs"],
    },
    "then": {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]},
}


class FunctionSpec(OpenAIBody):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolSpec(OpenAIBody):
    type: Literal["function"]
    function: FunctionSpec


class FunctionName(OpenAIBody):
    name: str


class NamedToolChoice(OpenAIBody):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Annotated[
    Annotated[Literal["none", "auto", "required"], Tag(STRING)]
    | Annotated[NamedToolChoice, Tag("<function>")],
    Discriminator(
        lambda v: STRING if isinstance(v, str) else "<function>",
        custom_error_type="invalid_type",
        custom_error_message='expected "none", "auto", "required" or a named function',
    ),
]


class ChatCompletionRequest(SamplingFields):
    model_config = ConfigDict(json_schema_extra=_TOP_LOGPROBS_NEED_LOGPROBS)

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = Field(
        default=None, description="wins over max_tokens; neither: the room left"
    )
    logprobs: bool = False
    top_logprobs: NumLogprobs | None = Field(default=None, description="needs logprobs: true")
    tools: list[ToolSpec] | None = None
    tool_choice: ToolChoice | None = Field(default=None, description="default: auto with tools")
    parallel_tool_calls: bool = True

    @property
    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:
                raise FieldError("top_logprobs", "top_logprobs needs logprobs: true")
            return None
        return self.top_logprobs or 0


class LoadLoraRequest(OpenAIBody):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(pattern=r"^[^\x00]+$", description="a folder: no NUL character")
    replace: bool = Field(
        False,
        description="swap the weights of an adapter served under lora_name: requests sent "
        "after this one use the new weights, those running finish on the old",
    )


class UnloadLoraRequest(OpenAIBody):
    lora_name: str = Field(min_length=1)


# ----------------------------------------------------------------------------- responses


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def error_body(message: str, type_: str, *, param: str | None = None, code: Any = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def model_card(name: str, *, parent: str | None, root: str) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": now(),
        "owned_by": "moelora",
        "root": root,
        "parent": parent,
    }
