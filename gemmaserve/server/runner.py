"""Running the app under uvicorn with a graceful drain.

SIGTERM (or SIGINT) does not stop the listener at once, as uvicorn would: the server first drains
(`OpenAIServer.drain`: /health and new requests answer 503 while running requests finish, and after
--shutdown-timeout the rest are aborted), then uvicorn shuts down and the process exits 0. A second
signal forces the exit. A load that fails stops the server, and `serve` raises its error.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import uvicorn

from ..engine.llm_engine import LLMEngine
from .app import OpenAIServer
from .config import ServerConfig

log = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    def __init__(self, api: OpenAIServer, config: uvicorn.Config):
        super().__init__(config)
        self.api = api
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        # Not recorded as a captured signal: uvicorn would re-raise it after shutdown (exit status
        # -15 for SIGTERM), where a drained server exits 0.
        if self._drain is not None or self._loop is None:
            self.should_exit = self.force_exit = True
            return
        log.info("signal %d: draining (up to %.1fs), a second signal forces the exit", sig,
                 self.api.config.shutdown_timeout)
        self.request_drain()

    def request_drain(self) -> None:
        """Start draining; callable from any thread."""
        def start() -> None:
            if self._drain is None:
                self._drain = asyncio.ensure_future(self._drain_then_exit())

        if self._loop is not None:
            self._loop.call_soon_threadsafe(start)

    async def _drain_then_exit(self) -> None:
        try:
            await self.api.drain(self.api.config.shutdown_timeout)
        finally:
            self.should_exit = True

    async def on_tick(self, counter: int) -> bool:
        if self.api.load_error is not None:
            return True
        return await super().on_tick(counter)


def make_server(api: OpenAIServer, host: str, port: int, log_level: str = "info") -> DrainingServer:
    return DrainingServer(api, uvicorn.Config(api.app, host=host, port=port, log_level=log_level,
                                              timeout_graceful_shutdown=5))


def serve(engine: LLMEngine | Callable[[], LLMEngine], config: ServerConfig) -> None:
    """Run the server until a signal drains it (the CLI's `serve`). `engine` may be a loader: the
    server then listens while the model loads (/health: 503 "loading")."""
    api = OpenAIServer(engine, config)
    make_server(api, config.host, config.port).run()
    if api.load_error is not None:
        raise api.load_error
