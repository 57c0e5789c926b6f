"""Quantised MoE experts (Gemma 4 26B-A4B): the grouped products of quantization/grouped_kernels.py and the
QuantizedExperts block (models/quantized_experts.py) that --quantization fp8 and a GGUF file's 4-bit expert tensors
load into.

  (a) the Triton kernels in the interpreter against the fp32 references: several experts, some without rows, uneven
      rows per expert (several row tiles for one), N not a multiple of the column tile; int4 in each form
      (symmetric, zero points, the offset form of Q4_K / Q4_1) with fp32 activations, fp8 against its own reference
      (activations quantised per token the same way); a row's bits whatever the other experts' rows;
  (b) --quantization fp8 on a tiny random 26B-A4B-style checkpoint: every experts block per (expert, channel), its
      logits those of the float model with the scheme applied by hand (weights dequantised, activations quantised
      per token), with a LoRA adapter of the experts too; its rows' logits independent of the batch, greedy tokens
      unchanged by the other requests;
  (c) a GGUF file's Q4_0 / Q4_1 / Q4_K expert tensors kept 4-bit (as on CUDA): each weight gguf's own
      dequantisation bit for bit, a block with a tensor of another type keeping that one float, logits those of the
      file dequantised; the kernel over the file's weights.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from gemmaserve.models import gguf_packed
from gemmaserve.models.gguf_file import GGUFFile
from gemmaserve.models.loader import load_model
from gemmaserve.models.moe import Experts
from gemmaserve.models.quantized_experts import QuantizedExperts
from gemmaserve.quantization import grouped_kernels as G
from gemmaserve.quantization.schemes import Int4Weight

from helpers import fresh_seed, paged_logits, save_checkpoint, tiny_gemma4_hf

CPU = torch.device("cpu")
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")

# Rows per expert: none for some, one, several tiles of 16 for one; more experts than rows.
COUNTS = [[3, 0, 37, 1, 0, 5], [0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2]]
SMALL = G.GroupedConfig(16, 32, 32, 4, 1)   # N = 72: two full column tiles and a partial one


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref.double()).norm() / ref.double().norm()).item()


def _int4(gen, rows: int, k: int, group: int, form: str) -> Int4Weight:
    q = torch.randint(0, 16, (rows, k), generator=gen, dtype=torch.uint8)
    scale = torch.rand(rows, k // group, generator=gen) * 0.02 + 0.001
    if form == "offset":   # fp32 scales and offsets, as Q4_K's
        return Int4Weight(q, scale, None, group, scale * torch.rand(rows, k // group, generator=gen) * 15)
    zero = torch.randint(0, 16, (rows, k // group), generator=gen, dtype=torch.uint8) if form == "zero" else None
    return Int4Weight(q, scale.to(torch.bfloat16), zero, group)


def _ends(counts: list[int]) -> torch.Tensor:
    return torch.tensor(counts).cumsum(0).to(torch.int32)


# -- (a) kernels ---------------------------------------------------------------------------------------------------
@interpreted
@pytest.mark.parametrize("form, group", [("sym", 32), ("sym", 128), ("zero", 32), ("offset", 32)])
def test_int4_grouped_kernel_matches_the_fp32_reference(form, group):
    gen = torch.Generator().manual_seed(fresh_seed())
    n, k = 72, 256
    for counts in COUNTS:
        e = len(counts)
        w = G.QuantExperts(_int4(gen, e * n, k, group, form), e)
        packed = G.pack_int4_experts(w)
        back = G.unpack_int4_experts(packed).weight
        assert torch.equal(back.q, w.weight.q) and torch.equal(back.scale, w.weight.scale)
        x = torch.randn(sum(counts), k, generator=gen)
        ends = _ends(counts)
        ref = G.grouped_reference(x.double(), w, ends, torch.float64)
        for cfg in (None, SMALL):
            assert _rel(G.int4_grouped_linear(x, packed, ends, cfg), ref) < 1e-6, (form, group, counts, cfg)


@interpreted
def test_fp8_grouped_kernel_matches_its_reference():
    """The reference quantises the activations per token as the kernel's launch does (the same bits), then multiplies
    the dequantised operands in fp32: only the summation order and where the scales multiply differ."""
    gen = torch.Generator().manual_seed(fresh_seed())
    n, k = 72, 80   # K not a multiple of the K step
    for counts in COUNTS:
        e = len(counts)
        w = G.quantize_fp8_experts(torch.randn(e, n, k, generator=gen) * torch.rand(e, n, 1, generator=gen))
        x = torch.randn(sum(counts), k, generator=gen) * torch.rand(sum(counts), 1, generator=gen) * 4
        ends = _ends(counts)
        ref = G.grouped_reference(x, w, ends)
        for cfg in (None, SMALL):
            assert _rel(G.fp8_grouped_linear(x, w, ends, config=cfg), ref) < 1e-6, (counts, cfg)


@interpreted
def test_a_rows_bits_do_not_depend_on_the_other_experts_rows():
    gen = torch.Generator().manual_seed(fresh_seed())
    e, n, k = 4, 40, 64
    int4 = G.pack_int4_experts(G.QuantExperts(_int4(gen, e * n, k, 32, "offset"), e))
    fp8 = G.quantize_fp8_experts(torch.randn(e, n, k, generator=gen))
    probe = torch.randn(k, generator=gen)
    first: dict[str, torch.Tensor] = {}
    for counts, at in (([0, 1, 0, 0], 0), ([3, 40, 0, 5], 3 + 21), ([0, 9, 2, 0], 8)):
        x = torch.randn(sum(counts), k, generator=gen)
        x[at] = probe
        for name, y in (("int4", G.int4_grouped_linear(x, int4, _ends(counts), SMALL)),
                        ("fp8", G.fp8_grouped_linear(x, fp8, _ends(counts), config=SMALL))):
            ref = first.setdefault(name, y[at])
            assert torch.equal(y[at], ref), (name, counts)   # expert 1 each time, in other tiles


# -- (b) --quantization fp8 ----------------------------------------------------------------------------------------
IDS = [2, 40, 51, 62, 73, 84, 95, 106, 117, 128, 139]


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    return save_checkpoint(tiny_gemma4_hf(fresh_seed(), "26b_a4b"), tmp_path_factory.mktemp("moe") / "ckpt")


def _per_token(x: torch.Tensor) -> torch.Tensor:
    """x quantised to fp8 per token and back to fp32, as the scheme defines."""
    from gemmaserve.quantization.fp8_kernels import dequantize_activations, quantize_activations_torch

    x2 = x.reshape(-1, x.shape[-1])
    return dequantize_activations(*quantize_activations_torch(x2, x2.shape[1])).view(x.shape)


@pytest.fixture(scope="module")
def fp8_and_scheme(moe_checkpoint):
    """(the checkpoint loaded with --quantization fp8, the float model with the scheme applied by hand: weights
    dequantised, every product's activations quantised per token, the experts' inside their grouped products)."""
    from gemmaserve.quantization.schemes import quantize_fp8_per_channel

    plain = load_model(str(moe_checkpoint), torch.float32, CPU).model
    loaded = load_model(str(moe_checkpoint), torch.float32, CPU, quantization="fp8")
    for layer, ours in zip(plain.model.layers, loaded.model.model.layers):
        for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            m.weight.data.copy_(quantize_fp8_per_channel(m.weight.data).dequantize())
            m.register_forward_pre_hook(lambda mod, inp: (_per_token(inp[0]),))
        experts = layer.experts
        for which in ("gate_up", "down"):   # per (expert, output channel)
            p = getattr(experts, f"{which}_proj")
            p.data.copy_(G.quantize_fp8_experts(p.data).dequantize())
            assert torch.equal(ours.experts.dequantize(which), p.data)
        experts.product = (lambda orig: lambda which, a, *rest: orig(which, _per_token(a), *rest))(experts.product)
    return loaded, plain


def test_fp8_online_quantises_the_experts_and_matches_the_scheme(fp8_and_scheme):
    from gemmaserve.models.lora import expert_modules

    loaded, plain = fp8_and_scheme
    layers = loaded.model.model.layers
    # 4 projections a layer (qkv, o, gate_up, down), one experts block a layer; the routers and the table as saved.
    assert loaded.weight_formats == {"fp8 channel": 4 * len(layers), "fp8 channel experts": len(layers),
                                     "float32": len(layers) + 1}
    assert all(isinstance(layer.experts, QuantizedExperts) for layer in layers)
    assert set(expert_modules(loaded.model)) == {f"model.layers.{i}.experts" for i in range(len(layers))}
    ours, ref = paged_logits(loaded.model, [IDS])[0], paged_logits(plain, [IDS])[0]
    assert (ours - ref).abs().max().item() < 2e-5 * ref.abs().max().item()


def test_lora_of_the_experts_over_fp8_experts(fp8_and_scheme, tmp_path):
    """A PEFT adapter of the experts (target_parameters) and o_proj: its deltas over the quantised experts are those
    over the scheme's float reference (the adapter reads the unquantised activations, as over bf16 experts)."""
    pytest.importorskip("peft")
    from test_lora import _adapter

    from gemmaserve.engine.lora import RunnerLoRA
    from gemmaserve.engine.step import LoRALoad

    loaded, plain = fp8_and_scheme
    seed = fresh_seed()
    _adapter(tiny_gemma4_hf(seed, "26b_a4b"), tmp_path / "e", seed + 1, target_modules=["o_proj"], r=3, lora_alpha=5,
             target_parameters=["experts.gate_up_proj", "experts.down_proj"])
    logits = []
    for model in (loaded.model, plain):
        runner = RunnerLoRA(model, CPU, 1, 8, 1, stacked=False)
        runner.load(LoRALoad(0, "e", str(tmp_path / "e"), None))
        assert runner.weights.expert_slots() == {0}
        logits.append(paged_logits(model, [IDS], chunk=4, lora=(runner.weights, [0]))[0])
    ours, ref = logits
    scale = ref.abs().max().item()
    assert (ours - paged_logits(loaded.model, [IDS])[0]).abs().max().item() > 0.05 * scale   # the adapter matters
    assert (ours - ref).abs().max().item() < 2e-5 * scale


def test_fp8_experts_rows_do_not_depend_on_the_batch(moe_checkpoint):
    """A sequence's logits, bit for bit, alone and among others (chunked too); greedy tokens through the engine alone
    and with other requests beside it."""
    from gemmaserve import LLM, SamplingParams

    model = load_model(str(moe_checkpoint), torch.float32, CPU, quantization="fp8").model
    alone = paged_logits(model, [IDS])[0]
    crowd = paged_logits(model, [[2, 7, 9, 200, 31], IDS, [2] + list(range(100, 130))], chunk=5)[1]
    assert torch.equal(alone, crowd)

    llm = LLM(model=str(moe_checkpoint), dtype="float32", quantization="fp8", kv_cache_memory=16 << 20,
              cpu_compile="off")
    assert "fp8 channel experts x 6" in llm.engine.info.weights
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    prompt = "hello world this is a test"
    one = llm.generate([prompt], params)[0].outputs[0].token_ids
    many = llm.generate(["the cat", prompt, "a much longer prompt about something else entirely"], params)
    assert many[1].outputs[0].token_ids == one


# -- (c) GGUF: 4-bit expert tensors kept 4-bit ----------------------------------------------------------------------
# moe_intermediate_size 256 so that ffn_down_exps' rows are whole Q4_K blocks; hidden 64 is two Q4_0 / Q4_1 blocks.
GGUF_MOE = dict(moe_intermediate_size=256)
EXPERT_TYPES = {   # (layer, GGUF tensor) -> type; other expert tensors F32
    (0, "ffn_gate_up_exps"): "Q4_0", (0, "ffn_down_exps"): "Q4_K",
    (1, "ffn_gate_up_exps"): "Q4_1", (1, "ffn_down_exps"): "Q8_0",    # down stays float
    (2, "ffn_gate_up_exps"): "F32", (2, "ffn_down_exps"): "Q4_1",     # gate_up stays float
}


@pytest.fixture
def moe_gguf(tmp_path, monkeypatch):
    """A tiny 26B-A4B-style GGUF (test_gemma4_loading's writer) whose expert tensors take EXPERT_TYPES; Q4_K as
    random valid blocks (gguf-py cannot quantise to Q4_K). The loader decides as on CUDA in bf16 (keeps_packed) while
    building on the CPU in fp32."""
    import gguf

    import test_gemma4_loading as g4
    from test_gguf_quantized import _random_q4_k

    seed = fresh_seed()
    rng = np.random.default_rng(seed)

    def add(w, name, value, quantise):
        parts = name.split(".")
        qtype = EXPERT_TYPES.get((int(parts[1]), parts[2]), "F32") if parts[0] == "blk" and parts[-1] == "weight" \
            else "F32"
        if qtype == "F32":
            w.add_tensor(name, value)
            return
        t = getattr(gguf.GGMLQuantizationType, qtype)
        rows = int(np.prod(value.shape[:-1]))
        raw = _random_q4_k(rng, rows, value.shape[-1]) if qtype == "Q4_K" else gguf.quants.quantize(value, t)
        w.add_tensor(name, raw.reshape(*value.shape[:-1], -1), raw_dtype=t)

    monkeypatch.setattr(g4, "add_gguf_tensor", add)
    monkeypatch.setenv("GEMMASERVE_CACHE_DIR", str(tmp_path / "cache"))
    real = gguf_packed.keeps_packed
    monkeypatch.setattr(gguf_packed, "keeps_packed", lambda device, dtype, quantization, shard:
                        real(torch.device("cuda"), torch.bfloat16, quantization, shard))
    return g4._write_gguf(tiny_gemma4_hf(seed, "26b_a4b", **GGUF_MOE), tmp_path / "moe.gguf")


def _gguf_dequantized(path, name: str) -> torch.Tensor:
    import gguf

    t = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}[name]
    return torch.from_numpy(gguf.quants.dequantize(np.asarray(t.data), t.tensor_type))


def test_gguf_4bit_experts_are_the_files_weights_and_logits_the_fp32_load(moe_gguf):
    quantized = load_model(str(moe_gguf), torch.float32, CPU)
    ref = load_model(str(moe_gguf), torch.float32, CPU, quantization="none")
    layers = quantized.model.model.layers
    labels = {i: layer.experts.label for i, layer in enumerate(layers) if isinstance(layer.experts, QuantizedExperts)}
    assert labels == {0: "gguf q4_0+q4_k experts", 1: "gguf q4_1 experts (down float32)",
                      2: "gguf q4_1 experts (gate_up float32)"}
    assert all(isinstance(layer.experts, Experts) for layer in layers[3:])
    assert quantized.weight_formats["gguf q4_0+q4_k experts"] == 1 and ref.weight_formats is None
    for i in labels:
        for which, kind in (("gate_up", "ffn_gate_up_exps"), ("down", "ffn_down_exps")):
            ours = layers[i].experts.dequantize(which)
            theirs = getattr(ref.model.model.layers[i].experts, f"{which}_proj").data
            assert torch.equal(ours, theirs), (i, which)
            if EXPERT_TYPES[(i, kind)].startswith("Q4"):
                assert layers[i].experts.canonical(which) is not None
                assert torch.equal(ours, _gguf_dequantized(moe_gguf, f"blk.{i}.{kind}.weight")), (i, which)
            else:
                assert layers[i].experts.canonical(which) is None   # the float parameter load_weights filled
    ours, theirs = paged_logits(quantized.model, [IDS])[0], paged_logits(ref.model, [IDS])[0]
    assert (ours - theirs).abs().max().item() <= 1e-5 * theirs.abs().max().item()


@interpreted
def test_int4_grouped_kernel_multiplies_by_the_files_weights(moe_gguf):
    f = GGUFFile(moe_gguf)
    gen = torch.Generator().manual_seed(fresh_seed())
    for (layer, kind), qtype in EXPERT_TYPES.items():
        if not qtype.startswith("Q4"):
            continue
        w = gguf_packed.int4_experts(f, gguf_packed.PackedModule((f"blk.{layer}.{kind}.weight",), (qtype,)), 8)
        counts = [2, 0, 5, 1, 0, 0, 3, 1]
        x = torch.randn(sum(counts), w.shape[2], generator=gen)
        ref = G.grouped_reference(x.double(), w, _ends(counts), torch.float64)
        assert _rel(G.int4_grouped_linear(x, G.pack_int4_experts(w), _ends(counts), SMALL), ref) < 1e-6, qtype
