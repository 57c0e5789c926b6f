"""The runner's media: each unfinished request's images and clips, and their rows of a step's embeddings.

A request's items arrive with its `NewRequest`. A step whose chunk covers an item's tokens embeds the
tokens itself and overwrites those rows with the item's soft tokens, encoded the first time a chunk
covers the item and kept (EncoderCache) for every later chunk. Items of a modality are encoded together
(a repeated one once) unless `alone`: batch-invariant engines (every CPU engine) encode each item by
itself, so its soft tokens never depend on what else a step encodes (the towers' products run on the
BLAS, whose rounding follows the rows of the call).
"""

from __future__ import annotations

import torch
from torch import nn

from ...device import to_device
from ..step import SeqStep
from .encoder_cache import EncoderCache
from .items import MediaItem


class RunnerMedia:
    def __init__(self, cache_bytes: int, device: torch.device, alone: bool):
        self.device = device
        self.alone = alone
        self.items: dict[str, list[MediaItem]] = {}   # unfinished request -> its items, in prompt order
        self.cache = EncoderCache(cache_bytes)

    def __len__(self) -> int:
        """Requests holding media (a step looks for covered items only when there are any)."""
        return len(self.items)

    def add(self, req_id: str, items: list[MediaItem]) -> None:
        if items:
            self.items[req_id] = items

    def release(self, req_id: str) -> None:
        self.items.pop(req_id, None)
        self.cache.release(req_id)

    def covered(self, s: SeqStep) -> list[MediaItem]:
        """The images and clips of `s`'s request that its chunk covers (in part)."""
        end = s.start + s.num_new_tokens
        return [it for it in self.items.get(s.req_id, ()) if it.start < end and it.end > s.start]

    def embeds(self, model: nn.Module, seqs: list[SeqStep], input_ids: torch.Tensor) -> torch.Tensor | None:
        """Token embeddings with the rows of images and clips replaced by soft tokens, or None if no chunk
        covers one. Items not seen before are encoded once, those of a modality in one encoder call."""
        covered = [(b, i, im) for b, s in enumerate(seqs) for i, im in enumerate(self.items.get(s.req_id, ()))
                   if im.start < s.start + s.num_new_tokens and im.end > s.start]
        if not covered:
            return None
        cache = self.cache
        found = {(b, i): cache.get(seqs[b].req_id, i, im.key) for b, i, im in covered}
        todo = {im.key: im for b, i, im in covered if found[(b, i)] is None}
        fresh: dict[str, torch.Tensor] = {}
        groups = [{k: im} for k, im in todo.items()] if self.alone else \
            [{k: im for k, im in todo.items() if im.modality is m} for m in dict.fromkeys(im.modality for im in todo.values())]
        for items in groups:
            modality = next(iter(items.values())).modality
            out = model.encode_media(modality, [im.data for im in items.values()],
                                     [im.extra for im in items.values()], self.device)
            fresh.update(zip(items, out))
        cache.encoded += len(todo)
        for (b, i), tokens in found.items():
            if tokens is None:
                key = self.items[seqs[b].req_id][i].key
                found[(b, i)] = fresh[key]
                cache.put(seqs[b].req_id, i, key, fresh[key])
        embeds = model.embed(input_ids)
        rows, parts, first = [], [], 0
        for b, s in enumerate(seqs):
            for bb, i, im in covered:
                if bb != b:
                    continue
                lo, hi = max(im.start, s.start), min(im.end, s.start + s.num_new_tokens)
                rows.append(torch.arange(first + lo - s.start, first + hi - s.start))
                parts.append(found[(b, i)][lo - im.start:hi - im.start])
            first += s.num_new_tokens
        embeds[to_device(torch.cat(rows), torch.long, self.device)] = torch.cat(parts).to(embeds.dtype)
        return embeds
