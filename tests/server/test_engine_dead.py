"""One EngineDeadError (moelora.errors) for an engine that cannot go on, a dead rank or a stopped
engine thread: HTTP 503, though it is a MoeloraError, whose others are the user's doing (400)."""

from __future__ import annotations

import asyncio
import json

import pytest

from moelora.errors import EngineDeadError, MoeloraError
from moelora.server.async_engine import AsyncEngine
from moelora.server.errors import exception_response


def test_a_dead_engine_is_503_and_a_users_error_400():
    dead = exception_response(EngineDeadError("rank 1 (pid 7) exited with code -9"))
    assert dead.status_code == 503
    assert json.loads(dead.body)["error"]["type"] == "ServiceUnavailableError"
    assert exception_response(MoeloraError("bad value")).status_code == 400


class _DyingEngine:
    """Builds, then fails in the engine thread's loop: a bug in the loop itself."""

    model_name, max_model_len, tokenizer, grammars = "m", 8, None, None

    def list_loras(self) -> list[str]:
        return []

    def has_unfinished_requests(self) -> bool:
        raise RuntimeError("boom")

    def close(self) -> None:
        pass


def test_a_call_into_a_stopped_engine_thread_raises_engine_dead_error():
    engine = AsyncEngine(_DyingEngine, metrics=None)
    engine._thread.join(timeout=10)
    try:
        with pytest.raises(EngineDeadError, match="the engine thread has stopped"):
            asyncio.run(engine.call(lambda e: e.model_name))
    finally:
        engine.shutdown(timeout=1)
