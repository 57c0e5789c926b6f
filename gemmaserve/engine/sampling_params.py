"""How to pick each next token, and when to stop."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ..config.options import any_int, number, option, positive_int
from ..errors import UserInputError


@dataclass
class SamplingParams:
    max_tokens: int = option(64, parse=positive_int, help="most tokens to generate per prompt")
    temperature: float = option(0.0, parse=number, help="0 = greedy; higher = more random")
    top_p: float = option(1.0, parse=number, help="nucleus sampling: keep the smallest set of tokens with this much probability")
    top_k: int = option(0, parse=any_int, help="keep the k most likely tokens (0 = all)")
    seed: int | None = option(None, parse=any_int, help="per-request random seed (same seed, same output)")
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        def bad(msg: str) -> UserInputError:
            return UserInputError(msg)

        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise bad(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad(f"top_k must be an integer >= 0 (0 = no limit), got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise bad(f"seed must be an integer, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def replace(self, **changes) -> "SamplingParams":
        return dataclasses.replace(self, **changes)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
