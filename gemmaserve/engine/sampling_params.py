"""How to pick each next token, how many completions, and when to stop."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ..config.options import any_int, number, option, positive_int
from ..errors import UserInputError
from .structured.structured_output import StructuredOutput, parse_cli_structured

MAX_N = 64                # completions per prompt
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_LOGPROBS = 20         # alternatives reported per token
GREEDY_BELOW = 1e-5       # temperatures below this are greedy: dividing logits by less overflows float32
REPETITION_PENALTY_RANGE = (0.01, 100.0)   # beyond it, logits overflow float32 (inf/nan probabilities)
SEED_RANGE = (-(1 << 63), 1 << 64)         # what torch.Generator.manual_seed accepts
MIN_TOP_P = 1e-8          # smaller values round to 0 in float32 and keep no token at all


@dataclass
class SamplingParams:
    max_tokens: int = option(64, parse=positive_int, help="most tokens to generate per completion")
    temperature: float = option(0.0, parse=number, help="0 = greedy (so is anything below 1e-5); higher = more random")
    top_p: float = option(1.0, parse=number, help="nucleus sampling: keep the smallest set of tokens with this much probability")
    top_k: int = option(0, parse=any_int, help="keep the k most likely tokens (0 = all)")
    min_p: float = option(0.0, parse=number, help="drop tokens less likely than min_p x the most likely one")
    repetition_penalty: float = option(1.0, parse=number,
                                       help="> 1 discourages tokens already in the prompt or output (HF semantics)")
    presence_penalty: float = option(0.0, parse=number, help="-2..2: subtract from tokens already generated")
    frequency_penalty: float = option(0.0, parse=number, help="-2..2: subtract per occurrence in the output")
    seed: int | None = option(None, parse=any_int, help="per-request random seed (same seed, same output)")
    n: int = option(1, parse=positive_int, help="completions per prompt (they share the prompt's KV pages)")
    stop: list[str] = option(None, multiple=True, help="stop when this text appears (repeatable; not included in "
                                                        "the output)")
    stop_token_ids: list[int] = option(None, parse=any_int, multiple=True, help="extra token ids that end a completion")
    logprobs: int | None = option(None, parse=any_int, help="report the chosen token's log-probability and this many "
                                                            "alternatives (0-20)")
    ignore_eos: bool = option(False, help="keep generating after an end-of-sequence token (until max_tokens)")
    structured_output: StructuredOutput | None = option(
        None, parse=parse_cli_structured,
        help="constrain the output: 'json' (any JSON object), json_schema=SCHEMA, regex=RE or grammar=EBNF "
             "(SPEC inline or @file)")
    skip_special_tokens: bool = True
    # False: this request opts out of speculative decoding (the engine's --speculative-config); its
    # output is the same either way, only its speed differs.
    speculative: bool = True

    def __post_init__(self) -> None:
        # One string or id is accepted where a list is expected (as OpenAI's `stop` does).
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.stop_token_ids, int) and not isinstance(self.stop_token_ids, bool):
            self.stop_token_ids = [self.stop_token_ids]
        self.stop = list(self.stop) if isinstance(self.stop, (list, tuple)) else ([] if self.stop is None else self.stop)
        self.stop_token_ids = (list(self.stop_token_ids) if isinstance(self.stop_token_ids, (list, tuple))
                               else ([] if self.stop_token_ids is None else self.stop_token_ids))
        self.structured_output = StructuredOutput.parse(self.structured_output)
        self.validate()

    def validate(self) -> None:
        def integer(x: object) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        def check(ok: bool, msg: str) -> None:
            if not ok:
                raise UserInputError(msg)

        check(integer(self.max_tokens) and self.max_tokens >= 1,
              f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        check(_finite(self.temperature) and self.temperature >= 0,
              f"temperature must be a number >= 0, got {self.temperature!r}")
        check(_finite(self.top_p) and MIN_TOP_P <= self.top_p <= 1.0,
              f"top_p must be in [{MIN_TOP_P:g}, 1], got {self.top_p!r}")
        check(integer(self.top_k) and self.top_k >= 0,
              f"top_k must be an integer >= 0 (0 = no limit), got {self.top_k!r}")
        check(_finite(self.min_p) and 0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p!r}")
        lo, hi = REPETITION_PENALTY_RANGE
        check(_finite(self.repetition_penalty) and lo <= self.repetition_penalty <= hi,
              f"repetition_penalty must be in [{lo}, {hi:g}], got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            check(_finite(value) and -2.0 <= value <= 2.0, f"{name} must be in [-2, 2], got {value!r}")
        check(self.seed is None or (integer(self.seed) and SEED_RANGE[0] <= self.seed < SEED_RANGE[1]),
              f"seed must be an integer in [-2**63, 2**64), got {self.seed!r}")
        check(integer(self.n) and 1 <= self.n <= MAX_N, f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        check(isinstance(self.stop, list) and all(isinstance(s, str) for s in self.stop),
              "stop must be a list of strings")
        check(len(self.stop) <= MAX_STOP_STRINGS, f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for s in self.stop:
            check(0 < len(s) <= MAX_STOP_STRING_CHARS,
                  f"stop strings must have 1 to {MAX_STOP_STRING_CHARS} characters, got {len(s)}")
        check(isinstance(self.stop_token_ids, list) and all(integer(t) and t >= 0 for t in self.stop_token_ids),
              "stop_token_ids must be a list of non-negative integers")
        check(len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
              f"at most {MAX_STOP_TOKEN_IDS} stop token ids, got {len(self.stop_token_ids)}")
        check(self.logprobs is None or (integer(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
              f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        check(isinstance(self.ignore_eos, bool) and isinstance(self.skip_special_tokens, bool)
              and isinstance(self.speculative, bool),
              "ignore_eos, skip_special_tokens and speculative must be booleans")
        check(self.structured_output is None or isinstance(self.structured_output, StructuredOutput),
              "structured_output must be a StructuredOutput")
        check(not (self.structured_output and self.ignore_eos),
              "ignore_eos cannot be combined with structured output (a complete output ends with end-of-sequence)")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def replace(self, **changes) -> "SamplingParams":
        return dataclasses.replace(self, **changes)


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


__all__ = ["SamplingParams", "MAX_N", "MAX_LOGPROBS", "MAX_STOP_STRINGS"]
