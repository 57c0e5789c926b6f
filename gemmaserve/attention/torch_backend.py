"""Reference attention in plain torch (CPU and GPU): gather K/V through page tables, then SDPA.

KV storage per layer is [num_pages * page_size, Hkv, D] (slot-indexed). For each batch and each
(table, window) pair the backend builds a gather plan once and reuses it for every layer with the
same table and window:

* decode rows (one new token each) are batched: keys padded to the longest row, padding masked;
* rows with several new tokens (prefill chunks) run one by one with a causal/window mask.

Only keys a query can see are gathered: a sliding layer reads the last `window` positions, not the
whole history.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..kv.spec import LayerSpec
from .base import AttentionBackend, AttentionMetadata, BackendCapabilities, BatchAttention


@dataclass
class _DecodePlan:
    token_rows: torch.Tensor   # [B] row of each decode token in q
    key_slots: torch.Tensor    # [B, K] slots to gather (padding repeats a valid slot)
    mask: torch.Tensor | None  # [B, 1, 1, K] True = visible; None if no padding


@dataclass
class _PrefillPlan:
    start: int
    end: int
    key_slots: torch.Tensor    # [K]
    mask: torch.Tensor | None  # [n, K] True = visible; None if plain full view


@dataclass
class _Plan:
    decode: _DecodePlan | None = None
    prefill: list[_PrefillPlan] = field(default_factory=list)


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """[n, K] mask: key k is visible to query q iff k <= q and k > q - window."""
    diff = q_pos[:, None] - k_pos[None, :]
    mask = diff >= 0
    if window is not None:
        mask &= diff < window
    return mask


class TorchBatchAttention(BatchAttention):
    def __init__(self, md: AttentionMetadata, kv_cache: list[tuple[torch.Tensor, torch.Tensor]],
                 specs: list[LayerSpec]):
        self.md = md
        self.kv_cache = kv_cache
        self.specs = specs
        self.device = kv_cache[0][0].device if kv_cache else torch.device("cpu")
        self._plans: dict[tuple[int, int | None], _Plan] = {}
        starts = [0]
        for n in md.query_lens:
            starts.append(starts[-1] + n)
        self._starts = starts

    def _slots(self, table: int, seq: int, first_pos: int, end_pos: int) -> torch.Tensor:
        """Slots (on the CPU) of positions [first_pos, end_pos) of a sequence."""
        pages = torch.tensor(self.md.page_tables[table][seq])
        pos = torch.arange(first_pos, end_pos)
        ps = self.md.page_size
        return pages[pos // ps] * ps + pos % ps

    def _plan(self, table: int, window: int | None) -> _Plan:
        key = (table, window)
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        plan = _Plan()
        md, dev = self.md, self.device
        decode_rows, decode_slots, decode_lens = [], [], []
        for b, (n, seq_len) in enumerate(zip(md.query_lens, md.seq_lens)):
            first_q = seq_len - n
            first_k = 0 if window is None else max(0, first_q - window + 1)
            slots = self._slots(table, b, first_k, seq_len)
            if n == 1:
                decode_rows.append(self._starts[b])
                decode_slots.append(slots)
                decode_lens.append(len(slots))
                continue
            mask = visible(torch.arange(first_q, seq_len), torch.arange(first_k, seq_len), window)
            plan.prefill.append(_PrefillPlan(self._starts[b], self._starts[b] + n, slots.to(dev), mask.to(dev)))
        if decode_rows:
            width = max(decode_lens)
            padded = torch.stack([F.pad(s, (0, width - len(s)), value=int(s[-1])) for s in decode_slots])
            mask = None
            if min(decode_lens) != width:
                lens = torch.tensor(decode_lens)
                mask = (torch.arange(width)[None, :] < lens[:, None])[:, None, None, :].to(dev)
            plan.decode = _DecodePlan(torch.tensor(decode_rows, device=dev),
                                      padded.to(dev), mask)
        self._plans[key] = plan
        return plan

    def __call__(self, layer, q, k, v, *, scale, window, softcap=None):
        if softcap is not None:
            raise NotImplementedError("attention soft-capping is not used by Gemma 3/4 text models")
        table = self.md.layer_table[layer]
        k_cache, v_cache = self.kv_cache[layer]
        if self.specs[layer].owns_kv:
            slots = self.md.slot_mapping[table]
            k_cache.index_copy_(0, slots, k.to(k_cache.dtype))
            v_cache.index_copy_(0, slots, v.to(v_cache.dtype))
        plan = self._plan(table, window)
        out = torch.empty_like(q)
        gqa = q.shape[1] != k_cache.shape[1]
        if plan.decode is not None:
            d = plan.decode
            kk = k_cache[d.key_slots].transpose(1, 2)  # [B, Hkv, K, D]
            vv = v_cache[d.key_slots].transpose(1, 2)
            qq = q[d.token_rows].unsqueeze(2)          # [B, Hq, 1, D]
            o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=d.mask, scale=scale, enable_gqa=gqa)
            out[d.token_rows] = o.squeeze(2)
        for p in plan.prefill:
            kk = k_cache[p.key_slots].transpose(0, 1).unsqueeze(0)  # [1, Hkv, K, D]
            vv = v_cache[p.key_slots].transpose(0, 1).unsqueeze(0)
            qq = q[p.start:p.end].transpose(0, 1).unsqueeze(0)      # [1, Hq, n, D]
            o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=p.mask, scale=scale, enable_gqa=gqa)
            out[p.start:p.end] = o[0].transpose(0, 1)
        return out


class TorchAttentionBackend(AttentionBackend):
    capabilities = BackendCapabilities(
        name="torch", devices=frozenset({"cpu", "cuda"}), head_dims=None, scratch_pages=True)

    def __init__(self) -> None:
        self._specs: list[LayerSpec] = []

    def allocate_kv_cache(self, specs, num_pages, page_size, device):
        self._specs = list(specs)
        caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        for spec in specs:
            if not spec.owns_kv:
                caches.append(caches[spec.kv_source])
                continue
            shape = (num_pages * page_size, spec.num_kv_heads, spec.head_dim)
            # empty, not zeros: untouched pages cost no RAM on the CPU until first written.
            caches.append((torch.empty(shape, dtype=spec.dtype, device=device),
                           torch.empty(shape, dtype=spec.dtype, device=device)))
        return caches

    def begin_batch(self, metadata, kv_cache):
        return TorchBatchAttention(metadata, kv_cache, self._specs)
