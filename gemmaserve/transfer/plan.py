"""What moves from a prefill engine to a decode engine: per layer, a token range of K and V.

The decode engine receives the prompt's first sampled token with the KV, so its first step runs the
query at position n (n = prompt length) and reads, per layer:

    full-attention layer           keys [0, n)                     every token
    sliding layer, window W        keys [n - W + 1, n)             the W - 1 tokens before the query
    KV-shared layer (Gemma 4)      nothing: it reads its source's KV, which is sent once

That is exactly what the sender's KV manager keeps for the next query, read from its layer groups
(never from model names): V2's sliding groups say "window W", so only the window tail travels; V1
has one full group with every layer, so every token of every layer travels. Out-of-window and
scratch pages are never read.

    n = 21, W = 8          token  0 ........ 13 14 ...... 20 | 21 (first decode query)
    full layer             sent   [================================]
    sliding layer (V2)     sent                  [=========]
    sliding layer (V1)     sent   [================================]

Wire format (`TransferPlan.nbytes`): for each span in layer order, K rows then V rows of tokens
[start, end), each row Hkv x D elements of the layer's KV dtype, as bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..kv.groups import KVGroup
from ..kv.spec import AttentionKind, LayerSpec


@dataclass(frozen=True)
class LayerSpan:
    layer: int
    start: int
    end: int

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class TransferPlan:
    num_tokens: int                     # prompt tokens whose KV the sender computed
    spans: tuple[LayerSpan, ...]        # owning layers only, in layer order

    def span_bytes(self, specs: list[LayerSpec]) -> list[int]:
        return [s.num_tokens * specs[s.layer].bytes_per_token() for s in self.spans]

    def nbytes(self, specs: list[LayerSpec]) -> int:
        return sum(self.span_bytes(specs))

    def to_dict(self) -> dict:
        return {"num_tokens": self.num_tokens, "spans": [[s.layer, s.start, s.end] for s in self.spans]}

    @classmethod
    def from_dict(cls, d: dict) -> "TransferPlan":
        return cls(int(d["num_tokens"]), tuple(LayerSpan(int(a), int(b), int(c)) for a, b, c in d["spans"]))


def plan_transfer(groups: tuple[KVGroup, ...], num_tokens: int) -> TransferPlan:
    """The KV a sender whose manager has `groups` ships for a prompt of `num_tokens` tokens."""
    spans = []
    for g in groups:
        start = max(0, num_tokens - g.window + 1) if g.sliding else 0
        spans.extend(LayerSpan(layer, start, num_tokens) for layer in g.layers)
    return TransferPlan(num_tokens, tuple(sorted(spans, key=lambda s: s.layer)))


def check_plan(plan: TransferPlan, specs: list[LayerSpec]) -> str | None:
    """Why a receiver with `specs` cannot run its next query from `plan`'s KV, or None."""
    by_layer = {s.layer: s for s in plan.spans}
    owners = [i for i, s in enumerate(specs) if s.owns_kv]
    if sorted(by_layer) != owners:
        return f"the sender sends KV of layers {sorted(by_layer)}, this engine stores layers {owners}"
    n = plan.num_tokens
    for i in owners:
        span, spec = by_layer[i], specs[i]
        need = 0 if spec.kind is AttentionKind.FULL else max(0, n - spec.window + 1)
        if span.end != n or span.start > need:
            return f"layer {i} needs tokens [{need}, {n}); the sender sends [{span.start}, {span.end})"
    return None


def spec_signature(specs: list[LayerSpec]) -> list[list]:
    """What both engines must agree on for the bytes to mean the same thing (JSON-friendly)."""
    return [[s.kind.value, s.num_kv_heads, s.head_dim, str(s.dtype).removeprefix("torch."), s.window, s.kv_source,
             s.k_scale, s.v_scale] for s in specs]
