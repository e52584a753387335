"""Prefix caching over HTTP: a repeated prompt reports its cached tokens in the usage, the
metrics count the hit, and cache_salt is a strict string field of the body."""

from __future__ import annotations

import uuid

import httpx

from .conftest import Server

PROMPT = [(5 * i + 7) % 200 + 3 for i in range(40)]  # two full pages of 16 and a partial one


def _complete(server: Server, **fields) -> httpx.Response:
    body = {"model": "sql", "prompt": PROMPT, "max_tokens": 2, "temperature": 0, **fields}
    return httpx.post(f"{server.url}/v1/completions", json=body, headers=server.headers, timeout=60)


def test_a_repeated_prompt_reports_cached_tokens_and_counts_a_hit(server: Server) -> None:
    salt = uuid.uuid4().hex  # a namespace no other test's requests reach
    before = server.metrics()
    first = _complete(server, cache_salt=salt)
    assert first.status_code == 200, first.text
    assert first.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    second = _complete(server, cache_salt=salt)
    assert second.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
    assert second.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
    after = server.metrics()
    hits = "moelora_prefix_cache_hits_total"
    queries = "moelora_prefix_cache_queries_total"
    assert after[hits] - before.get(hits, 0) >= 32
    assert after[queries] - before.get(queries, 0) >= 2 * len(PROMPT)


def test_a_cache_salt_must_be_a_string(server: Server) -> None:
    resp = _complete(server, cache_salt=7)
    assert resp.status_code == 400, resp.text
    assert "cache_salt" in resp.text
