"""`EngineClient`: what the HTTP endpoints may ask of the engine, and nothing else.

`AsyncEngine` (async_engine.py) is the one implementation (its `engine` arguments are the LLMEngine): its commands run on the engine thread between
steps; what is read directly (info, inputs, adapter names, validation) is safe from any thread. Endpoints
hold a client, never the engine (issue 44).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from ..engine.factory import EngineInfo
from ..engine.input_processor import InputProcessor
from ..engine.lora import LoRARef
from ..engine.media.items import MediaItem
from ..engine.request import RequestOutput
from ..engine.sampling_params import SamplingParams
from ..engine.snapshot import EngineSnapshot
from ..engine.validation import CheckedRequest
from .async_engine import Admission, Generation


class EngineClient(Protocol):
    @property
    def info(self) -> EngineInfo: ...

    @property
    def inputs(self) -> InputProcessor: ...

    def adapter_names(self) -> list[str]: ...

    def adapter_refs(self) -> list[LoRARef]: ...

    def has_adapter(self, name: str) -> bool: ...

    async def validate(self, prompts: list[tuple[str, list[int]]], params: SamplingParams,
                       media: list[list[MediaItem]] | None = None, lora: str | None = None) -> list[CheckedRequest]: ...

    def admit(self, completions: int) -> Admission: ...

    def withdraw(self, admission: Admission) -> None: ...

    def generate(self, request_id: str, prompts: list[CheckedRequest], deadline: float | None = None,
                 adopt: Callable[[Any, str], list[RequestOutput]] | None = None,
                 admission: Admission | None = None) -> Generation: ...

    async def add_adapter(self, name: str, path: str) -> None: ...

    async def remove_adapter(self, name: str) -> None: ...

    async def snapshot(self) -> EngineSnapshot: ...

    def call(self, fn: Callable[[Any], Any]) -> Awaitable[Any]: ...   # fn(engine) on the engine thread

    def post(self, fn: Callable[[Any], None]) -> None: ...
