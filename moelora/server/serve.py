"""Start the engine thread and the HTTP server; stop both on Ctrl-C."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from moelora.config import EngineConfig
from moelora.errors import ConfigError
from moelora.server.api import build_app
from moelora.server.async_engine import AsyncEngine
from moelora.server.ingress import DEFAULT_MAX_REQUEST_BYTES, RequestIngress
from moelora.server.metrics import ServerMetrics


@dataclass(frozen=True)
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    log_level: str = "info"
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    lora_roots: tuple[Path, ...] = ()  # resolved: /v1/load_lora_adapter loads only below these

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


def run_server(
    config: EngineConfig,
    options: ServerOptions,
    *,
    on_started: Callable[[Callable[[], None]], None] | None = None,
) -> None:
    """Serve until interrupted. `on_started(stop)` runs on a side thread once the port is open;
    calling `stop()` shuts the server down gracefully."""
    import uvicorn

    from moelora.engine.engine import Engine

    logging.basicConfig(level=options.log_level.upper(), format="%(levelname)s %(message)s")
    engine = AsyncEngine(lambda: Engine(config), ServerMetrics(), dict(config.lora_modules))
    app = build_app(engine, api_key=options.api_key, lora_roots=options.lora_roots)
    uv_config = uvicorn.Config(
        RequestIngress(app, max_request_bytes=options.max_request_bytes),
        host=options.host,
        port=options.port,
        log_level=options.log_level,
        timeout_graceful_shutdown=5,
    )
    server = uvicorn.Server(uv_config)
    if on_started is not None:
        threading.Thread(target=_when_started, args=(server, on_started), daemon=True).start()
    try:
        server.run()
    finally:
        engine.shutdown()


def _when_started(server, callback: Callable[[Callable[[], None]], None]) -> None:
    while not server.started and not server.should_exit:
        threading.Event().wait(0.05)
    if server.started:
        callback(lambda: setattr(server, "should_exit", True))
