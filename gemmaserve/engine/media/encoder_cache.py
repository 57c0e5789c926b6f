"""Encoder outputs (soft tokens) of images and audio clips, so each is encoded once (seed 001: not once per
prefill chunk that covers it).

    per request: item index -> soft tokens, held until the request finishes (every chunk reuses them)
    shared:      content key -> soft tokens, LRU within `capacity_bytes` (repeated items skip the encoder)
"""

from __future__ import annotations

from collections import OrderedDict

import torch


class EncoderCache:
    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self._shared: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._shared_bytes = 0
        self._held: dict[str, dict[int, torch.Tensor]] = {}
        self.encoded = 0            # items run through an encoder (tests and metrics read it)
        self.shared_hits = 0

    def get(self, req_id: str, index: int, key: str) -> torch.Tensor | None:
        held = self._held.get(req_id, {})
        if index in held:
            return held[index]
        out = self._shared.get(key)
        if out is not None:
            self._shared.move_to_end(key)
            self.shared_hits += 1
            self._held.setdefault(req_id, {})[index] = out
        return out

    def put(self, req_id: str, index: int, key: str, tokens: torch.Tensor) -> None:
        self._held.setdefault(req_id, {})[index] = tokens
        size = tokens.numel() * tokens.element_size()
        if key in self._shared or size > self.capacity_bytes:
            return
        self._shared[key] = tokens
        self._shared_bytes += size
        while self._shared_bytes > self.capacity_bytes:
            _, old = self._shared.popitem(last=False)
            self._shared_bytes -= old.numel() * old.element_size()

    def release(self, req_id: str) -> None:
        self._held.pop(req_id, None)
