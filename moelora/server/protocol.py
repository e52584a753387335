"""The OpenAI wire format: request bodies the server accepts and the JSON it answers with.

Only the parameters moelora implements are fields; unknown fields are ignored (as OpenAI's own
server does), and known-but-unsupported ones are refused with a 400 when set to a non-default.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from moelora.errors import InvalidRequestError
from moelora.sampling_params import SamplingParams

MAX_N = 128  # samples per prompt: each is a request of its own (no shared prefix yet)


class OpenAIBody(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(OpenAIBody):
    include_usage: bool = False


class SamplingFields(OpenAIBody):
    """The sampling parameters both generation endpoints share (vLLM's extensions included)."""

    model: str
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)  # what torch seeds take
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's extension
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    def check_supported(self) -> None:
        if not 1 <= self.n <= MAX_N:
            raise InvalidRequestError(
                f"n={self.n!r} is invalid: expected an integer in [1, {MAX_N}]"
            )

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """Raises InvalidRequestError (HTTP 400) for values out of range."""
        self.check_supported()
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
        )

    def _token_biases(self) -> dict[int, float] | None:
        """OpenAI sends token ids as JSON object keys, so as strings."""
        if not self.logit_bias:
            return None
        biases = {}
        for key, bias in self.logit_bias.items():
            try:
                biases[int(key)] = bias
            except ValueError:
                raise InvalidRequestError(
                    f"logit_bias key {key!r} is invalid: expected a token id"
                ) from None
        return biases

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


MAX_LOGPROBS = 20  # OpenAI's and vLLM's limit; more would only cost the engine time


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and all(isinstance(t, int) for t in p)):
            return [p]
        if not p:
            raise InvalidRequestError("prompt is empty")
        return list(p)

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise InvalidRequestError("suffix is not supported")
        if self.best_of not in (None, 1):
            raise InvalidRequestError(f"best_of={self.best_of!r} is not supported: expected 1")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates expect it: content as one string."""
        content = self.content
        if isinstance(content, list):
            parts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise InvalidRequestError(
                        f"message content part of type {part.get('type')!r} is not supported: "
                        "expected 'text'"
                    )
                parts.append(part["text"])
            content = "".join(parts)
        return {**(self.model_extra or {}), "role": self.role, "content": content or ""}


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @property
    def requested_max_tokens(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else (self.max_tokens)
        )

    @property
    def num_logprobs(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:
                raise InvalidRequestError("top_logprobs needs logprobs=true")
            return None
        return self.top_logprobs or 0


class LoadLoraRequest(OpenAIBody):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoraRequest(OpenAIBody):
    lora_name: str = Field(min_length=1)


# ----------------------------------------------------------------------------- responses


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
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
