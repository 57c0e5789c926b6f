"""rowops: argmax / top-k through block maxima give torch's own answers (ties: the first maximum)."""

import pytest
import torch
from helpers import fresh_seed

from gemmaserve.rowops import _block, row_argmax, row_topk_indices


@pytest.mark.parametrize("width", [262144, 262208, 3 * 16384, 20000, 300])
@pytest.mark.parametrize("rows", [1, 8])
def test_argmax_and_topk_equal_torch(width, rows):
    gen = torch.Generator().manual_seed(fresh_seed())
    x = torch.randn(rows, width, generator=gen)
    assert torch.equal(row_topk_indices(x, 32), x.topk(32, dim=-1).indices)
    k = min(1024, width)   # the 4-bit head scan's refinement: smaller blocks (randn ties: compare values)
    assert torch.equal(x.gather(1, row_topk_indices(x, k)), x.topk(k, dim=-1).values)
    # ties: two equal maxima in different blocks and in one block; argmax keeps the first
    x[0, width - 3] = x[0, 9] = x[0, 10] = x[0].max() + 1
    assert torch.equal(row_argmax(x), x.max(dim=-1).indices)
    assert int(row_argmax(x)[0]) == 9
    got = row_topk_indices(x, 16)
    assert torch.equal(x.gather(1, got), x.topk(16, dim=-1).values)


def test_blocked_path_is_taken_and_handles_nan_and_constant_rows():
    assert _block(262144) == 512 and _block(262208) == 64 and _block(20000) == 32 and _block(300) == 0
    x = torch.randn(3, 262144, generator=torch.Generator().manual_seed(fresh_seed()))
    x[1, 777] = float("nan")
    x[2] = 0.5
    assert torch.equal(row_argmax(x), x.max(dim=-1).indices)
    assert row_argmax(x).tolist()[1:] == [777, 0]
