"""OpenAI's response JSON for the two generation endpoints: whole answers, streamed chunks, their
logprobs, the echoed prompt and the usage.

Field names, and their order, are those of OpenAI's answers. A chunk carries one choice, and
every chunk of an answer has the answer's id, created time and model.

Logprobs on text where a token holds only part of a character (byte-level BPE and byte-fallback
vocabularies split CJK, accents and emoji into bytes):
- chat: `bytes` are the bytes the token adds to the content, so joined they are the content's
  UTF-8; `token` is the token decoded alone, as vLLM sends it ("\ufffd" for part of a character).
- completions: a token, and a `top_logprobs` key, is the text the token adds, or where that is
  not whole characters "bytes:" and its bytes as \\xNN escapes, as OpenAI's legacy completions
  write them (so alternatives that are different bytes stay different keys).
- `text_offset[i]` is the character offset in the choice's text (the echoed prompt first, then
  the completion; streamed, counted on across chunks) where token i's text starts: the
  characters that the tokens before it complete. A token that continues a character started
  by the tokens before it starts where that character starts, so offsets never decrease and
  never pass the end of a text that stops inside a character. Bytes that turn out invalid
  (U+FFFD in the text) count once a token ends on a whole character: a token right after
  them may point at them. Tokens of a stop string cut from the text point at or past its end.
"""

from __future__ import annotations

import codecs
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

from moelora.server import protocol
from moelora.server.async_engine import Prompt, RequestStream
from moelora.server.streaming import Delta
from moelora.server.tool_calls import CallStream, ToolCall, ToolParser, new_call_id

if TYPE_CHECKING:
    from moelora.step.request import RequestOutput

Json = dict[str, Any]


class Decoder(Protocol):
    """What the answers need of the tokenizer (moelora.tokenizer.Tokenizer)."""

    def decode(self, ids: list[int]) -> str: ...

    def token_bytes(self, token_id: int) -> bytes: ...

    def leading_bytes(self, token_id: int) -> bytes: ...


class TextCursor:
    """Walks one decoded text's tokens in order: the bytes each adds and the character offset
    where it starts. A whole answer walks a fresh cursor; a streamed choice keeps its own from
    chunk to chunk, since a character may be split between two chunks' tokens."""

    def __init__(self, decoder: Decoder, start: int = 0) -> None:
        self.decoder = decoder
        self.decoded = start  # characters decoded so far, from the start of the choice's text
        self.offset = start  # `decoded` where the bytes so far last ended on a whole character
        self._leading = True  # until a token adds bytes, the decoder may drop a leading space
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def piece(self, token_id: int) -> bytes:
        """What the token adds at this point (asked for the alternatives too)."""
        if self._leading:
            return self.decoder.leading_bytes(token_id)
        return self.decoder.token_bytes(token_id)

    def advance(self, token_id: int) -> int:
        """The chosen token's offset; the cursor moves past it. Offsets move only where the
        bytes end on a whole character, as the detokenizer (Tokenizer.decode_incremental) lets
        text out only there: no offset passes the end of the text decoded so far."""
        offset = self.offset
        self.decoded += len(self._utf8.decode(self.piece(token_id)))
        if not self._utf8.getstate()[0]:  # nothing held for the next token
            self.offset = self.decoded
        self._leading = self._leading and not self.decoder.token_bytes(token_id)
        return offset


def token_string(piece: bytes) -> str:
    """A completions token: its text, or "bytes:\\xe6\\x97" where it is not whole characters."""
    try:
        return piece.decode()
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in piece)


def prompt_tokens(streams: list[RequestStream], n: int) -> int:
    """Prompt tokens once per prompt: its n samples share it, as OpenAI counts."""
    return sum(len(s.prompt_token_ids) for s in streams[::n])


class Answer(ABC):
    """The JSON of one answer, whole or streamed; a subclass says how an output becomes a
    choice and a delta becomes chunks."""

    OBJECT = ""
    CHUNK_OBJECT = ""

    def __init__(
        self, decoder: Decoder, request_id: str, model: str, prompt_tokens: int, *, n: int = 1
    ):
        self.decoder = decoder
        self.n = n  # samples per prompt: finals come n by n, prompt by prompt
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
        # once per prompt, like prompt_tokens: its first sample's (the others share its pages)
        cached = sum(out.num_cached_tokens for out in finals[:: self.n] if out is not None)
        return protocol.usage(self.prompt_tokens, completion, cached)

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
        *,
        n: int = 1,
    ) -> None:
        super().__init__(decoder, request_id, model, prompt_tokens, n=n)
        self.echo = echo
        self._cursors: dict[int, TextCursor] = {}  # streamed: each choice's, after its echo

    def choice(self, index: int, out: RequestOutput) -> Json:
        echoed, echoed_logprobs = self.echoed(self.echo[index], out) if self.echo else ("", None)
        cursor = TextCursor(self.decoder, start=len(echoed))
        logprobs = self.logprobs(out.token_ids, out.logprobs, cursor)
        if echoed_logprobs is not None and logprobs is not None:
            logprobs = {k: echoed_logprobs[k] + logprobs[k] for k in logprobs}
        return {
            "index": index,
            "text": echoed + out.text,
            "logprobs": logprobs,
            "finish_reason": out.finish_reason,
        }

    def chunks(self, index: int, out: RequestOutput, delta: Delta) -> Iterator[Json]:
        if index not in self._cursors:
            echoed = ""
            if self.echo is not None:
                echoed, logprobs = self.echoed(self.echo[index], out)
                yield self.chunk(
                    {"index": index, "text": echoed, "logprobs": logprobs, "finish_reason": None}
                )
            self._cursors[index] = TextCursor(self.decoder, start=len(echoed))
        if not delta.text and not out.finished and delta.logprobs is None:
            return
        choice = {
            "index": index,
            "text": delta.text,
            "logprobs": self.logprobs(delta.token_ids, delta.logprobs, self._cursors[index]),
            "finish_reason": out.finish_reason if out.finished else None,
        }
        yield self.chunk(choice)

    def logprobs(
        self, token_ids: list[int], logprobs: list[dict[int, float]] | None, cursor: TextCursor
    ) -> Json | None:
        """The entries of consecutive tokens; `cursor` stands just before the first of them."""
        if logprobs is None:
            return None
        tokens, top, offsets = [], [], []
        for t, lp in zip(token_ids, logprobs):
            tokens.append(token_string(cursor.piece(t)))
            top.append({token_string(cursor.piece(k)): v for k, v in lp.items()})
            offsets.append(cursor.advance(t))
        return {
            "tokens": tokens,
            "token_logprobs": [lp.get(t) for t, lp in zip(token_ids, logprobs)],
            "top_logprobs": top,
            "text_offset": offsets,
        }

    def echoed(self, prompt: Prompt, out: RequestOutput) -> tuple[str, Json | None]:
        """The prompt's text (as sent, or decoded from its ids) and, with logprobs, its tokens'
        entries (the first token has none, as in OpenAI's and vLLM's answers).

        Offsets stop at the text's end: a prompt as sent can be longer than what its tokens
        spell (a normalizer such as NFC), and the completion's offsets start at that end."""
        text = prompt if isinstance(prompt, str) else self.decoder.decode(prompt)
        if out.prompt_logprobs is None:
            return text, None
        ids, cursor = out.prompt_token_ids, TextCursor(self.decoder)
        first = token_string(cursor.piece(ids[0]))
        offsets = [cursor.advance(ids[0])]
        rest = self.logprobs(ids[1:], out.prompt_logprobs[1:], cursor)
        offsets += rest["text_offset"]
        return text, {
            "tokens": [first, *rest["tokens"]],
            "token_logprobs": [None, *rest["token_logprobs"]],
            "top_logprobs": [None, *rest["top_logprobs"]],
            "text_offset": [min(o, len(text)) for o in offsets],
        }


class ChatAnswer(Answer):
    """/v1/chat/completions. Streamed, each choice opens with a chunk that names its role.

    With tools (a ToolParser), a choice whose text holds calls answers them as `tool_calls`,
    with finish_reason "tool_calls". Streamed, only text that cannot be part of a call streams
    as content, before any call; each call then streams as OpenAI streams it (tool_calls.py),
    as far as the text deltas have let text out. A choice that ends without calls that parse
    (cut by max_tokens) keeps what it has sent, and its finish_reason says why it ended: no
    brace is added to close a call. Its whole answer holds the same: the calls it began, each
    as far as written, and the finish_reason of its end."""

    OBJECT, CHUNK_OBJECT = "chat.completion", "chat.completion.chunk"

    def __init__(
        self,
        decoder: Decoder,
        request_id: str,
        model: str,
        prompt_tokens: int,
        top: int,
        tools: ToolParser | None = None,
        *,
        n: int = 1,
    ) -> None:
        super().__init__(decoder, request_id, model, prompt_tokens, n=n)
        self.top = top  # top_logprobs: alternatives listed per token
        self.tools = tools
        self._cursors: dict[int, TextCursor] = {}  # streamed: each choice's
        self._sent: dict[int, int] = {}  # streamed with tools: characters sent as content
        self._calls: dict[int, CallStream] = {}  # streamed with tools: what went out of calls

    def choice(self, index: int, out: RequestOutput) -> Json:
        message: Json = {"role": "assistant", "content": out.text}
        finish_reason = out.finish_reason
        content, calls = self.tool_calls(out)
        if calls:
            finish_reason = "tool_calls"
        else:
            content, calls = self.cut_calls(out)
        if calls:
            message = {"role": "assistant", "content": content, "tool_calls": calls}
        return {
            "index": index,
            "message": message,
            "logprobs": self.logprobs(out.token_ids, out.logprobs, TextCursor(self.decoder)),
            "finish_reason": finish_reason,
        }

    def tool_calls(self, out: RequestOutput) -> tuple[str | None, list]:
        """(content, calls as JSON) of a finished choice; no calls without tools, or when the
        choice did not stop (a call cut by max_tokens is not a call)."""
        if self.tools is None or out.finish_reason != "stop":
            return out.text, []
        content, calls = self.tools.parse(out.text)
        return content, [c.json() for c in calls]

    def cut_calls(self, out: RequestOutput) -> tuple[str | None, list]:
        """(content, calls as JSON) of a finished choice whose calls do not parse: the calls it
        began, each as far as written (what its stream sent), or its text alone if none."""
        partial = self.tools.partial_calls(out.text) if self.tools is not None else []
        if not partial:
            return out.text, []
        content = out.text[: self.tools.streamed_text_end(out.text)].strip() or None
        return content, [ToolCall(new_call_id(), c.name, c.arguments).json() for c in partial]

    def opening(self, num_choices: int) -> list[Json]:
        return [
            self.delta_chunk(i, {"role": "assistant", "content": ""}) for i in range(num_choices)
        ]

    def chunks(self, index: int, out: RequestOutput, delta: Delta) -> Iterator[Json]:
        if index not in self._cursors:
            self._cursors[index] = TextCursor(self.decoder)
        logprobs = self.logprobs(delta.token_ids, delta.logprobs, self._cursors[index])
        if self.tools is not None:
            yield from self._tool_chunks(index, out, delta, logprobs)
        elif out.finished:
            content = {"content": delta.text} if delta.text else {}
            yield self.delta_chunk(index, content, out.finish_reason, logprobs)
        elif delta.text or logprobs:
            yield self.delta_chunk(index, {"content": delta.text}, None, logprobs)

    def _tool_chunks(
        self, index: int, out: RequestOutput, delta: Delta, logprobs: Json | None
    ) -> Iterator[Json]:
        """The output's content, then its call entries, one a chunk; the output's logprobs go
        with its first chunk (an empty one if it sends nothing else), its finish with its last."""
        released = delta.start + len(delta.text)  # what the text deltas have let out
        sent = self._sent.get(index, 0)
        pieces: list[Json] = []
        end = min(released, self.tools.streamed_text_end(out.text))
        if end > sent:
            pieces.append({"content": out.text[sent:end]})
            self._sent[index] = sent = end
        calls = self._calls.setdefault(index, CallStream())
        entries = calls.advance(self.tools.partial_calls(out.text[:released]))
        pieces += [{"tool_calls": [entry]} for entry in entries]
        finish = None
        if out.finished:
            parsed = self.tool_calls(out)[1]
            if not parsed and not calls.ids and len(out.text) > sent:  # no call: all content
                pieces.append({"content": out.text[sent:]})
            finish = "tool_calls" if parsed else out.finish_reason
        if not pieces and (finish or logprobs):
            pieces.append({})
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            yield self.delta_chunk(index, piece, finish if last else None, None if i else logprobs)

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
        self, token_ids: list[int], logprobs: list[dict[int, float]] | None, cursor: TextCursor
    ) -> Json | None:
        """The entries of consecutive tokens; `cursor` stands just before the first of them."""
        if logprobs is None:
            return None
        content = []
        for t, lp in zip(token_ids, logprobs):
            best = sorted(lp.items(), key=lambda kv: -kv[1])[: self.top]
            top = [self.entry(k, v, cursor) for k, v in best]
            content.append({**self.entry(t, lp[t], cursor), "top_logprobs": top})
            cursor.advance(t)
        return {"content": content}

    def entry(self, token_id: int, logprob: float, cursor: TextCursor) -> Json:
        piece = list(cursor.piece(token_id))
        return {"token": self.token_text(token_id), "logprob": logprob, "bytes": piece}
