"""Logprobs on text whose characters are split across tokens: CJK, accents and emoji.

The demo's byte-level BPE learnt its merges from ASCII only, so every other character is one
token a byte. Chat `bytes` must be each token's own bytes (joined, the content's UTF-8), and
completions' `text_offset` the character offset in the choice's text where each token starts
(monotone, the echoed prompt first). A small SentencePiece-style tokenizer with byte fallback,
built here, covers the other vocabulary kind.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from moelora import demo
from moelora.server.openai_format import ChatAnswer, CompletionAnswer
from moelora.step.request import RequestOutput
from moelora.tokenizer import Tokenizer

from .conftest import Server

SPLIT = "日本 é 😀"  # 3-, 2- and 4-byte characters
TEXT = f"naïve café: {SPLIT} 語"
# Greedy decoding among the bytes of SPLIT (a +100 bias each), a frequency penalty cycling
# through them: the demo model then writes byte soup with whole 2-, 3- and 4-byte characters.
CHAT_MESSAGES = [{"role": "user", "content": f"Write {SPLIT}"}]


# ----------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def demo_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, demo.TokenizerInfo]:
    folder = tmp_path_factory.mktemp("demo-tokenizer")
    return folder, demo.write_tokenizer(folder)


@pytest.fixture(scope="module")
def demo_tokenizer(demo_files: tuple[Path, demo.TokenizerInfo]) -> Tokenizer:
    return Tokenizer(str(demo_files[0]), [])


def post(server: Server, path: str, body: dict) -> dict:
    resp = httpx.post(f"{server.url}{path}", json=body, headers=server.headers, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def stream(server: Server, path: str, body: dict) -> list[dict]:
    chunks = []
    body = {**body, "stream": True}
    url = f"{server.url}{path}"
    with httpx.stream("POST", url, json=body, headers=server.headers, timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: ") :]))
    return chunks


def split_bias(tok: Tokenizer) -> dict[str, float]:
    """+100 on each byte token of SPLIT's characters (a byte alone decodes to U+FFFD)."""
    return {str(t): 100.0 for t in tok.encode(SPLIT) if tok.decode([t]) == "\ufffd"}


def _whole(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True


def token_piece(token: str) -> bytes:
    """A completions token's bytes: its text, or the bytes a "bytes:\\xe6\\x97" token spells."""
    if not token.startswith("bytes:"):
        return token.encode()
    return bytes(int(h, 16) for h in token[len("bytes:") :].split("\\x")[1:])


def assert_spells(pieces: list[bytes], text: str) -> None:
    """The tokens' bytes decode to the text; what follows it can only be bytes the detokenizer
    held back at the end (an incomplete or invalid sequence, shown as U+FFFD)."""
    decoded = b"".join(pieces).decode("utf-8", errors="replace")
    assert decoded.startswith(text), (decoded, text)
    assert set(decoded[len(text) :]) <= {"\ufffd"}, decoded[len(text) :]


def assert_split_characters(text: str, sizes: set[int]) -> None:
    """The text holds characters of these UTF-8 sizes, which the demo splits byte by byte."""
    found = {len(ch.encode()) for ch in text if ch != "\ufffd"}
    assert sizes <= found, (text, found)


def assert_offsets(text: str, tokens: list[str], offsets: list[int]) -> None:
    """Monotone from 0, within the text; a token of whole characters starts at its offset
    (or, right after invalid bytes, after their U+FFFD), a token of part of one lies inside
    the character at its offset."""
    assert offsets[0] == 0
    assert all(a <= b for a, b in zip(offsets, offsets[1:])), offsets
    assert all(0 <= o <= len(text) for o in offsets), (offsets, len(text))
    for token, offset in zip(tokens, offsets):
        piece, rest = token_piece(token), text[offset:]
        if _whole(piece):
            after_invalid = rest.lstrip("\ufffd")
            assert rest.startswith(piece.decode()) or after_invalid.startswith(piece.decode())
        elif rest and rest[0] != "\ufffd":
            assert piece in rest[0].encode(), (token, offset, rest[0])


def merged_completion(chunks: list[dict]) -> tuple[str, list[str], list[int]]:
    """The text, tokens and offsets of a streamed completion's one choice, chunks joined."""
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    logprobs = [c["logprobs"] for c in choices if c["logprobs"] is not None]
    text = "".join(c["text"] for c in choices)
    tokens = [t for lp in logprobs for t in lp["tokens"]]
    return text, tokens, [o for lp in logprobs for o in lp["text_offset"]]


# ----------------------------------------------------------------------------- tokenizers


def test_demo_token_bytes_are_the_tokens_own(
    demo_tokenizer: Tokenizer, demo_files: tuple[Path, demo.TokenizerInfo]
) -> None:
    """Byte-level BPE: the demo splits CJK, accents and the emoji into one token a byte; each
    token's bytes are that byte, and joined they are the text's UTF-8."""
    tok, vocab_size = demo_tokenizer, demo_files[1].vocab_size
    assert tok.byte_scheme == "byte-level"
    for ch in "日é😀":
        ids = tok.encode(ch)
        assert len(ids) == len(ch.encode()) > 1
        assert [tok.token_bytes(t) for t in ids] == [bytes([b]) for b in ch.encode()]
    ids = tok.encode(TEXT)
    assert b"".join(tok.token_bytes(t) for t in ids) == TEXT.encode()
    space_c = tok.encode(" c")
    assert len(space_c) == 1 and tok.leading_bytes(space_c[0]) == b" c"  # nothing dropped
    for t in range(vocab_size):  # whole-character tokens spell what decode gives
        data = tok.token_bytes(t)
        assert data.decode("utf-8", errors="replace") == tok.decode([t]) or not _whole(data)
    eos = tok.eos_token_ids[0]
    assert tok.token_bytes(eos) == b"" and tok.decode([eos]) == ""


def write_byte_fallback_tokenizer(folder: Path, style: str) -> dict[str, int]:
    """A Llama/Mixtral-style tokenizer: BPE over "▁"-joined words with <0xNN> byte fallback.

    `style`: "strip" is Mixtral's tokenizer.json (a Prepend normalizer, a decoder that strips
    the leading space); "metaspace" has a Metaspace pre-tokenizer and decoder. Returns the
    vocabulary.
    """
    from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, processors
    from tokenizers import Tokenizer as Tk

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab |= {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for piece in ["▁", *"abcdefghijklmnopqrstuvwxyz:", "é", "日", "▁c", "▁ca", "▁caf"]:
        vocab.setdefault(piece, len(vocab))
    merges = [("▁", "c"), ("▁c", "a"), ("▁ca", "f")]
    tk = Tk(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    if style == "strip":
        tk.normalizer = normalizers.Sequence(
            [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
        )
        steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        tk.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)])
    else:
        tk.pre_tokenizer = pre_tokenizers.Metaspace("▁", prepend_scheme="first")
        meta = decoders.Metaspace("▁", prepend_scheme="first")
        tk.decoder = decoders.Sequence([decoders.ByteFallback(), meta])
    tk.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>")])
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tk.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "clean_up_tokenization_spaces": False,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return vocab


@pytest.fixture(scope="module", params=["strip", "metaspace"])
def fallback_tokenizer(request, tmp_path_factory: pytest.TempPathFactory):
    """(the Tokenizer, its vocabulary)."""
    folder = tmp_path_factory.mktemp(f"byte-fallback-{request.param}")
    vocab = write_byte_fallback_tokenizer(folder, request.param)
    return Tokenizer(str(folder), []), vocab


def test_byte_fallback_token_bytes(fallback_tokenizer: tuple[Tokenizer, dict[str, int]]) -> None:
    """SentencePiece style: <0xE6> is the byte 0xE6, "▁" a space, a whole-character piece its
    UTF-8, a special token nothing; decode drops the leading space of a text only."""
    tok, vocab = fallback_tokenizer
    assert tok.byte_scheme == "sentencepiece"
    ids = tok.encode(TEXT)
    assert ids[0] == vocab["<s>"] and {vocab[p] for p in ("<0xE6>", "é", "▁caf")} <= set(ids)
    assert tok.token_bytes(vocab["<0xE6>"]) == b"\xe6"
    assert tok.token_bytes(vocab["▁caf"]) == b" caf"
    assert tok.token_bytes(vocab["é"]) == "é".encode()
    assert tok.token_bytes(vocab["<s>"]) == b""
    assert b"".join(tok.token_bytes(t) for t in ids) == b" " + TEXT.encode()
    assert tok.decode(ids) == TEXT
    assert tok.leading_bytes(vocab["▁caf"]) == b"caf"
    assert tok.leading_bytes(vocab["é"]) == "é".encode()


def fake_output(prompt_ids: list[int], token_ids: list[int], text: str) -> RequestOutput:
    """An engine output with logprobs, each position's alternatives the chosen token and one
    byte token (different bytes at each position)."""
    entries = []
    for i, t in enumerate(prompt_ids + token_ids):
        alt = 3 + 0x80 + i % 64  # <0x80> and up: never whole characters
        entries.append({t: -0.5, alt if alt != t else alt + 64: -1.5})
    return RequestOutput(
        request_id="r",
        prompt_token_ids=prompt_ids,
        token_ids=token_ids,
        text=text,
        finish_reason="length",
        logprobs=entries[len(prompt_ids) :],
        prompt_logprobs=[None, *entries[1 : len(prompt_ids)]],
    )


def test_byte_fallback_answers(fallback_tokenizer: tuple[Tokenizer, dict[str, int]]) -> None:
    """The answers of a SentencePiece-style model: echoed offsets and tokens follow the text
    (whose leading "▁" decode drops), chat bytes join to the content, alternatives keep
    their own keys."""
    tok = fallback_tokenizer[0]
    prompt_ids = tok.encode(TEXT)
    gen = tok.encode(f" {SPLIT} café")[1:]
    out = fake_output(prompt_ids, gen, tok.decode(gen))
    choice = CompletionAnswer(tok, "r", "m", len(prompt_ids), [TEXT]).response([out])
    choice = choice["choices"][0]
    assert choice["text"] == TEXT + tok.decode(gen)
    lp = choice["logprobs"]
    assert_offsets(choice["text"], lp["tokens"], lp["text_offset"])
    assert lp["text_offset"][len(prompt_ids)] == len(TEXT)
    assert b"".join(token_piece(t) for t in lp["tokens"]) == choice["text"].encode()
    assert all(len(top) == 2 for top in lp["top_logprobs"][1:])
    chat = ChatAnswer(tok, "r", "m", len(prompt_ids), 2).response([out])["choices"][0]
    content = chat["logprobs"]["content"]
    assert b"".join(bytes(e["bytes"]) for e in content) == chat["message"]["content"].encode()
    assert all(e["bytes"] == e["top_logprobs"][0]["bytes"] for e in content)


# ----------------------------------------------------------------------------- over HTTP


def chat_body(tok: Tokenizer) -> dict:
    return {
        "model": "sql",
        "messages": CHAT_MESSAGES,
        "max_tokens": 48,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
        "logit_bias": split_bias(tok),
        "frequency_penalty": 2.0,
    }


def test_chat_bytes_spell_the_content(server: Server, demo_tokenizer: Tokenizer) -> None:
    """Whole and streamed: each token's bytes are its own (never U+FFFD's for part of a
    character), joined they are the content's UTF-8, and the content has 2-, 3- and 4-byte
    characters split across tokens."""
    body = chat_body(demo_tokenizer)
    choice = post(server, "/v1/chat/completions", body)["choices"][0]
    content, entries = choice["message"]["content"], choice["logprobs"]["content"]
    assert_split_characters(content, {2, 3, 4})
    assert_spells([bytes(e["bytes"]) for e in entries], content)
    assert all(len(e["bytes"]) == 1 for e in entries)  # the biased tokens are single bytes
    for alt in (a for e in entries for a in e["top_logprobs"]):  # raw logprobs: other tokens
        assert bytes(alt["bytes"]).decode(errors="replace") == alt["token"]
    chunks = stream(server, "/v1/chat/completions", body)
    deltas = [c["choices"][0] for c in chunks if c["choices"]]
    streamed = "".join(d["delta"].get("content") or "" for d in deltas)
    streamed_entries = [e for d in deltas if d["logprobs"] for e in d["logprobs"]["content"]]
    assert streamed == content
    assert [e["bytes"] for e in streamed_entries] == [e["bytes"] for e in entries]


def test_echo_offsets_of_the_issue_prompt(server: Server) -> None:
    """The 4-character prompt "日本 é" is 9 byte tokens: their offsets are where their
    characters start, and the completion's start at the prompt's end."""
    body = {"model": "sql", "prompt": "日本 é", "max_tokens": 3, "temperature": 0}
    choice = post(server, "/v1/completions", {**body, "echo": True, "logprobs": 1})["choices"][0]
    lp = choice["logprobs"]
    assert lp["text_offset"][:9] == [0, 0, 0, 1, 1, 1, 2, 3, 3]
    assert lp["tokens"][:3] == ["bytes:\\xe6", "bytes:\\x97", "bytes:\\xa5"]
    assert lp["text_offset"][9] == 4
    assert_offsets(choice["text"], lp["tokens"], lp["text_offset"])


def test_completion_echo_offsets(server: Server, demo_tokenizer: Tokenizer) -> None:
    """Whole and streamed, echoed prompt and biased completion both split characters: offsets
    are monotone from 0, inside the text, and each token starts at its offset; the tokens'
    bytes spell the text, and no two alternatives of a position collapse into one key."""
    tok = demo_tokenizer
    assert all(len(tok.encode(ch)) > 1 for ch in "日é😀")
    body = {
        "model": "sql",
        "prompt": TEXT,
        "max_tokens": 32,
        "temperature": 0,
        "echo": True,
        "logprobs": 2,
        "logit_bias": split_bias(tok),
        "frequency_penalty": 2.0,
    }
    choice = post(server, "/v1/completions", body)["choices"][0]
    text, lp = choice["text"], choice["logprobs"]
    prompt_tokens = len(tok.encode(TEXT))
    assert text.startswith(TEXT)
    assert_split_characters(text[len(TEXT) :], {2, 3})
    assert_offsets(text, lp["tokens"], lp["text_offset"])
    assert b"".join(token_piece(t) for t in lp["tokens"][:prompt_tokens]) == TEXT.encode()
    assert_spells([token_piece(t) for t in lp["tokens"][prompt_tokens:]], text[len(TEXT) :])
    assert all(len(top) >= 2 for top in lp["top_logprobs"][1:])
    streamed = merged_completion(stream(server, "/v1/completions", body))
    assert streamed == (text, lp["tokens"], lp["text_offset"])


def test_streamed_completion_offsets_run_across_chunks(
    server: Server, demo_tokenizer: Tokenizer
) -> None:
    """Without echo, streamed: a character's bytes arrive in different chunks, and the offsets
    count on from chunk to chunk, equal to the whole answer's."""
    body = {
        "model": "chat",
        "prompt": TEXT,
        "max_tokens": 32,
        "temperature": 0,
        "logprobs": 0,
        "logit_bias": split_bias(demo_tokenizer),
        "frequency_penalty": 2.0,
    }
    chunks = stream(server, "/v1/completions", body)
    text, tokens, offsets = merged_completion(chunks)
    assert sum(1 for c in chunks if c["choices"] and c["choices"][0]["logprobs"]) > 2
    assert_split_characters(text, {2, 3})
    assert_offsets(text, tokens, offsets)
    whole = post(server, "/v1/completions", body)["choices"][0]
    assert (whole["text"], whole["logprobs"]["tokens"], whole["logprobs"]["text_offset"]) == (
        text,
        tokens,
        offsets,
    )
