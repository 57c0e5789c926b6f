"""gemmaserve: an inference engine for Gemma 3 / Gemma 4 with a sliding-window-aware KV cache.

The public names load on first use, so `gemmaserve --help` does not pay for importing torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .errors import UserInputError

if TYPE_CHECKING:
    from .engine.llm import LLM
    from .engine.request import CompletionOutput, RequestOutput
    from .engine.sampling_params import SamplingParams
    from .engine.structured.structured_output import GrammarKind, StructuredOutput

_LAZY = {"LLM": ".engine.llm", "SamplingParams": ".engine.sampling_params", "RequestOutput": ".engine.request",
         "CompletionOutput": ".engine.request", "StructuredOutput": ".engine.structured.structured_output",
         "GrammarKind": ".engine.structured.structured_output"}

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "StructuredOutput", "GrammarKind",
           "UserInputError"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
