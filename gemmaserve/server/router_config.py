"""`RouterConfig`: the options of `gemmaserve router` (free of fastapi: the command line builds its
parser without importing the server)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from ..config.options import add_options, from_namespace, number, option, port_number
from ..errors import UserInputError


@dataclass
class RouterConfig:
    prefill: list[str] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)
    host: str = option("127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    port: int = option(8000, parse=port_number, help="TCP port (0: any free port, printed at startup)")
    request_timeout: float = option(600.0, parse=number,
                                    help="seconds to wait for an engine's response (and between streamed chunks)")

    def __post_init__(self) -> None:
        for name in ("prefill", "decode"):
            urls = getattr(self, name)
            if not urls:
                raise UserInputError(f"--{name} needs at least one engine URL")
            for url in urls:
                if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                    raise UserInputError(f"--{name}: {url!r} is not an http(s) URL (e.g. http://127.0.0.1:8100)")
            setattr(self, name, [u.rstrip("/") for u in urls])
        if not isinstance(self.request_timeout, (int, float)) or not self.request_timeout > 0:
            raise UserInputError(f"request_timeout must be a positive number of seconds, got {self.request_timeout!r}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engines")
    group.add_argument("--prefill", nargs="+", required=True, metavar="URL",
                       help="prefill engines (`gemmaserve serve --role prefill`), e.g. http://127.0.0.1:8100")
    group.add_argument("--decode", nargs="+", required=True, metavar="URL",
                       help="decode engines (`gemmaserve serve --role decode`)")
    add_options(parser, RouterConfig, "router")


def config_from(ns: argparse.Namespace) -> RouterConfig:
    return from_namespace(RouterConfig, ns, prefill=list(ns.prefill), decode=list(ns.decode))
