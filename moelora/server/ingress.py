"""The server's door: what a request must be before it costs anything.

- Its body is JSON. A body without a Content-Type is read as JSON, as vLLM's server reads it
  (`requests.post(data=...)`), and so is one typed application/x-www-form-urlencoded, which is
  only what `curl -d` says when it is not told -H 'Content-Type: application/json' (no OpenAI
  client sends a form). Any other type is refused with 415 naming the header.
- Its body holds at most `max_request_bytes`, counted as it arrives (a chunked body has no
  Content-Length): 413, before the app has seen a byte of it.
- Its text prompt has at most `prompt_char_limit` characters: a bound derived from the
  tokenizer's vocabulary, past which the prompt cannot fit max_model_len tokens, checked before
  the prompt is tokenized (AsyncEngine does, off the engine thread).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers

from moelora.server import protocol

# 8 MiB: a max_model_len prompt of 128k tokens is under 1 MiB in any JSON form (text, \u escapes
# or token ids), so a batch of several of them fits, while one request cannot make the server
# buffer more than this.
DEFAULT_MAX_REQUEST_BYTES = 8 * 2**20
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
JSON_CONTENT_TYPE = (b"content-type", b"application/json")
CURL_DEFAULT_TYPE = "application/x-www-form-urlencoded"

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class BodyTooLarge(Exception):
    """More than max_request_bytes of body have arrived."""


class RequestIngress:
    """ASGI middleware: Content-Type and body size, before the app reads the body.

    The body is read whole here and handed to the app as one message; every later receive()
    goes to the client's (so the app still hears a disconnect while it streams).
    """

    def __init__(self, app: Any, *, max_request_bytes: int) -> None:
        assert max_request_bytes >= 1, max_request_bytes
        self.app, self.max_request_bytes = app, max_request_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in BODY_METHODS:
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        refusal = content_type_refusal(headers.get("content-type"))
        if refusal is None:
            refusal = self._declared_size_refusal(headers.get("content-length", ""))
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        try:
            body = await self._read_body(receive)
        except BodyTooLarge:  # the rest is not read: the 413 closes the connection
            too_large = self._too_large(f"more than {self.max_request_bytes} bytes arrived")
            await too_large(scope, receive, send)
            return
        if body is not None:  # else the client left before its body was whole
            await self.app(with_json_type(scope), replay(body, receive), send)

    async def _read_body(self, receive: Receive) -> bytes | None:
        """The whole body, or None when the client disconnected; BodyTooLarge as soon as more
        than max_request_bytes have arrived."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_request_bytes:
                raise BodyTooLarge
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _declared_size_refusal(self, content_length: str) -> JSONResponse | None:
        """A body announced larger than the limit is refused before any of it is read."""
        if not content_length.isdigit() or int(content_length) <= self.max_request_bytes:
            return None  # none (chunked) or malformed (uvicorn refuses those): counted instead
        return self._too_large(f"Content-Length is {int(content_length)}")

    def _too_large(self, why: str) -> JSONResponse:
        message = (
            f"the request body is too large ({why}): expected at most {self.max_request_bytes} "
            "bytes (the server's --max-request-bytes)"
        )
        body = protocol.error_body(message, "RequestTooLargeError", code="request_too_large")
        return JSONResponse(body, status_code=413, headers={"Connection": "close"})


def content_type_refusal(content_type: str | None) -> JSONResponse | None:
    """None for JSON (application/json, application/*+json, any parameters) or no type."""
    if read_as_json(content_type) or is_json(content_type or ""):
        return None
    message = (
        f"Content-Type {content_type!r} is not supported: expected 'application/json' "
        "(curl: add -H 'Content-Type: application/json')"
    )
    body = protocol.error_body(
        message, "UnsupportedMediaTypeError", param="Content-Type", code="unsupported_media_type"
    )
    return JSONResponse(body, status_code=415)


def media_type(content_type: str) -> str:
    return content_type.split(";", 1)[0].strip().lower()


def is_json(content_type: str) -> bool:
    kind, _, subtype = media_type(content_type).partition("/")
    return kind == "application" and (subtype == "json" or subtype.endswith("+json"))


def read_as_json(content_type: str | None) -> bool:
    """No type, an empty one, or curl -d's default: the body is read as JSON all the same."""
    return not content_type or media_type(content_type) in ("", CURL_DEFAULT_TYPE)


def with_json_type(scope: Scope) -> Scope:
    """The scope typed `application/json` where read_as_json says so: FastAPI reads only a
    JSON-typed body as JSON."""
    types = [value.decode("latin-1") for name, value in scope["headers"] if name == b"content-type"]
    if types and not all(read_as_json(t) for t in types):
        return scope  # typed JSON already: content_type_refusal let nothing else through
    headers = [(name, value) for name, value in scope["headers"] if name != b"content-type"]
    return {**scope, "headers": [*headers, JSON_CONTENT_TYPE]}


def replay(body: bytes, receive: Receive) -> Receive:
    """A receive() that gives the body read already, then hands over to the client's."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive_again() -> dict[str, Any]:
        return pending.pop() if pending else await receive()

    return receive_again


# ---------------------------------------------------------------------------- prompt characters

# Normalizers that never turn input characters into fewer, and those that compose (NFC, NFKC:
# a base letter and its combining marks become one character). MAX_COMPOSED is the longest
# canonical decomposition of one character (U+1F82), so the most characters that composing can
# fold into one; Unicode's stability policy keeps it (tests check it against unicodedata).
MAX_COMPOSED = 4
KEEPING_NORMALIZERS = frozenset({"NFD", "NFKD", "Lowercase", "Prepend"})
COMPOSING_NORMALIZERS = frozenset({"NFC", "NFKC"})
# Pre-tokenizers that drop no character (Split drops only with behavior "Removed").
KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Digits", "Punctuation", "Split"})


def prompt_char_limit(backend_json: str, vocab: list[str], max_model_len: int) -> int | None:
    """The most characters a prompt of max_model_len tokens can have, or None where the
    tokenizer can make one token of unboundedly many characters.

    `backend_json` is the Hugging Face `tokenizers` serialization (`tokenizer.json`), `vocab`
    every token's string, added tokens included. The bound is the longest token's length
    times max_model_len, times what a normalizer can fold into one character. It holds for
    BPE over bytes (GPT-2's byte-level alphabet, one character per byte, which is at least the
    characters the bytes decode to) and for BPE with byte fallback (SentencePiece's "<0xE6>"),
    and for no tokenizer that has an unknown token swallowing a run of characters, a normalizer
    or pre-tokenizer that drops characters, or an added token that strips whitespace.
    """
    spec = json.loads(backend_json)
    fold = _fold_factor(spec.get("normalizer"))
    if fold is None or not _keeps_every_character(spec):
        return None
    return max(len(token) for token in vocab) * fold * max_model_len


def _keeps_every_character(spec: dict) -> bool:
    model = spec.get("model") or {}
    byte_level = _is_byte_level(spec.get("pre_tokenizer"))
    bpe_over_bytes = model.get("type") == "BPE" and (byte_level or model.get("byte_fallback"))
    stripping = any(t.get("lstrip") or t.get("rstrip") for t in spec.get("added_tokens") or [])
    return (
        bool(bpe_over_bytes) and not stripping and _pre_tokenizer_keeps(spec.get("pre_tokenizer"))
    )


def _fold_factor(normalizer: dict | None) -> int | None:
    """How many input characters one normalized character can stand for; None if unbounded."""
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == "Sequence":
        factor = 1
        for part in normalizer.get("normalizers", []):
            part_factor = _fold_factor(part)
            if part_factor is None:
                return None
            factor *= part_factor
        return factor
    if kind in COMPOSING_NORMALIZERS:
        return MAX_COMPOSED
    if kind in KEEPING_NORMALIZERS or (kind == "Replace" and _replace_keeps(normalizer)):
        return 1
    return None


def _replace_keeps(normalizer: dict) -> bool:
    """A plain-string Replace that is never shorter than what it replaces (" " -> "▁")."""
    pattern = normalizer.get("pattern", {}).get("String")
    return pattern is not None and len(normalizer.get("content", "")) >= len(pattern)


def _pre_tokenizer_keeps(pre: dict | None) -> bool:
    if pre is None:
        return True
    if pre.get("type") == "Sequence":
        return all(_pre_tokenizer_keeps(p) for p in pre.get("pretokenizers", []))
    return pre.get("type") in KEEPING_PRE_TOKENIZERS and pre.get("behavior") != "Removed"


def _is_byte_level(pre: dict | None) -> bool:
    if pre is None:
        return False
    if pre.get("type") == "Sequence":
        return any(_is_byte_level(p) for p in pre.get("pretokenizers", []))
    return pre.get("type") == "ByteLevel"
