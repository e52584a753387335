"""The model folder's tokenizer (tokenizer.json + tokenizer_config.json) and its chat template."""

from __future__ import annotations

import codecs
import json
import re
import sys
from pathlib import Path
from typing import Any

from moelora.errors import InvalidRequestError

# How a vocabulary entry spells its bytes, read from the tokenizer's own decoder:
BYTE_LEVEL = "byte-level"  # GPT-2's byte-to-unicode alphabet, one character a byte (Qwen, OLMoE)
SENTENCEPIECE = "sentencepiece"  # text with "▁" for a space, <0xNN> byte fallback (Mixtral)
PLAIN = "plain"  # anything else (WordPiece, ...): whole characters, decoded one token at a time
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class Tokenizer:
    def __init__(self, model_path: str, extra_eos_ids: list[int]):
        from transformers import AutoTokenizer  # costly import: only when a folder has one

        self._tok = AutoTokenizer.from_pretrained(model_path)
        eos = set(extra_eos_ids)
        if self._tok.eos_token_id is not None:
            eos.add(self._tok.eos_token_id)
        self.eos_token_ids = sorted(eos)
        template = Path(model_path) / "chat_template.jinja"
        if self._tok.chat_template is None and template.exists():
            self._tok.chat_template = template.read_text()
        decoder = _decoder_steps(self._tok)
        self.byte_scheme = _byte_scheme(decoder)
        self._leading_spaces_dropped = _leading_spaces_dropped(decoder)
        self._token_bytes: dict[int, bytes] = {}  # filled on first use: vocabularies are large

    @property
    def hf_tokenizer(self) -> Any:
        """The transformers tokenizer underneath (what xgrammar reads the vocabulary from)."""
        return self._tok

    @property
    def chat_template(self) -> str | None:
        return self._tok.chat_template

    @staticmethod
    def exists(model_path: str) -> bool:
        return (Path(model_path) / "tokenizer.json").exists() or (
            Path(model_path) / "tokenizer_config.json"
        ).exists()

    def backend_spec(self) -> tuple[str, list[str]] | None:
        """The Hugging Face `tokenizers` serialization (tokenizer.json, as text) and every
        token's string, for bounds derived from them; None for a tokenizer without that backend."""
        backend = getattr(self._tok, "backend_tokenizer", None)
        if backend is None:
            return None
        return backend.to_str(), list(self._tok.get_vocab())

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=True)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def token_bytes(self, token_id: int) -> bytes:
        """The token's own UTF-8 bytes, which may be part of a character: what it adds to a
        decoded text anywhere but at the start (see `leading_bytes`). Special tokens have none,
        as decode skips them. Joined, a text's tokens' bytes are the text's UTF-8."""
        data = self._token_bytes.get(token_id)
        if data is None:
            data = self._token_bytes[token_id] = self._spell_bytes(token_id)
        return data

    def leading_bytes(self, token_id: int) -> bytes:
        """What the token adds as the first of a decoded text: a SentencePiece decoder drops the
        space that its "▁" prefix stands for there (as decode(["▁Hi"]) == "Hi")."""
        data = self.token_bytes(token_id)
        spaces = len(data) - len(data.lstrip(b" "))
        return data[min(spaces, self._leading_spaces_dropped) :]

    def _spell_bytes(self, token_id: int) -> bytes:
        token = self._tok.convert_ids_to_tokens(token_id)
        if token is None:  # past the vocabulary (a padded lm_head row): decodes to nothing
            return b""
        if token_id in self._tok.added_tokens_decoder or self.byte_scheme == PLAIN:
            return self.decode([token_id]).encode()  # whole text, or nothing if special
        if self.byte_scheme == BYTE_LEVEL:
            return byte_level_bytes(token)
        byte = _BYTE_TOKEN.fullmatch(token)
        return bytes([int(byte[1], 16)]) if byte else token.replace("▁", " ").encode()

    def decode_incremental(
        self, ids: list[int], offsets: tuple[int, int], *, end: int | None = None
    ) -> tuple[str, tuple[int, int]]:
        """The text the newest tokens add, decoding a short window instead of the whole list.

        offsets = (prefix, read): ids[prefix:read] is the window already turned into text. The
        window is decoded with and without the new tokens and the difference is the new text;
        it is held back while its bytes end inside a character that a later token may complete.
        A U+FFFD for bytes that no token can complete is text: held back, it would be lost when
        the request ends there, and the text would be shorter than what its tokens spell.
        end: the ids known so far (the rest of the list are placeholders); default all of them.
        """
        prefix, read = offsets
        end = len(ids) if end is None else end
        before = self.decode(ids[prefix:read])
        after = self.decode(ids[prefix:end])
        held = after.endswith("\ufffd") and self._ends_mid_character(ids[prefix:end])
        if len(after) > len(before) and not held:
            return after[len(before) :], (read, end)
        return "", offsets

    def _ends_mid_character(self, ids: list[int]) -> bool:
        utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        utf8.decode(b"".join(self.token_bytes(t) for t in ids))
        return bool(utf8.getstate()[0])  # the bytes it holds for the next call

    def apply_chat_template(
        self, messages: list[dict], tools: list[dict] | None = None
    ) -> list[int]:
        """tools: OpenAI's tool specs, which the template shows the model (None: no tools)."""
        if self._tok.chat_template is None:
            raise InvalidRequestError("this model folder has no chat template")
        text = self._tok.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=True
        )
        return self._tok.encode(text, add_special_tokens=False)


def _unicode_to_byte() -> dict[str, int]:
    """The inverse of GPT-2's bytes_to_unicode: printable bytes stand for themselves, the others
    for 256 + their rank among them."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable} | {b: chr(256 + n) for n, b in enumerate(others)}
    return {ch: b for b, ch in chars.items()}


_BYTE_OF_CHAR = _unicode_to_byte()  # a constant table, never written


def byte_level_bytes(token: str) -> bytes:
    """A byte-level BPE token's bytes. As in the ByteLevel decoder, a token with a character
    outside the byte alphabet (an added token) is its own UTF-8."""
    if all(ch in _BYTE_OF_CHAR for ch in token):
        return bytes(_BYTE_OF_CHAR[ch] for ch in token)
    return token.encode()


def _decoder_steps(tok: Any) -> list[dict]:
    """The steps of the tokenizer.json decoder, a Sequence flattened ([] for a slow tokenizer).
    The decoder's own JSON (its pickled state): the whole tokenizer.json can be megabytes."""
    decoder = getattr(getattr(tok, "backend_tokenizer", None), "decoder", None)
    if decoder is None:
        return []
    todo, steps = [json.loads(decoder.__getstate__())], []
    while todo:
        step = todo.pop(0)
        if step is not None and step.get("type") == "Sequence":
            todo[:0] = step["decoders"]
        elif step is not None:
            steps.append(step)
    return steps


def _byte_scheme(steps: list[dict]) -> str:
    types = {step["type"] for step in steps}
    if "ByteLevel" in types:
        return BYTE_LEVEL
    if types & {"ByteFallback", "Metaspace"}:
        return SENTENCEPIECE
    return PLAIN


def _leading_spaces_dropped(steps: list[dict]) -> int:
    """How many spaces decode drops from the start of a text: those of SentencePiece's "▁"
    prefix, which the normalizer or pre-tokenizer put in front of the text. A Metaspace decoder
    drops every space of the first token; Strip, at most its `start`."""
    for step in steps:
        if step["type"] == "Strip" and step.get("content") == " ":
            return step.get("start", 0)
        if step["type"] == "Metaspace":
            prepends = step.get("prepend_scheme", "always") != "never"
            return sys.maxsize if prepends and step.get("add_prefix_space", True) else 0
    return 0


def eos_ids_from_folder(model_path: str, hf_eos: int | list[int] | None) -> list[int]:
    """EOS ids of config.json and generation_config.json (the latter often lists several)."""
    ids = _as_list(hf_eos)
    gen = Path(model_path) / "generation_config.json"
    if gen.exists():
        ids += _as_list(json.loads(gen.read_text()).get("eos_token_id"))
    return sorted(set(ids))


def _as_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)
