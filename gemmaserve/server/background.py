"""The real server (uvicorn, loopback, a free port) on a background thread: for tests, benchmarks and
notebooks. `with BackgroundServer(engine) as srv: ... srv.base_url ...`"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ..engine.llm_engine import LLMEngine
from .app import OpenAIServer
from .config import ServerConfig
from .runner import make_server


class BackgroundServer:
    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine], config: ServerConfig | None = None,
                 startup_timeout: float = 60.0):
        config = config or ServerConfig()
        self.server = OpenAIServer(engine, config)
        self._uvicorn = make_server(self.server, "127.0.0.1", 0, log_level="warning")
        self._thread = threading.Thread(target=self._uvicorn.run, name="gemmaserve-http", daemon=True)
        self._timeout = startup_timeout
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "BackgroundServer":
        self._thread.start()
        deadline = time.monotonic() + self._timeout
        while not self._uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.02)
        self.port = self._uvicorn.servers[0].sockets[0].getsockname()[1]
        return self

    def drain(self) -> None:
        """What SIGTERM does: drain within the config's shutdown_timeout, then stop."""
        self._uvicorn.request_drain()

    def wait_stopped(self, timeout: float = 60.0) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def __exit__(self, *exc) -> None:
        self._uvicorn.should_exit = True
        self._thread.join(30)
