"""LoRA's segment kernels (models/lora_triton.py) against the grouped reference `_lora_add` in float64: random
shapes off the block sizes, several slots of several ranks, rows without an adapter, a fused 3-part
projection's block-diagonal B; each row's bits the same alone as in a mixed batch; a wrong slot mapping is
caught. Then the stacked layout end to end: a tiny model's logits through the runner's stacked slots equal
the host layout's. On the CPU the kernels run in Triton's interpreter (fp32, small shapes); with a GPU the
same tests run there, plus bf16."""

from __future__ import annotations

import pytest
import torch

from helpers import fresh_seed

pytest.importorskip("triton")
pytestmark = pytest.mark.usefixtures("row_invariant_dot")   # bitwise row checks (conftest.py)
from gemmaserve.models import lora_triton  # noqa: E402
from gemmaserve.models.lora import LoRABatch, LoRAWeights, SlotWeights, _lora_add  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _adapters(gen, num_slots: int, in_features: int, parts: tuple[int, ...], ranks: list[int], allot: int,
              dtype=torch.float32):
    """Per slot an adapter of stacked rank ranks[slot] split over the parts (B block-diagonal, as
    lora_adapter._stack makes it), in a module's stacked slots of `allot` ranks; and the same as SlotWeights."""
    module = torch.nn.Linear(in_features, sum(parts))
    weights = LoRAWeights(num_slots)
    weights.allocate(module, allot, in_features, sum(parts), dtype, DEVICE)
    host = {}
    for slot, r in enumerate(ranks):
        a = torch.randn(r, in_features, generator=gen)
        b = torch.zeros(sum(parts), r)
        cuts = [r * j // len(parts) for j in range(len(parts) + 1)]   # part j's ranks: cuts[j]..cuts[j+1]
        row = 0
        for j, rows in enumerate(parts):
            b[row:row + rows, cuts[j]:cuts[j + 1]] = torch.randn(rows, cuts[j + 1] - cuts[j], generator=gen)
            row += rows
        weights.write(slot, module, a, b)
        host[slot] = SlotWeights(a.double(), b.double())
    return module, weights, host


def _reference(y, x, host, segments) -> torch.Tensor:
    """`_lora_add` over the slots' rows, in float64."""
    by_slot: dict[int, list[int]] = {}
    for start, end, slot in segments:
        by_slot.setdefault(slot, []).extend(range(start, end))
    rows = [torch.tensor(r) for r in by_slot.values()]
    return _lora_add(y.double(), x.double(), rows, [host[s].a for s in by_slot], [host[s].b.t() for s in by_slot])


def _slot_tensor(segments, rows: int) -> torch.Tensor:
    slots = torch.full((rows,), -1, dtype=torch.int32)
    for start, end, slot in segments:
        slots[start:end] = slot
    return slots.to(DEVICE)


@pytest.mark.parametrize("in_features, parts, ranks, allot", [
    (2100, (30, 20, 20), [6, 3, 12, 9], 24),   # two input splits, a fused 3-part B, ranks below the allotment
    (40, (100,), [70, 16, 33], 96),            # two rank blocks, outputs across two column blocks
])
def test_kernels_equal_the_grouped_reference(in_features, parts, ranks, allot):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    module, weights, host = _adapters(gen, len(ranks), in_features, parts, ranks, allot)
    rows = 37   # three row blocks, the last partial
    segments = [(0, 5, 2), (7, 19, 0), (19, 20, len(ranks) - 1), (20, 33, 1), (34, 37, 0)]   # 5, 6, 33: none
    x = torch.randn(rows, in_features, generator=gen)
    y = torch.randn(rows, sum(parts), generator=gen)
    want = _reference(y, x, host, segments)
    stack = weights.stacked[module]
    got = lora_triton.lora_add(y.to(DEVICE), x.to(DEVICE), stack.a, stack.bt, _slot_tensor(segments, rows)).cpu()
    err = ((got.double() - want).abs().max() / want.abs().max()).item()
    assert err < 1e-5, f"seed={seed}: {err}"
    for free in (5, 6, 33):
        assert torch.equal(got[free], y[free])   # rows without an adapter: untouched bits
    # The check can fail: the same rows with two slots swapped are far off.
    swapped = [(s, e, {0: 1, 1: 0}.get(slot, slot)) for s, e, slot in segments]
    wrong = lora_triton.lora_add(y.to(DEVICE), x.to(DEVICE), stack.a, stack.bt, _slot_tensor(swapped, rows)).cpu()
    assert ((wrong.double() - want).abs().max() / want.abs().max()).item() > 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    DEVICE.type != "cuda", reason="bf16 tl.dot: the GPU (the interpreter's numpy has no bf16 products)"))])
def test_a_rows_delta_is_the_same_bits_alone_and_in_any_batch(dtype):
    """Through `LoRABatch.add`'s dispatch (the stacked layout): rows alone (a batch of one), and in batches of
    other sizes and neighbours, against the mixed batch."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    module, weights, host = _adapters(gen, 3, 150, (50, 30, 30), [9, 4, 15], 24, dtype)
    rows = 40
    segments = [(0, 17, 1), (17, 18, 0), (19, 31, 2), (31, 40, 1)]   # row 18: no adapter
    x = torch.randn(rows, 150, generator=gen).to(DEVICE, dtype)
    y = torch.randn(rows, 110, generator=gen).to(DEVICE, dtype)
    mixed = LoRABatch.from_segments(weights, segments, DEVICE, rows)
    assert mixed.slots is not None and not mixed.rows   # the stacked layout's batch
    got = mixed.add(module, x, y.clone())
    assert torch.equal(got[18], y[18])
    for row, slot in [(0, 1), (16, 1), (17, 0), (19, 2), (30, 2), (39, 1)]:
        alone = LoRABatch.from_segments(weights, [(0, 1, slot)], DEVICE, 1)
        assert torch.equal(alone.add(module, x[row:row + 1], y[row:row + 1].clone())[0], got[row]), (seed, row)
    # Another batch: the rows reversed, a different size, taken in row order (not sorted by slot: blocks of
    # three slots each, where the mixed batch had blocks of one or two).
    order = torch.arange(rows - 1, 2, -1, device=DEVICE)
    identity = torch.arange(len(order), dtype=torch.int32, device=DEVICE)
    flipped = LoRABatch(weights, {}, mixed.slots[order], order=identity, present=mixed.present)
    assert torch.equal(flipped.add(module, x[order], y[order].clone()), got[order]), seed
    if dtype == torch.bfloat16:   # near the fp64 reference (rounded as two bf16 products are)
        want = _reference(y.float().cpu(), x.float().cpu(), host, segments)
        assert ((got.double().cpu() - want).abs().max() / want.abs().max()).item() < 2e-2


def test_select_narrows_the_slot_tensor_on_the_device():
    """`select` (Gemma 4 keeps only the sampled rows past its KV-shared layers): a gather, no host sync; the rows
    it keeps get the same deltas as in the whole batch."""
    gen = torch.Generator().manual_seed(fresh_seed())
    module, weights, _ = _adapters(gen, 2, 24, (20,), [4, 7], 8)
    segments = [(0, 6, 1), (9, 12, 0)]
    batch = LoRABatch.from_segments(weights, segments, DEVICE, 12)
    x = torch.randn(12, 24, generator=gen).to(DEVICE)
    y = torch.randn(12, 20, generator=gen).to(DEVICE)
    full = batch.add(module, x, y.clone())
    keep = torch.tensor([5, 7, 11], device=DEVICE)
    narrow = batch.select(keep)
    assert narrow.slots.tolist() == [1, -1, 0] and narrow.order.tolist() == [2, 0, 1]
    assert torch.equal(narrow.add(module, x[keep], y[keep].clone()), full[keep])


def test_stacked_slots_are_written_in_place_and_cleared_to_zero():
    gen = torch.Generator().manual_seed(fresh_seed())
    module, weights, _ = _adapters(gen, 3, 16, (8, 8), [6, 2, 4], 8)
    stack = weights.stacked[module]
    a_ptr, b_ptr = stack.a.data_ptr(), stack.bt.data_ptr()
    weights.write(1, module, torch.ones(5, 16), torch.ones(16, 5))   # a higher rank into a lower one's slot
    assert stack.a[1, :5].eq(1).all() and stack.a[1, 5:].eq(0).all() and stack.bt[1, 5:].eq(0).all()
    weights.clear(1)
    assert stack.a[1].eq(0).all() and stack.bt[1].eq(0).all() and stack.held == {0, 2}
    assert (stack.a.data_ptr(), stack.bt.data_ptr()) == (a_ptr, b_ptr)
    with pytest.raises(ValueError):
        weights.write(0, module, torch.ones(9, 16), torch.ones(16, 9))   # above the allotment


@pytest.mark.skipif(DEVICE.type == "cuda", reason="paged_logits runs on the CPU (the kernels in the interpreter); "
                    "on a GPU the engine check of benchmarks/gpu_lora.py covers this")
def test_a_tiny_models_logits_through_the_stacked_slots_equal_the_host_layouts(tmp_path):
    """The runner's stacked slots (lazily allocated, written from a PEFT adapter) and the kernels, through a
    whole Gemma 3 forward with a fused 3-part qkv: logits equal the host layout's (the C++ op)."""
    from gemmaserve.bench.lora import write_random_adapter
    from gemmaserve.engine.lora import RunnerLoRA, stacked_bytes
    from gemmaserve.engine.step import LoRALoad
    from gemmaserve.models import cpu_library

    from helpers import ours_from_hf, paged_logits, tiny_hf_model

    cpu_library.load()
    seed = fresh_seed()
    model = ours_from_hf(tiny_hf_model(seed, num_hidden_layers=2))
    cpu = torch.device("cpu")
    runners = {stacked: RunnerLoRA(model, cpu, 2, 8, 2, stacked=stacked) for stacked in (True, False)}
    for slot in (0, 1):
        write_random_adapter(model, tmp_path / f"a{slot}", rank=4 + 4 * slot, seed=seed + slot)
        for runner in runners.values():
            runner.load(LoRALoad(slot, f"a{slot}", str(tmp_path / f"a{slot}"), None))
    assert runners[True].weights.stacked and not runners[False].weights.stacked
    assert not runners[True].weights.by_module
    # what the engine keeps out of the KV budget for them on CUDA
    assert runners[True].weights.nbytes == stacked_bytes(model, 2, 8, torch.float32)
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(3, 300, (n,), generator=gen).tolist() for n in (9, 5, 7)]
    slots = [1, -1, 0]
    got = paged_logits(model, seqs, chunk=4, lora=(runners[True].weights, slots))
    want = paged_logits(model, seqs, chunk=4, lora=(runners[False].weights, slots))
    base = paged_logits(model, seqs, chunk=4)
    for g, w, b, slot in zip(got, want, base, slots):
        assert (g - w).abs().max().item() < 1e-5 * max(1.0, w.abs().max().item())
        assert slot < 0 or (w - b).abs().max().item() > 1e-2   # the adapters matter


def test_gpu_lora_bench_runs_on_a_tiny_model_on_the_cpu(tmp_path, monkeypatch):
    """`python -m benchmarks.gpu_lora --device cpu --tiny`: the base row and one row per adapter count,
    each ratio against the base of the same run, the JSON written."""
    import json

    from benchmarks import gpu_lora

    monkeypatch.setenv("OUT", str(tmp_path))
    assert gpu_lora.main(["throughput", "--device", "cpu", "--tiny", "--batch", "3", "--prompt", "8", "--new", "2",
                          "--adapters", "1,2", "--rank", "4"]) == 0
    rows = json.loads((tmp_path / "gpu_lora.json").read_text())["throughput"]
    assert [(r["config"], r["adapters"]) for r in rows] == [("base", 0), ("1 adapters", 1), ("2 adapters", 2)]
    assert rows[0]["ratio"] == 1.0 and all(r["out_tok_s"] > 0 and r["ratio"] > 0 for r in rows)
