"""Tensor parallelism over quantised weights: compressed-tensors W4A16 (g32 symmetric, g128 with zero points) and FP8
(per channel, 128x128 blocks) checkpoints, and --quantization fp8 at load, on two CPU ranks (two spawned processes,
gloo) against one process loading the same checkpoint.

  (a) each rank's weights are exactly its slice of the tp=1 weights (scales and zero points included);
  (b) logits: W4A16 and block FP8 equal tp=1 to fp32 summation order (each product is an exact sum of the ranks'
      products); per-channel FP8 (a checkpoint's, and --quantization fp8) equals, to summation order, tp=1 with its
      row-parallel modules' activations quantised per token in two groups of K/2 columns (what two ranks do with
      their slices, models/quantized_shards.py), and stays within a stated bound of plain tp=1;
  (c) a share that cuts through a packed element (int4 scale groups, zero points packed 8 rows a word, fp8 blocks)
      is a UserInputError naming the tensor, raised before any weight is read;
  (d) the engine end to end: LLM(tensor_parallel_size=2, quantization="fp8") (the config once refused it).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from gemmaserve.errors import UserInputError
from gemmaserve.models.loader import load_model
from gemmaserve.models.tensor_parallel import TensorParallelShard
from gemmaserve.quantization.fp8_kernels import dequantize_activations, quantize_activations_torch

from helpers import paged_logits, save_checkpoint, tiny_hf_model
from test_quantized_checkpoints import FORMATS, TEXT, write_quantized

CPU = torch.device("cpu")
# Two ranks' shares that align with every element: q 512 / k, v 256 rows (heads of 128), intermediate 512; each rank
# 256 q, 128 k/v rows and 256 input columns of o_proj and down_proj (multiples of 8, 32, 128 and fp8's 128 blocks).
TEXT_TP = dict(hidden_size=128, intermediate_size=512, head_dim=128, num_attention_heads=4, num_key_value_heads=2,
               num_hidden_layers=2, vocab_size=300)
IDS = [2, 40, 51, 62, 73, 84, 95, 106, 117, 128, 139, 150, 161]
CASES = {name: (name, "auto") for name in FORMATS} | {"fp8_online": ("bf16", "fp8")}
PER_CHANNEL = ("fp8_channel", "fp8_online")   # activations quantised per token over K: a rank sees K / 2
LAYER = "model.layers.1"
MODULES = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("qtp")
    out = {name: write_quantized(tiny_hf_model(3, **TEXT_TP).to(torch.bfloat16), root / name, scheme, fmt)
           for name, (scheme, fmt) in FORMATS.items()}
    out["bf16"] = save_checkpoint(tiny_hf_model(3, **TEXT_TP).to(torch.bfloat16), root / "bf16")
    return out


def _weights(model) -> dict[str, torch.Tensor]:
    """Layer 1's projections as the products multiply by (fp32), unwrapped from their collectives."""
    out = {}
    for name in MODULES:
        m = model.get_submodule(f"{LAYER}.{name}")
        out[name] = getattr(m, "inner", m).dequantize().float()
    return out


def _run_rank(rank: int, world: int, port: int, cases: list[tuple[str, str, str]], out: str) -> None:
    """One rank (a spawned process): every case loaded as this rank's shard, its logits and layer 1's weights."""
    from datetime import timedelta

    import torch.distributed as dist

    from gemmaserve.models.tensor_parallel import DistributedCommunicator, local_kv_heads

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        shard = TensorParallelShard(rank, world, DistributedCommunicator(None, rank, world))
        results = {}
        for name, path, quantization in cases:
            model = load_model(path, torch.float32, CPU, shard=shard, quantization=quantization).model
            specs = [dataclasses.replace(s, num_kv_heads=local_kv_heads(s.num_kv_heads, world))
                     for s in model.kv_layer_specs(torch.float32)]
            results[name] = (paged_logits(model, [IDS], specs=specs)[0], _weights(model))
        torch.save(results, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(checkpoints, tmp_path_factory):
    """Every case on two ranks in one pair of processes: {case: [(logits, weights) of rank 0, of rank 1]}."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("ranks")
    cases = [(case, str(checkpoints[ckpt]), quantization) for case, (ckpt, quantization) in CASES.items()]
    store = dist.TCPStore("127.0.0.1", 0, 3, is_master=True, wait_for_workers=False)   # this process + 2 ranks
    mp.spawn(_run_rank, args=(2, store.port, cases, str(out)), nprocs=2, join=True)
    ranks = [torch.load(out / f"rank{r}.pt") for r in range(2)]
    return {case: [ranks[0][case], ranks[1][case]] for case in CASES}


def _one_rank(path: Path, quantization: str, activations: str = "scheme"):
    """tp=1: its logits and layer 1's weights. `activations` of the FP8 products: "scheme" as the format says (per
    token over all of K); "halves": o_proj and down_proj quantise each token's activations in two groups of K/2
    columns (what each of two ranks does with its slice), the rest as the scheme says; "float": not quantised."""
    model = load_model(str(path), torch.float32, CPU, quantization=quantization).model
    for layer in model.model.layers if activations != "scheme" else []:
        for mod in (layer.self_attn.o_proj, layer.mlp.down_proj) if activations == "halves" else \
                (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            mod.forward = _forward(mod, mod.in_features // 2 if activations == "halves" else None)
    return paged_logits(model, [IDS])[0], _weights(model)


def _forward(mod, group: int | None):
    """`mod`'s product with activations quantised per token in groups of `group` columns (None: unquantised)."""
    w = mod.dequantize()

    def forward(x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        if group is not None:
            x2 = dequantize_activations(*quantize_activations_torch(x2, group), group)
        return mod.matmul(x2, w).view(*x.shape[:-1], -1)

    return forward


def _rank_slices(full: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    """Rank `rank` of 2's slices of TEXT_TP's layer weights, written out (not through ShardPlan)."""
    q, kv, inter = 512, 256, 512
    rows = lambda lo, n: slice(lo + rank * n // 2, lo + (rank + 1) * n // 2)   # noqa: E731
    qkv = full["self_attn.qkv_proj"]
    gate_up = full["mlp.gate_up_proj"]
    return {"self_attn.qkv_proj": torch.cat([qkv[rows(0, q)], qkv[rows(q, kv)], qkv[rows(q + kv, kv)]]),
            "self_attn.o_proj": full["self_attn.o_proj"][:, rows(0, q)],
            "mlp.gate_up_proj": torch.cat([gate_up[rows(0, inter)], gate_up[rows(inter, inter)]]),
            "mlp.down_proj": full["mlp.down_proj"][:, rows(0, inter)]}


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_hold_exact_slices_and_match_one(checkpoints, two_ranks, case):
    ckpt, quantization = CASES[case]
    plain, full = _one_rank(checkpoints[ckpt], quantization)
    for rank, (_, weights) in enumerate(two_ranks[case]):   # (a)
        for name, want in _rank_slices(full, rank).items():
            assert torch.equal(weights[name], want), (case, rank, name)
    got = [logits for logits, _ in two_ranks[case]]
    assert torch.equal(got[0], got[1])   # every rank gathers the same logits
    scale = plain.abs().max().item()
    diff = (got[0] - plain).abs().max().item()
    if case not in PER_CHANNEL:   # (b) exact math: fp32 summation order only
        assert diff < 2e-5 * scale
        return
    halves, _ = _one_rank(checkpoints[ckpt], quantization, "halves")
    assert (got[0] - halves).abs().max().item() < 2e-5 * scale
    # Against plain tp=1 (the scheme's single activation scale per token): on these tiny random models a token's
    # scale from half its row moves the logits by about as much as quantising the activations at all does (measured
    # over seeds: 0.9x to 1.5x, ~10% of the logits' range, both). Bounded by twice that; and tp=2 is no farther
    # from unquantised activations than tp=1 is, beyond that noise.
    unquantised, _ = _one_rank(checkpoints[ckpt], quantization, "float")
    own = (plain - unquantised).abs().max().item()
    assert 1e-3 * scale < diff < 2 * own, (diff, own)
    assert (got[0] - unquantised).abs().max().item() < 1.5 * own


# -- (c) shares that cut through a packed element -------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _NoCollectives:
    """A rank's communicator for loads that must fail before any collective."""
    rank: int = 0
    world_size: int = 2

    def all_reduce(self, x):
        raise AssertionError("a collective ran before the error")

    all_gather_last = broadcast_first = all_reduce


W4A16_G32_ASYM = dict(weights=dict(num_bits=4, type="int", strategy="group", group_size=32, symmetric=False))


@pytest.mark.parametrize("scheme, fmt, text, words", [
    # k_proj: 4 KV heads of 32, 64 rows a rank: half an fp8 block of 128 rows.
    ("fp8_block", None, TEXT, r"model\.layers\.0\.self_attn\.k_proj\.weight_scale: tensor-parallel rank 0 of 2 would "
                              r"hold its weight's rows 0\.\.64 of 128, which cuts through its fp8 blocks of 128x128"),
    # o_proj: 128 input columns, 64 a rank: half a scale group of 128.
    ("w4a16_g128_asym", None, TEXT, r"self_attn\.o_proj\.weight_scale: .* columns 0\.\.64 of 128, which cuts through "
                                    r"its scale groups \(128 columns each; w4a16 g128 asym"),
    # k_proj: 2 KV heads of 12 rows, one a rank: zero points are packed 8 rows a word.
    ("w4a16_g32_asym", (W4A16_G32_ASYM, "pack-quantized"),
     dict(TEXT, hidden_size=64, head_dim=12, num_attention_heads=8, num_key_value_heads=2),
     r"self_attn\.k_proj\.weight_zero_point: .* rows 0\.\.12 of 24, which cuts through its zero points packed eight "
     r"rows per int32 \(8 rows each"),
])
def test_misaligned_shares_are_refused(tmp_path, scheme, fmt, text, words):
    scheme_args, fmt_name = fmt or FORMATS[scheme]
    path = write_quantized(tiny_hf_model(5, **text).to(torch.bfloat16), tmp_path / scheme, scheme_args, fmt_name)
    with pytest.raises(UserInputError, match=words):
        load_model(str(path), torch.float32, CPU, shard=TensorParallelShard(0, 2, _NoCollectives()))
    load_model(str(path), torch.float32, CPU)   # whole, the same checkpoint loads


# -- (d) the engine ---------------------------------------------------------------------------------------------------
def test_engine_fp8_online_on_two_ranks(checkpoints):
    """--quantization fp8 with --tensor-parallel-size 2 through LLM (the worker quantises its slices at load): greedy
    tokens and their logprobs equal one process's whose o_proj and down_proj quantise activations in halves, as the
    two ranks do (without the halves the tokens agree here too, but the logprobs move by up to ~5e-2)."""
    from gemmaserve import LLM, SamplingParams

    prompts = ["the quick brown fox", "hello there, abc"]
    params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=0)

    def greedy(llm: LLM) -> list[tuple[list[int], torch.Tensor]]:
        return [(o.outputs[0].token_ids, torch.tensor([lp.logprob for lp in o.outputs[0].logprobs]))
                for o in llm.generate(prompts, params)]

    options = dict(dtype="float32", quantization="fp8", kv_cache_memory=1 << 22, cpu_compile="off")
    one = LLM(str(checkpoints["bf16"]), **options)
    try:
        for layer in one.engine._model.model.layers:
            for mod in (layer.self_attn.o_proj, layer.mlp.down_proj):
                mod.forward = _forward(mod, mod.in_features // 2)
        want = greedy(one)
    finally:
        one.close()
    two = LLM(str(checkpoints["bf16"]), tensor_parallel_size=2, **options)
    try:
        assert two.engine.info.weights == "fp8 channel x 8, float32 x 1"
        for (tokens, logprobs), (want_tokens, want_logprobs) in zip(greedy(two), want, strict=True):
            assert tokens == want_tokens
            assert torch.allclose(logprobs, want_logprobs, rtol=0, atol=1e-4), (logprobs, want_logprobs)
    finally:
        two.close()
