"""Unloading an adapter at runtime takes the gate loading does (lora_gate.py): off without
--api-key or --lora-root, since an adapter unloaded then could not come back."""

from __future__ import annotations

import asyncio
import os
import sys

import httpx

from moelora import demo
from moelora.server.api import build_app

from .conftest import _free_port, serve


class AdapterEngine:
    """What the adapter routes need of an AsyncEngine: one adapter, "sql"."""

    model_name = "demo"

    def __init__(self) -> None:
        self.unloaded: list[str] = []

    async def unload_lora(self, name: str) -> None:
        self.unloaded.append(name)

    def adapter_paths(self) -> dict[str, str]:
        return {"sql": "/adapters/sql"}


def _unload(app, *, key: str | None = None) -> httpx.Response:
    async def call() -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            body = {"lora_name": "sql"}
            return await client.post("/v1/unload_lora_adapter", json=body, headers=headers)

    return asyncio.run(call())


def test_unloading_is_open_where_loading_is(tmp_path) -> None:
    engine = AdapterEngine()
    assert _unload(build_app(engine, api_key="k"), key="k").status_code == 200
    assert _unload(build_app(engine, lora_roots=(tmp_path,))).status_code == 200
    assert engine.unloaded == ["sql", "sql"]
    assert _unload(build_app(engine)).status_code == 403
    assert engine.unloaded == ["sql", "sql"]


def test_the_openapi_schema_says_unload_may_be_403(tmp_path) -> None:
    def statuses(**kw) -> set[str]:
        schema = build_app(AdapterEngine(), **kw).openapi()
        return set(schema["paths"]["/v1/unload_lora_adapter"]["post"]["responses"])

    assert "403" in statuses()
    assert "403" not in statuses(api_key="k")
    assert "403" not in statuses(lora_roots=(tmp_path,))


def test_without_key_or_root_unload_is_403_over_http(tmp_path) -> None:
    assets = demo.ensure_demo(tmp_path / "cache" / "demo")
    port = _free_port()
    cmd = [sys.executable, "-m", "moelora.cli", "serve", "demo", "--device", "cpu"]
    cmd += ["--port", str(port), "--max-model-len", "128", "--log-level", "warning"]
    env = {**os.environ, "MOELORA_CACHE": str(tmp_path / "cache")}
    log, cache = tmp_path / "server.log", tmp_path / "cache"
    with serve(cmd, port, log, cache, dict(assets.adapters), env=env) as srv:
        r = httpx.post(f"{srv.url}/v1/unload_lora_adapter", json={"lora_name": "sql"}, timeout=30)
        assert r.status_code == 403, r.text
        error = r.json()["error"]
        assert error["type"] == "PermissionDeniedError", error
        assert "unloading" in error["message"], error
        assert "--api-key" in error["message"] and "--lora-root" in error["message"], error
        body = {"model": "sql", "prompt": "SELECT", "max_tokens": 2}
        r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text  # still there
