"""The CPU's output head over a Q8_0 table (models/cpu_head.py): the 4-bit copy, the scan's bits against its
Python definition, row independence, and the refined tokens exact."""

from __future__ import annotations

import pytest
import torch

from gemmaserve.models import cpu_head, cpu_library
from gemmaserve.models.quant import QuantEmbedding, int8_blocks


@pytest.fixture(scope="module")
def table():
    gen = torch.Generator().manual_seed(3)
    v, k = 1003, 96   # not a whole number of 16-token tiles
    w = torch.randn(v, k, generator=gen) * 0.05
    w[7, :32] = 0     # an all-zero group: scale 0
    q8, s8 = int8_blocks(w)
    return q8, s8, cpu_head.pack(q8, s8), torch.randn(11, k, generator=gen) * 3


def test_the_4bit_copy_is_the_blocks_rounded_to_nearest(table):
    q8, s8, (packed, scales), _ = table
    q4, s4 = cpu_head.unpack(packed, scales, len(q8))
    w = (q8.float().view(len(q8), -1, 32) * s8.float()[..., None])
    want_s = (w.abs().amax(-1) / 7).half()
    assert torch.equal(s4, want_s) and s4[7, 0] == 0
    sf = want_s.float()[..., None]
    want_q = torch.where(sf > 0, torch.round(w / torch.where(sf > 0, sf, 1)), 0).clamp(-8, 7)
    assert torch.equal(q4.view_as(want_q).float(), want_q)
    assert int(q4.min()) >= -8 and int(q4.max()) <= 7 and int(q4.min()) < -5   # the range is used
    assert packed.shape == (-(-len(q8) // 16), 3 * 256) and scales[-1, :, 11:].abs().sum() == 0   # padding


def test_the_kernel_gives_its_definitions_bits_in_any_batch(table):
    """The C++ scan (the host's vector branch) equals the Python definition bit for bit; a row's logits are
    the same alone and inside batches of every size (blocks of 8 rows and the rest)."""
    assert cpu_library.load() is None
    q8, s8, (packed, scales), h = table
    scan = torch.ops.gemmaserve.head_logits(h, packed, scales, q8, s8, -1e9)   # nothing refined
    assert torch.equal(scan, cpu_head.scan_reference(h, packed, scales, len(q8)))
    full = torch.ops.gemmaserve.head_logits(h, packed, scales, q8, s8, 2.0)
    assert torch.equal(full, cpu_head.head_logits._init_fn(h, packed, scales, q8, s8, 2.0))
    for m in (1, 3, 8, 9):
        for at in (0, m - 1):
            alone = torch.ops.gemmaserve.head_logits(h[at:at + 1], packed, scales, q8, s8, 2.0)
            assert torch.equal(torch.ops.gemmaserve.head_logits(h[:m], packed, scales, q8, s8, 2.0)[at:at + 1], alone)


def test_tokens_near_the_top_are_exact_and_the_rest_within_the_scans_error(table):
    q8, s8, (packed, scales), h = table
    w8 = (q8.float().view(len(q8), -1, 32) * s8.float()[..., None]).view(q8.shape)
    exact = torch.ops.gemmaserve.rows_dot(h, w8.expand(len(h), *w8.shape).contiguous())
    got = torch.ops.gemmaserve.head_logits(h, packed, scales, q8, s8, 2.0)
    scan = torch.ops.gemmaserve.head_logits(h, packed, scales, q8, s8, -1e9)
    near = scan >= scan.amax(-1, keepdim=True) - 2.0
    assert near.sum() > len(h) and (~near).sum() > 0.5 * near.numel()
    assert torch.equal(got[near], exact[near]) and torch.equal(got[~near], scan[~near])
    assert torch.equal(got.argmax(-1), exact.argmax(-1))
    err = (scan - exact).abs().max()
    assert 0 < err < 0.25 * exact.abs().max()   # 4-bit groups of random weights: ~13% of the largest


def test_the_embedding_heads_by_the_scan_where_its_width_allows():
    gen = torch.Generator().manual_seed(4)
    wide = QuantEmbedding(torch.randn(300, 64, generator=gen))
    assert wide.head4 is not None and wide.head is None
    h = torch.randn(2, 3, 64, generator=gen)
    assert wide.as_head(h).shape == (2, 3, 300)
    narrow = QuantEmbedding(torch.randn(300, 40, generator=gen))   # the whole row is one Q8 block
    assert narrow.head4 is None and narrow.head is not None
    parts: dict = {}
    again = QuantEmbedding.from_parts(QuantEmbedding(torch.randn(300, 64, generator=gen), parts=parts) and parts)
    assert again.head4 is not None and torch.equal(again.head4[0], parts["head4_packed"])
    lookup = QuantEmbedding(torch.randn(300, 64, generator=gen), head=False)
    with pytest.raises(RuntimeError, match="lookups only"):
        lookup.as_head(h)
