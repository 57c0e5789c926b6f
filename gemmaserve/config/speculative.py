"""`--speculative-config`: several tokens per target forward, with vLLM's keys.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2,
     "disable_by_batch_size": 4}
    {"method": "mtp", "model": "path/to/gemma-4-E2B-it-assistant", "num_speculative_tokens": 4}
    {"method": "draft_model", "model": "gemma3-270m", "num_speculative_tokens": 4}

`ngram` (prompt lookup) drafts the tokens that followed the latest earlier occurrence of the sequence's
last n tokens (n from prompt_lookup_max down to prompt_lookup_min), no model needed. `mtp` drafts with
a Gemma 4 target's MTP drafter (a Hugging Face directory of `Gemma4AssistantForCausalLM` or its unified
twin), which reads the target's KV and last hidden state (models/gemma4_assistant.py). `draft_model`
drafts with any smaller Gemma whose vocabulary the target's contains (a model name, directory or GGUF
file), its KV in the target's pool and budget (engine/spec_decode/draft_model.py). The target checks
every draft in the same forward and keeps the longest run it agrees with, plus its own next token, so
the output is what one token per step would give (engine/spec_decode/verify.py).

A step with more running decodes than `disable_by_batch_size` drafts nothing: a bigger batch already
uses the compute that verification would. The default is the device's, where it was measured to stop
paying (BENCHMARKS.md): 4 on the CPU (`gemmaserve bench spec`: drafting paid up to 4 running decodes on
both workloads, lost at 8), 8 on CUDA (`gpu_spec_replay` on an H200, acceptance 0.7, k = 3: 1.59-1.75x at
batch 8 on the Gemma 4 31B and Gemma 3 27B shapes, 0.96x at batch 64 on the 31B).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from ..errors import UserInputError

METHODS = ("ngram", "mtp", "draft_model")
MAX_SPECULATIVE_TOKENS = 16
DEFAULT_DISABLE_BY_BATCH_SIZE = {"cpu": 4, "cuda": 8}   # by device type (see above)


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    model: str | None = None
    disable_by_batch_size: int | None = None   # None: the device's default (`for_device`)

    @classmethod
    def parse(cls, value: "str | dict | SpeculativeConfig") -> "SpeculativeConfig":
        """From JSON text (the command line), a dict (`LLM(speculative_config={...})`) or itself."""
        if isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise UserInputError(f"speculative config is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise UserInputError("speculative config must be a JSON object such as "
                                 '{"method": "ngram", "num_speculative_tokens": 4}')
        known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model",
                 "disable_by_batch_size"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise UserInputError(f"speculative config: unknown key(s) {', '.join(unknown)} "
                                 f"(known: {', '.join(sorted(known))})")
        method = value.get("method")
        if method not in METHODS:
            raise UserInputError(f"speculative config: method must be one of {', '.join(METHODS)}, got {method!r}")
        k = value.get("num_speculative_tokens")
        if not _int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise UserInputError(f"speculative config: num_speculative_tokens must be an integer in "
                                 f"[1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        cap = value.get("disable_by_batch_size")
        if cap is not None and (not _int(cap) or cap < 1):
            raise UserInputError(f"speculative config: disable_by_batch_size must be an integer >= 1, got {cap!r}")
        if method != "ngram":
            lookup = sorted({"prompt_lookup_max", "prompt_lookup_min"} & set(value))
            if lookup:
                raise UserInputError(f"speculative config: method {method} takes no {' or '.join(lookup)}")
            model = value.get("model")
            if not isinstance(model, str) or not model:
                example = ("the drafter's directory (e.g. a copy of google/gemma-4-E2B-it-assistant)" if method == "mtp"
                           else "a smaller Gemma with the target's vocabulary (e.g. gemma3-270m)")
                raise UserInputError(f'speculative config: method {method} needs "model", {example}')
            return cls(method, k, model=model, disable_by_batch_size=cap)
        hi, lo = value.get("prompt_lookup_max"), value.get("prompt_lookup_min")
        if hi is None and lo is None:
            hi, lo = cls.prompt_lookup_max, cls.prompt_lookup_min
        hi = lo if hi is None else hi
        lo = min(hi, cls.prompt_lookup_min) if lo is None and _int(hi) else lo
        if not (_int(lo) and _int(hi) and 1 <= lo <= hi <= 64):
            raise UserInputError(f"speculative config: need 1 <= prompt_lookup_min <= prompt_lookup_max <= 64, "
                                 f"got {lo!r} and {hi!r}")
        if value.get("model") is not None:
            raise UserInputError("speculative config: method ngram takes no model")
        return cls(method, k, hi, lo, None, cap)

    def for_device(self, device_type: str) -> "SpeculativeConfig":
        """The config with `disable_by_batch_size` resolved for a device of this type."""
        if self.disable_by_batch_size is not None:
            return self
        return dataclasses.replace(self, disable_by_batch_size=DEFAULT_DISABLE_BY_BATCH_SIZE.get(device_type, 4))

    @property
    def label(self) -> str:
        """How `EngineInfo` and logs name it: "ngram k=4 n=4..2 up to batch 4"."""
        how = f"n={self.prompt_lookup_max}..{self.prompt_lookup_min}" if self.method == "ngram" else self.model
        cap = self.disable_by_batch_size or "the device's default"
        return f"{self.method} k={self.num_speculative_tokens} {how} up to batch {cap}"

    @property
    def drafts_on_runner(self) -> bool:
        """Drafts come from a model the runner runs after each step (not from the token history)."""
        return self.method != "ngram"


def _int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
