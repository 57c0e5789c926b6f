"""The fixed texts and prompts of `gemmaserve bench quality`, read from data/quality_texts.json (package data):
our own writing (for this benchmark, so no model has seen them verbatim). Perplexity, KL and argmax agreement
run over every passage (each scored from its start); greedy agreement over every prompt.

Twelve passages in different registers (story, science, instructions, letter, essay, news, a technical
explanation, Python code, a review, dialogue, travel): 6,306 tokens. Over the first alone (453 tokens) the
paired difference of two engines' log-likelihoods has a standard error of ~0.6% of perplexity, more than the
gaps it was asked to rank; over all twelve ~0.17%. Prompts: six at first, 18 added on 2026-12-04 (six decided
greedy agreement by one or two near-ties; 24 give a count), 45 on 2026-12-05 (agreement over 24 was still
decided by a few near-ties). The first passage and the first 24 prompts are the sets of the earlier sessions'
figures (BENCHMARKS.md quotes both).

In the file a passage is its lines (its text: each line followed by a newline), so that it reads and diffs as
prose; a prompt is one string."""

from __future__ import annotations

import json
from importlib.resources import files
from typing import NamedTuple


class QualityTexts(NamedTuple):
    passages: tuple[str, ...]
    prompts: tuple[str, ...]


def load() -> QualityTexts:
    data = json.loads(files(__package__).joinpath("data/quality_texts.json").read_text(encoding="utf-8"))
    passages = tuple("".join(line + "\n" for line in lines) for lines in data["passages"])
    return QualityTexts(passages, tuple(data["prompts"]))
