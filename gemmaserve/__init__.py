"""gemmaserve: an inference engine for Gemma 3 / Gemma 4 with a sliding-window-aware KV cache."""

from .engine.llm import LLM
from .engine.request import CompletionOutput, RequestOutput
from .engine.sampling_params import SamplingParams
from .errors import UserInputError

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "UserInputError"]
__version__ = "0.1.0"
