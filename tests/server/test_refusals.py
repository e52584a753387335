"""Refusals that name what the server does serve: an unknown model lists the base model and the
adapters; a stop token id outside the vocabulary is refused like a logit_bias one."""

from __future__ import annotations

import httpx
import pytest

from .conftest import BASE


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=server.headers, timeout=60)


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"prompt": "SELECT", "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ],
)
def test_unknown_model_names_the_base_model_and_the_adapters(server, path, body):
    r = post(server, path, {**body, "model": "no-such-adapter"})
    assert r.status_code == 404, r.text
    message = r.json()["error"]["message"]
    assert "'no-such-adapter'" in message
    assert f"'{BASE}'" in message and "'sql'" in message and "'chat'" in message


def test_stop_token_id_outside_the_vocabulary_is_refused(server):
    r = post(
        server,
        "/v1/completions",
        {"model": BASE, "prompt": "SELECT", "max_tokens": 2, "stop_token_ids": [10**6]},
    )
    assert r.status_code == 400, r.text
    assert "stop_token_ids" in r.json()["error"]["message"]
    assert "1000000" in r.json()["error"]["message"]
