"""The keys of the prefix cache: a namespace per request and a hash chain over its full pages.

A page's hash is sha256(parent hash, namespace, its tokens), so two pages share a key only
when everything before them, their tokens and their namespace are all the same. The namespace
is built by the engine from what it knows, never from a field a request can set to anything
but its own salt: the adapter's load (a number that changes at every load, a reload under the
same name included) or base, and the request's cache_salt. Each part is tagged ("adapter",
"base", "salt") and written with repr, so no salt can spell an adapter's namespace.

Pages of generated tokens are hashed too, once their tokens are known (as vLLM hashes every
full block): the next turn of a conversation, whose prompt is this one's prompt and answer,
then finds the answer's pages cached as well.
"""

from __future__ import annotations

import hashlib

import numpy as np


def namespace(adapter_load: int | None, cache_salt: str | None) -> bytes:
    """adapter_load: the engine's number for the adapter's load, None for base requests."""
    model = ("base",) if adapter_load is None else ("adapter", adapter_load)
    salt = () if cache_salt is None else (("salt", cache_salt),)
    return hashlib.sha256(repr((model, *salt)).encode()).digest()


def extend_hashes(hashes: list[bytes], tokens: list[int], page_size: int, ns: bytes) -> None:
    """Append the hash of each full page of `tokens`, the pages that follow `hashes`' pages
    (a last partial page gets none)."""
    ids = np.asarray(tokens, dtype=np.int64)
    assert not (ids < 0).any(), "a placeholder token cannot be hashed"
    parent = hashes[-1] if hashes else b""
    for start in range(0, len(ids) - page_size + 1, page_size):
        parent = hashlib.sha256(parent + ns + ids[start : start + page_size].tobytes()).digest()
        hashes.append(parent)


def page_hashes(tokens: list[int], page_size: int, ns: bytes) -> list[bytes]:
    """The hash of each full page of `tokens`, in order; a last partial page has none."""
    hashes: list[bytes] = []
    extend_hashes(hashes, tokens, page_size, ns)
    return hashes
