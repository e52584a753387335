"""OpenAI's response JSON for the two generation endpoints: whole answers, streamed chunks, their
logprobs, the echoed prompt and the usage.

Field names, and their order, are those of OpenAI's answers. A chunk carries one choice, and
every chunk of an answer has the answer's id, created time and model.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

from moelora.server import protocol
from moelora.server.async_engine import Prompt, RequestStream
from moelora.server.streaming import Delta

if TYPE_CHECKING:
    from moelora.step.request import RequestOutput

Json = dict[str, Any]


class Decoder(Protocol):
    def decode(self, ids: list[int]) -> str: ...


def prompt_tokens(streams: list[RequestStream], n: int) -> int:
    """Prompt tokens once per prompt: its n samples share it, as OpenAI counts."""
    return sum(len(s.prompt_token_ids) for s in streams[::n])


class Answer(ABC):
    """The JSON of one answer, whole or streamed; a subclass says how an output becomes a
    choice and a delta becomes chunks."""

    OBJECT = ""
    CHUNK_OBJECT = ""

    def __init__(self, decoder: Decoder, request_id: str, model: str, prompt_tokens: int):
        self.decoder = decoder
        created = protocol.now()
        self.head = {"id": request_id, "object": self.OBJECT, "created": created, "model": model}
        self.chunk_head = {**self.head, "object": self.CHUNK_OBJECT}
        self.prompt_tokens = prompt_tokens

    def response(self, finals: list[RequestOutput]) -> Json:
        choices = [self.choice(i, out) for i, out in enumerate(finals)]
        return {**self.head, "choices": choices, "usage": self.usage(finals)}

    def usage(self, finals: list[RequestOutput | None]) -> dict[str, int]:
        """Completion tokens of every sample that finished."""
        completion = sum(len(out.token_ids) for out in finals if out is not None)
        return protocol.usage(self.prompt_tokens, completion)

    def usage_chunk(self, finals: list[RequestOutput | None]) -> Json:
        return {**self.chunk_head, "choices": [], "usage": self.usage(finals)}

    def chunk(self, choice: Json) -> Json:
        return {**self.chunk_head, "choices": [choice]}

    def token_text(self, token_id: int) -> str:
        return self.decoder.decode([token_id])

    @abstractmethod
    def choice(self, index: int, out: RequestOutput) -> Json:
        """The choice of a whole answer, from the choice's last output."""

    def opening(self, num_choices: int) -> list[Json]:
        """Chunks sent before any output arrives."""
        return []

    @abstractmethod
    def chunks(self, index: int, out: RequestOutput, delta: Delta) -> Iterator[Json]:
        """The chunks a streamed choice's new output sends (none when it adds nothing)."""


class CompletionAnswer(Answer):
    """/v1/completions. With echo, each choice's text and logprobs start with its prompt's;
    streamed, the prompt is a chunk of its own, before the choice's first generated text."""

    OBJECT = CHUNK_OBJECT = "text_completion"

    def __init__(
        self,
        decoder: Decoder,
        request_id: str,
        model: str,
        prompt_tokens: int,
        echo: list[Prompt] | None,
    ) -> None:
        super().__init__(decoder, request_id, model, prompt_tokens)
        self.echo = echo
        self._echo_length: dict[int, int] = {}  # streamed: the echoed characters of a choice

    def choice(self, index: int, out: RequestOutput) -> Json:
        choice = {
            "index": index,
            "text": out.text,
            "logprobs": self.logprobs(out.token_ids, out.logprobs, 0),
            "finish_reason": out.finish_reason,
        }
        return self.with_echo(choice, out) if self.echo else choice

    def chunks(self, index: int, out: RequestOutput, delta: Delta) -> Iterator[Json]:
        if self.echo is not None and index not in self._echo_length:
            text, logprobs = self.echoed(self.echo[index], out)
            self._echo_length[index] = len(text)
            yield self.chunk(
                {"index": index, "text": text, "logprobs": logprobs, "finish_reason": None}
            )
        if not delta.text and not out.finished and delta.logprobs is None:
            return
        offset = self._echo_length.get(index, 0) + delta.start
        choice = {
            "index": index,
            "text": delta.text,
            "logprobs": self.logprobs(delta.token_ids, delta.logprobs, offset),
            "finish_reason": out.finish_reason if out.finished else None,
        }
        yield self.chunk(choice)

    def logprobs(
        self, token_ids: list[int], logprobs: list[dict[int, float]] | None, offset: int
    ) -> Json | None:
        """`offset`: the characters of the choice's text before the first of these tokens."""
        if logprobs is None:
            return None
        tokens = [self.token_text(t) for t in token_ids]
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.get(t) for t, lp in zip(token_ids, logprobs)],
            "top_logprobs": [{self.token_text(k): v for k, v in lp.items()} for lp in logprobs],
            "text_offset": offsets,
        }

    def echoed(self, prompt: Prompt, out: RequestOutput) -> tuple[str, Json | None]:
        """The prompt's text (as sent, or decoded from its ids) and, with logprobs, its tokens'
        entries (the first token has none, as in OpenAI's and vLLM's answers)."""
        text = prompt if isinstance(prompt, str) else self.decoder.decode(prompt)
        if out.prompt_logprobs is None:
            return text, None
        ids = out.prompt_token_ids
        first = self.token_text(ids[0])
        rest = self.logprobs(ids[1:], out.prompt_logprobs[1:], len(first))
        return text, {
            "tokens": [first, *rest["tokens"]],
            "token_logprobs": [None, *rest["token_logprobs"]],
            "top_logprobs": [None, *rest["top_logprobs"]],
            "text_offset": [0, *rest["text_offset"]],
        }

    def with_echo(self, choice: Json, out: RequestOutput) -> Json:
        """The choice with the echoed prompt in front of its text and logprobs."""
        text, logprobs = self.echoed(self.echo[choice["index"]], out)
        choice = {**choice, "text": text + choice["text"]}
        if logprobs is not None and choice["logprobs"] is not None:
            gen = choice["logprobs"]
            shift = [o + len(text) for o in gen["text_offset"]]
            choice["logprobs"] = {k: logprobs[k] + gen[k] for k in logprobs if k != "text_offset"}
            choice["logprobs"]["text_offset"] = logprobs["text_offset"] + shift
        return choice


class ChatAnswer(Answer):
    """/v1/chat/completions. Streamed, each choice opens with a chunk that names its role."""

    OBJECT, CHUNK_OBJECT = "chat.completion", "chat.completion.chunk"

    def __init__(
        self, decoder: Decoder, request_id: str, model: str, prompt_tokens: int, top: int
    ) -> None:
        super().__init__(decoder, request_id, model, prompt_tokens)
        self.top = top  # top_logprobs: alternatives listed per token

    def choice(self, index: int, out: RequestOutput) -> Json:
        return {
            "index": index,
            "message": {"role": "assistant", "content": out.text},
            "logprobs": self.logprobs(out.token_ids, out.logprobs),
            "finish_reason": out.finish_reason,
        }

    def opening(self, num_choices: int) -> list[Json]:
        return [
            self.delta_chunk(i, {"role": "assistant", "content": ""}) for i in range(num_choices)
        ]

    def chunks(self, index: int, out: RequestOutput, delta: Delta) -> Iterator[Json]:
        logprobs = self.logprobs(delta.token_ids, delta.logprobs)
        if out.finished:
            content = {"content": delta.text} if delta.text else {}
            yield self.delta_chunk(index, content, out.finish_reason, logprobs)
        elif delta.text or logprobs:
            yield self.delta_chunk(index, {"content": delta.text}, None, logprobs)

    def delta_chunk(
        self, index: int, delta: Json, finish_reason: str | None = None, logprobs: Any = None
    ) -> Json:
        choice = {
            "index": index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
        return self.chunk(choice)

    def logprobs(
        self, token_ids: list[int], logprobs: list[dict[int, float]] | None
    ) -> Json | None:
        if logprobs is None:
            return None
        content = []
        for t, lp in zip(token_ids, logprobs):
            best = sorted(lp.items(), key=lambda kv: -kv[1])[: self.top]
            content.append(
                {**self.entry(t, lp[t]), "top_logprobs": [self.entry(*kv) for kv in best]}
            )
        return {"content": content}

    def entry(self, token_id: int, logprob: float) -> Json:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
