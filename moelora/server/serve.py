"""Start the engine thread and the HTTP server; stop both on SIGTERM or Ctrl-C (SIGINT).

The first signal drains: no request is admitted from then on (503, /health too), the running
ones get up to --shutdown-timeout seconds to finish, then the rest are aborted (finish_reason
"abort", their text so far), uvicorn closes, and the engine stops with its tensor-parallel ranks.
The process exits with 0. A second signal stops at once.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import uvicorn

from moelora.config import EngineConfig
from moelora.errors import ConfigError
from moelora.server.api import build_app
from moelora.server.async_engine import AsyncEngine
from moelora.server.ingress import DEFAULT_MAX_REQUEST_BYTES, RequestIngress
from moelora.server.metrics import ServerMetrics

# seconds: Kubernetes' default grace period (terminationGracePeriodSeconds) between a pod's
# SIGTERM and its SIGKILL
DEFAULT_SHUTDOWN_TIMEOUT = 30.0
# uvicorn's wait for responses still being written once the drain is over: all of them have
# their last output by then, so this bounds only slow clients
_UVICORN_GRACE_SECONDS = 5


@dataclass(frozen=True)
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    log_level: str = "info"
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    lora_roots: tuple[Path, ...] = ()  # resolved: /v1/load_lora_adapter loads only below these
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT  # seconds a drain waits before aborting

    def __post_init__(self) -> None:
        size = self.max_request_bytes
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ConfigError(
                f"--max-request-bytes {size!r} is invalid: expected an integer >= 1 (bytes)"
            )
        for root in self.lora_roots:
            if root != root.resolve() or not root.is_dir():
                raise ConfigError(
                    f"--lora-root {str(root)!r} is invalid: expected an existing directory "
                    "(given as a resolved path)"
                )
        timeout = self.shutdown_timeout
        number = isinstance(timeout, int | float) and not isinstance(timeout, bool)
        if not number or not 0 <= timeout < math.inf:
            given = f"{timeout:g}" if number else repr(timeout)
            raise ConfigError(
                f"--shutdown-timeout {given} is invalid: expected a number of seconds >= 0 "
                "(0: abort the running requests at once)"
            )


def run_server(
    config: EngineConfig,
    options: ServerOptions,
    *,
    on_started: Callable[[Callable[[], None]], None] | None = None,
) -> None:
    """Serve until SIGTERM or SIGINT, which drain first (DrainingServer). `on_started(stop)` runs
    on a side thread once the port is open; calling `stop()` stops the server without a drain."""
    from moelora.engine.engine import Engine

    logging.basicConfig(level=options.log_level.upper(), format="%(levelname)s %(message)s")
    engine = AsyncEngine(lambda: Engine(config), ServerMetrics(), dict(config.lora_modules))
    app = build_app(engine, api_key=options.api_key, lora_roots=options.lora_roots)
    uv_config = uvicorn.Config(
        RequestIngress(app, max_request_bytes=options.max_request_bytes),
        host=options.host,
        port=options.port,
        log_level=options.log_level,
        timeout_graceful_shutdown=_UVICORN_GRACE_SECONDS,
    )
    server = DrainingServer(uv_config, engine, options.shutdown_timeout)
    if on_started is not None:
        threading.Thread(target=_when_started, args=(server, on_started), daemon=True).start()
    try:
        server.run()
    finally:
        engine.shutdown()


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose first SIGTERM or SIGINT drains the engine (AsyncEngine.drain)
    before uvicorn closes, and whose second one stops at once.

    uvicorn would raise the signal again once closed, so that SIGTERM killed the process; this
    server has already done what the signal asks, so the process exits with 0.
    """

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, shutdown_timeout: float):
        super().__init__(config)
        self.engine, self.shutdown_timeout = engine, shutdown_timeout
        self.signalled = False
        self.draining: asyncio.Task | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # a signal handler: it only sets flags, which on_tick acts on (uvicorn's own tick)
        if self.signalled:
            self.should_exit = self.force_exit = True
        self.signalled = True
        self.engine.stop_admitting()  # at once: a request that arrives now is refused

    async def on_tick(self, counter: int) -> bool:
        if self.signalled and self.draining is None:
            self.draining = asyncio.create_task(self._drain_then_exit())
        return await super().on_tick(counter)

    async def _drain_then_exit(self) -> None:
        try:
            await self.engine.drain(self.shutdown_timeout)
        finally:
            self.should_exit = True


def _when_started(server, callback: Callable[[Callable[[], None]], None]) -> None:
    while not server.started and not server.should_exit:
        threading.Event().wait(0.05)
    if server.started:
        callback(lambda: setattr(server, "should_exit", True))
