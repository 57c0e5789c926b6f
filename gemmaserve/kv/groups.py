"""Layer groups and page geometry, derived from layer specs alone.

All pages have the same size in bytes (`page_bytes`), so one pool serves every group and memory moves
between groups freely. A layer's page holds `page_bytes / bytes_per_token` tokens: layers with fewer
bytes per token (Gemma 4's global layers: 4 KV heads x 512 vs 16 x 256) get more tokens per page
instead of wasted bytes. `--page-size` is the token count of the layers with the most bytes per token.

A group is the set of layers that share a life cycle (full, or sliding with window W) and a page
geometry (tokens per page). A *slot* of a group holds one logical block of a sequence for every
layer of the group: one page per layer. Layers that read another layer's KV own no pages; they
read through their source's column.

    Gemma 3 1B (26 layers, W=512):      group 0 sliding W=512  layers 0-4, 6-10, ... (22 layers)
                                        group 1 full           layers 5, 11, 17, 23 (4 layers)
    Gemma 4 31B (bf16, page_size 16):   group 0 sliding W=1024 16 tok/page (16 heads x 256)
                                        group 1 full           32 tok/page  (4 heads x 512)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .spec import AttentionKind, LayerSpec


@dataclass(frozen=True)
class KVGroup:
    index: int
    kind: AttentionKind
    window: int | None
    tokens_per_page: int
    layers: tuple[int, ...]      # model layers owning KV here; column j of a slot is layers[j]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def sliding(self) -> bool:
        return self.kind is AttentionKind.SLIDING

    def num_blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.tokens_per_page)


@dataclass(frozen=True)
class KVGeometry:
    groups: tuple[KVGroup, ...]
    page_bytes: int
    layer_slot: tuple[tuple[int, int], ...]   # per model layer: (group, column) it reads through
    hash_granularity: int                     # tokens per prefix-hash step (gcd of tokens per page)


def derive_groups(specs: list[LayerSpec], page_size: int) -> KVGeometry:
    owners = [i for i, s in enumerate(specs) if s.owns_kv]
    if not owners:
        raise ValueError("no layer stores KV")
    page_bytes = page_size * max(specs[i].bytes_per_token() for i in owners)
    keyed: dict[tuple, list[int]] = {}
    for i in owners:
        s = specs[i]
        tokens = page_bytes // s.bytes_per_token()
        keyed.setdefault((s.kind, s.window, tokens), []).append(i)
    groups = tuple(KVGroup(g, kind, window, tokens, tuple(layers))
                   for g, ((kind, window, tokens), layers) in enumerate(keyed.items()))
    where = {layer: (g.index, col) for g in groups for col, layer in enumerate(g.layers)}
    layer_slot = []
    for i, s in enumerate(specs):
        src = i if s.owns_kv else s.kv_source
        if src not in where:
            raise ValueError(f"layer {i} reads KV of layer {src}, which stores none")
        if not s.owns_kv and (specs[src].kind, specs[src].window) != (s.kind, s.window):
            raise ValueError(f"layer {i} shares KV with layer {src} of a different attention kind")
        layer_slot.append(where[src])
    return KVGeometry(groups, page_bytes, tuple(layer_slot), math.gcd(*(g.tokens_per_page for g in groups)))
