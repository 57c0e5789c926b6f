"""A GGUF file's 4-bit and 8-bit projections kept packed (models/gguf_packed.py, the CUDA load), run here on the CPU:
the loader is told that it is on CUDA in bf16 (`keeps_packed` answers for that) and builds the same modules on the
CPU, where a QuantizedLinear multiplies by the fp32 reference of its exact weight (or, repacked as on CUDA, by the
Triton kernel in the interpreter). Tiny Gemma 3 files written with gguf's writer: Q4_0, Q4_1 and Q8_0 quantised by
gguf.quants, Q4_K and Q6_K as random valid blocks (gguf-py cannot quantise to them). Each weight equals gguf's own
dequantisation bit for bit; the model's logits equal those of the file loaded dequantised to fp32; a fused module
with a part of another type (or offset-form 4-bit parts beside 8-bit ones) is dequantised and the counts say so; the
Triton kernels (interpreter) multiply by the file's own weights; `--quantization none` dequantises; Gemma 4's
structures (K = V, MoE, KV sharing) are found from the model as Gemma 3's are."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from gemmaserve import LLM, SamplingParams
from gemmaserve.errors import UserInputError
from gemmaserve.models import gguf_packed
from gemmaserve.models.gemma3 import Gemma3Config, Gemma3ForCausalLM
from gemmaserve.models.gguf_file import GGUFFile
from gemmaserve.models.layers import Linear
from gemmaserve.models.loader import load_model
from gemmaserve.quantization.linear import QuantizedLinear

from helpers import add_gemma3_gguf_header, add_gguf_tokenizer, fresh_seed, paged_logits, tiny_hf_model

# Widths that are whole Q4_K blocks (256) for every projection: o_proj's input is 4 heads x 64.
CONFIG = dict(hidden_size=256, intermediate_size=256, num_attention_heads=4, head_dim=64, num_key_value_heads=1,
              num_hidden_layers=2, sliding_window=4)
PROMPT = "hello world this is a test"
LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
         "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
         "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "post_attention_norm",
         "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
MIXED = {  # (layer, GGUF tensor) -> type; the rest Q4_0
    (0, "attn_q"): "Q4_K", (0, "attn_k"): "Q4_0", (0, "attn_v"): "Q8_0",   # qkv: a Q8_0 part, dequantised
    (0, "attn_output"): "Q5_0", (0, "ffn_down"): "F16",                     # other types: dequantised
    (1, "attn_q"): "Q4_K", (1, "attn_k"): "Q4_0", (1, "attn_v"): "Q4_1",   # all 4-bit: kept, offset form
    (1, "ffn_gate"): "Q4_0", (1, "ffn_up"): "Q4_1",
}
MIXED8 = {  # (layer, GGUF tensor) -> type; the rest Q8_0
    (0, "attn_q"): "Q4_0", (0, "attn_v"): "Q6_K",                            # qkv: int8 groups of 16, fp32 scales
    (0, "attn_output"): "Q6_K", (0, "ffn_up"): "Q4_0",                       # gate_up: int8 groups of 32, fp16
    (1, "attn_q"): "Q4_K",                                                   # qkv: Q4_K beside Q8_0, dequantised
    (1, "attn_output"): "Q4_0",                                              # 4-bit alone: int4
    (1, "ffn_gate"): "Q4_1", (1, "ffn_up"): "Q6_K", (1, "ffn_down"): "Q5_0",  # dequantised
}


def _random_q4_k(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    """Valid Q4_K blocks (any bytes are, given finite fp16 d and dmin), scaled so that |w| stays below ~0.3."""
    blocks = rng.integers(0, 256, size=(n * k // 256, 144), dtype=np.uint8)
    for col in (0, 2):
        blocks[:, col:col + 2] = np.float16(rng.uniform(1e-4, 3e-4, len(blocks))).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(n, k // 256 * 144)


def _random_q6_k(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    """Valid Q6_K blocks (any bytes are, given a finite fp16 d; int8 scales -128..127 included), |w| below ~0.2."""
    blocks = rng.integers(0, 256, size=(n * k // 256, 210), dtype=np.uint8)
    blocks[:, 208:210] = np.float16(rng.uniform(1e-5, 5e-5, len(blocks))).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(n, k // 256 * 210)


def _write_gguf(hf, path: Path, type_of, seed: int) -> Path:
    """The tiny HF Gemma 3 as llama.cpp's gemma3 GGUF, each matrix in `type_of(layer, gguf kind)`'s type (norms F32,
    stored as 1 + w; the token embedding Q8_0)."""
    import gguf

    rng = np.random.default_rng(seed)
    cfg = hf.config
    w = gguf.GGUFWriter(str(path), "gemma3")
    add_gemma3_gguf_header(w, cfg)
    add_gguf_tokenizer(w, cfg.vocab_size)
    for name, t in hf.state_dict().items():
        module = name.removesuffix(".weight")
        value = t.detach().float().numpy().copy()
        if module == "lm_head":   # tied: the embedding is the head
            continue
        if module == "model.embed_tokens":
            kind, qtype = "token_embd", "Q8_0"
        elif module == "model.norm":
            kind, qtype = "output_norm", "F32"
        else:
            _, _, bid, rest = module.split(".", 3)
            kind = f"blk.{bid}.{LAYER[rest]}"
            qtype = "F32" if "norm" in rest else type_of(int(bid), LAYER[rest])
        if "norm" in module:
            value = value + 1.0
        if qtype == "F32":
            w.add_tensor(f"{kind}.weight", value)
        elif qtype == "F16":
            w.add_tensor(f"{kind}.weight", value.astype(np.float16))
        else:
            t_ = getattr(gguf.GGMLQuantizationType, qtype)
            random = {"Q4_K": _random_q4_k, "Q6_K": _random_q6_k}.get(qtype)
            raw = random(rng, *value.shape) if random else gguf.quants.quantize(value, t_)
            w.add_tensor(f"{kind}.weight", raw, raw_dtype=t_)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def as_on_cuda(monkeypatch, tmp_path):
    """The loader decides as it would on CUDA in bf16 (keeps_packed), while building on the CPU in fp32."""
    monkeypatch.setenv("GEMMASERVE_CACHE_DIR", str(tmp_path / "cache"))
    real = gguf_packed.keeps_packed
    monkeypatch.setattr(gguf_packed, "keeps_packed", lambda device, dtype, quantization, shard:
                        real(torch.device("cuda"), torch.bfloat16, quantization, shard))


def _file(tmp_path: Path, kind: str, seed: int) -> Path:
    if kind in ("mixed", "mixed8"):
        table, rest = (MIXED, "Q4_0") if kind == "mixed" else (MIXED8, "Q8_0")
        type_of = lambda layer, t: table.get((layer, t), rest)   # noqa: E731
    else:
        type_of = lambda layer, t: kind   # noqa: E731
    return _write_gguf(tiny_hf_model(seed, **CONFIG), tmp_path / f"{kind}.gguf", type_of, seed)


def _load(path: Path, quantization: str = "auto"):
    return load_model(str(path), torch.float32, torch.device("cpu"), quantization=quantization)


def _logits(model, tokenizer) -> torch.Tensor:
    return paged_logits(model, [tokenizer.encode(PROMPT)])[0]


def _dequantized_parts(path: Path, names) -> torch.Tensor:
    """gguf's own dequantisation of tensors `names`, stacked along their rows (as our fused weights are)."""
    import gguf

    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    parts = [gguf.quants.dequantize(np.asarray(tensors[n].data), tensors[n].tensor_type) for n in names]
    return torch.from_numpy(np.concatenate([p.reshape(-1, p.shape[-1]) for p in parts]))


def test_keeps_packed_on_cuda_in_bf16_and_fp16_with_auto_only():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert gguf_packed.keeps_packed(cuda, torch.bfloat16, "auto", None)
    assert gguf_packed.keeps_packed(cuda, torch.float16, "auto", None)
    assert not gguf_packed.keeps_packed(cuda, torch.bfloat16, "none", None)        # --quantization none: dequantise
    assert not gguf_packed.keeps_packed(cuda, torch.float32, "auto", None)         # --dtype float32: as before
    assert not gguf_packed.keeps_packed(cpu, torch.bfloat16, "auto", None)         # the CPU: models/quant.py's formats
    assert not gguf_packed.keeps_packed(cuda, torch.bfloat16, "auto", object())    # a tensor-parallel rank


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K", "mixed"])
def test_int4_weights_are_gguf_dequantisation_and_logits_the_fp32_load(tmp_path, as_on_cuda, kind):
    """(a) every kept module's weight is gguf.quants.dequantize of its parts, bit for bit (fused parts stacked);
    (b) the model built as on CUDA gives the logits of the file dequantised to fp32 (the same fp32 weights, the same
    row-invariant product: equal up to fp32 rounding, here equal)."""
    seed = fresh_seed()
    path = _file(tmp_path, kind, seed)
    f = GGUFFile(path)
    quantized, ref = _load(path), _load(path, "none")
    model = quantized.model
    planned = gguf_packed.plan_packed(ref.model, f)
    kept = {n for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    assert kept == set(planned) and kept
    for name in kept:
        mod = model.get_submodule(name)
        w = mod.kernel_weight
        assert torch.equal(w.dequantize(torch.float32), _dequantized_parts(path, planned[name].tensors)), name
        assert torch.equal(w.dequantize(torch.float32), ref.model.get_submodule(name).weight), name
        types = set(planned[name].types)
        assert (w.offset is None) == (types == {"Q4_0"}) and w.zero is None and w.group == 32
        assert w.scale.dtype == (torch.float16 if len(types) == 1 and types != {"Q4_K"} else torch.float32)
    assert not any(isinstance(m, QuantizedLinear) for m in ref.model.modules()) and ref.weight_formats is None
    ours, theirs = _logits(model, quantized.tokenizer), _logits(ref.model, ref.tokenizer)
    assert torch.isfinite(theirs).all()
    err = (ours - theirs).abs().max().item()
    assert err <= 1e-5 * theirs.abs().max().item(), f"seed={seed}: {err}"


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("kind", ["Q8_0", "Q6_K", "mixed8"])
def test_int8_weights_are_gguf_dequantisation_and_logits_the_fp32_load(tmp_path, as_on_cuda, monkeypatch, kind):
    """(a) every int8 module's weight is gguf.quants.dequantize of its parts, bit for bit: Q8_0 groups of 32 with its
    fp16 d, Q6_K groups of 16 with d * sc in fp32, fused parts mixing Q8_0, Q6_K and Q4_0 in the smallest group;
    (b) the logits equal the fp32 load's, through the reference (the CPU's module) and, for the mixed file (whose
    layer 0 holds every form: Q8_0 alone, Q6_K alone, fused g16 fp32 and g32 fp16), through the Triton kernels in
    the interpreter (the modules repacked as on CUDA): the tiled kernel over the whole prompt, the GEMV three tokens
    a step. Wide tiles, K split in two: the interpreter's time goes by program steps (the kernels' own tile choices
    are tested in test_int8_kernels.py)."""
    import triton

    from gemmaserve.quantization import int8_kernels as I8
    from gemmaserve.quantization.schemes import Int8Weight, Scheme

    def wide(m, n, k, group, sms):   # the GEMV up to 4 rows (the kernel takes them; the heuristics give it none)
        if m <= 4:
            return I8.Int8Config(triton.next_power_of_2(m), 512, 128, k // 2, 4, 1, gemv=True)
        return I8.Int8Config(max(16, triton.next_power_of_2(m)), 512, min(group, 64), k // 2, 4, 1)

    monkeypatch.setattr(I8, "int8_config", wide)

    seed = fresh_seed()
    path = _file(tmp_path, kind, seed)
    f = GGUFFile(path)
    quantized, ref = _load(path), _load(path, "none")
    model = quantized.model
    planned = gguf_packed.plan_packed(ref.model, f)
    int8 = {n for n, m in model.named_modules() if isinstance(m, QuantizedLinear) and m.quant.scheme is Scheme.W8A16}
    assert int8 == {n for n, e in planned.items() if e.bits == 8} and int8
    if kind != "mixed8":
        assert int8 == set(planned) and len(int8) == 8
    for name in int8:
        mod = model.get_submodule(name)
        w = mod.kernel_weight
        assert isinstance(w, Int8Weight), name
        assert torch.equal(w.dequantize(torch.float32), _dequantized_parts(path, planned[name].tensors)), name
        assert torch.equal(w.dequantize(torch.float32), ref.model.get_submodule(name).weight), name
        types = set(planned[name].types)
        assert w.group == mod.quant.group == (16 if "Q6_K" in types else 32), name
        assert w.scale.dtype == (torch.float32 if "Q6_K" in types else torch.float16), name
    theirs = _logits(ref.model, ref.tokenizer)
    assert torch.isfinite(theirs).all()
    tol = 1e-5 * theirs.abs().max().item()
    ours = _logits(model, quantized.tokenizer)
    assert (ours - theirs).abs().max().item() <= tol, f"seed={seed} reference"
    if kind != "mixed8":
        return
    for name in int8:   # the layout a CUDA load holds: forward runs int8_linear (the interpreter here)
        mod = model.get_submodule(name)
        mod.kernel_weight = I8.pack_int8(mod.kernel_weight)
    ids = quantized.tokenizer.encode(PROMPT)
    assert len(ids) > 4
    for chunk in (None, 3):   # the whole prompt (M > 4: the tiled kernel), then three tokens a step (the GEMV)
        ours = paged_logits(model, [ids], chunk=chunk)[0]
        err = (ours - theirs).abs().max().item()
        assert err <= tol, f"seed={seed} chunk={chunk}: {err}"


def test_mixed_8bit_file_keeps_exact_int8_modules_and_counts_them(tmp_path, as_on_cuda):
    """(c) Q8_0, Q6_K and Q4_0 parts fuse into int8 groups; a Q4_0 matrix alone stays int4; Q4_K or Q4_1 beside 8-bit
    parts (offset forms, not int8 times a scale) and Q5_0 stay dequantised Linears; weight_formats counts them."""
    path = _file(tmp_path, "mixed8", fresh_seed())
    loaded = _load(path)
    kinds = {n: (m.quant.label, m.quant.scheme.value, m.quant.group) if isinstance(m, QuantizedLinear) else "float"
             for n, m in loaded.model.named_modules() if isinstance(m, (Linear, QuantizedLinear))}
    want = {0: {"self_attn.qkv_proj": ("gguf q4_0+q6_k+q8_0", "w8a16", 16),
                "self_attn.o_proj": ("gguf q6_k", "w8a16", 16),
                "mlp.gate_up_proj": ("gguf q4_0+q8_0", "w8a16", 32), "mlp.down_proj": ("gguf q8_0", "w8a16", 32)},
            1: {"self_attn.qkv_proj": "float", "self_attn.o_proj": ("gguf q4_0", "w4a16", 32),
                "mlp.gate_up_proj": "float", "mlp.down_proj": "float"}}
    assert kinds == {f"model.layers.{i}.{m}": v for i, mods in want.items() for m, v in mods.items()}
    assert loaded.weight_formats == {"gguf q4_0+q6_k+q8_0": 1, "gguf q6_k": 1, "gguf q4_0+q8_0": 1, "gguf q8_0": 1,
                                     "gguf q4_0": 1, "float32": 4}


def test_mixed_file_keeps_only_all_4bit_modules_and_counts_them(tmp_path, as_on_cuda):
    """(c) layer 0's qkv has a Q8_0 part and its o_proj is Q5_0, down F16: those stay dequantised Linears; layer 1's
    fused parts mixing Q4_K, Q4_0 and Q4_1 are kept in the offset form; weight_formats and EngineInfo count them."""
    path = _file(tmp_path, "mixed", fresh_seed())
    loaded = _load(path)
    model = loaded.model
    kinds = {n: (m.quant.label if isinstance(m, QuantizedLinear) else "float")
             for n, m in model.named_modules() if isinstance(m, (Linear, QuantizedLinear))}
    want = {0: {"self_attn.qkv_proj": "float", "self_attn.o_proj": "float", "mlp.gate_up_proj": "gguf q4_0",
                "mlp.down_proj": "float"},
            1: {"self_attn.qkv_proj": "gguf q4_0+q4_1+q4_k", "self_attn.o_proj": "gguf q4_0",
                "mlp.gate_up_proj": "gguf q4_0+q4_1", "mlp.down_proj": "gguf q4_0"}}
    assert kinds == {f"model.layers.{i}.{m}": label for i, mods in want.items() for m, label in mods.items()}
    # 3 Linears and the embedding table as the model's dtype
    assert loaded.weight_formats == {"gguf q4_0": 3, "gguf q4_0+q4_1+q4_k": 1, "gguf q4_0+q4_1": 1, "float32": 4}
    llm = LLM(model=str(path), dtype="float32", page_size=4, kv_cache_memory=16 << 20)
    assert llm.engine.info.weights == "gguf q4_0 x 3, gguf q4_0+q4_1+q4_k x 1, gguf q4_0+q4_1 x 1, float32 x 4"
    exact = LLM(model=str(path), dtype="float32", page_size=4, kv_cache_memory=16 << 20, quantization="none")
    assert exact.engine.info.weights == "float32"
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    assert llm.generate([PROMPT], params)[0].outputs[0].token_ids == \
        exact.generate([PROMPT], params)[0].outputs[0].token_ids


def test_quantization_none_dequantizes_and_fp8_is_refused(tmp_path, as_on_cuda):
    """(d) --quantization none: every weight dequantised (today's path); fp8 and compressed-tensors need a checkpoint
    directory."""
    path = _file(tmp_path, "Q4_K", fresh_seed())
    loaded = _load(path, "none")
    assert loaded.weight_formats is None
    assert not any(isinstance(m, QuantizedLinear) for m in loaded.model.modules())
    for option in ("fp8", "compressed-tensors"):
        with pytest.raises(UserInputError, match=f"--quantization {option} needs a Hugging Face checkpoint"):
            _load(path, option)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0"])
def test_a_packed_tensor_of_the_wrong_shape_is_named(tmp_path, as_on_cuda, qtype):
    seed = fresh_seed()
    hf = tiny_hf_model(seed, **CONFIG)
    with torch.no_grad():   # k_proj with twice its rows: the file's config says one KV head
        hf.model.layers[1].self_attn.k_proj.weight = torch.nn.Parameter(torch.randn(128, 256) * 0.03)
    path = _write_gguf(hf, tmp_path / "bad.gguf", lambda layer, t: qtype, seed)
    with pytest.raises(UserInputError, match=rf"GGUF tensor blk\.1\.attn_k\.weight \({qtype}\) has shape \(128, 256\), "
                                             r"but model\.layers\.1\.self_attn\.qkv_proj expects \(64, 256\)"):
        _load(path)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
def test_int4_kernel_multiplies_by_the_files_weights(tmp_path):
    """The Triton kernel (interpreter, fp32 activations) over each form the loader builds from a file: Q4_0's
    symmetric fp16 scales, Q4_1's fp16 offsets, the mixed fused module's fp32 offsets."""
    from gemmaserve.quantization import int4_kernels as I4

    seed = fresh_seed()
    path = _file(tmp_path, "mixed", seed)
    f = GGUFFile(path)
    with torch.device("meta"):   # plan_packed reads only the model's structure and shapes
        planned = gguf_packed.plan_packed(Gemma3ForCausalLM(Gemma3Config.from_gguf(f)), f)
    gen = torch.Generator().manual_seed(seed)
    for module in ("self_attn.qkv_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        name = f"model.layers.1.{module}"
        w = gguf_packed.int4_weight(f, planned[name])
        x = torch.randn(3, w.shape[1], generator=gen)
        ref = x.double() @ w.dequantize().double().t()
        y = I4.int4_linear(x, I4.pack_int4(w), I4.Int4Config(16, 64, 32, w.shape[1] // 4, 4, 2))
        err = ((y.double() - ref).norm() / ref.norm()).item()
        assert err < 1e-6, f"seed={seed} {name}: {err}"


@pytest.mark.parametrize("variant", ["31b", "26b_a4b", "e2b"])
def test_gemma4_files_keep_their_projections(tmp_path, as_on_cuda, monkeypatch, variant):
    """Gemma 4's structures, found from the model: K = V (qkv of two parts), MoE (the experts are not Linears:
    dequantised), KV sharing and per-layer inputs; Q4_1 matrices, logits those of the fp32 load."""
    import gguf

    import test_gemma4_loading as g4
    from helpers import tiny_gemma4_hf

    def q4_1(w, name, value, quantise):   # the writer's matrices as Q4_1 instead of Q8_0
        if quantise and value.ndim == 2 and value.shape[-1] % 32 == 0:
            w.add_tensor(name, gguf.quants.quantize(value, gguf.GGMLQuantizationType.Q4_1),
                         raw_dtype=gguf.GGMLQuantizationType.Q4_1)
        else:
            w.add_tensor(name, value)

    monkeypatch.setattr(g4, "add_gguf_tensor", q4_1)
    seed = fresh_seed()
    path = g4._write_gguf(tiny_gemma4_hf(seed, variant), tmp_path / f"{variant}.gguf", q8_0=True)
    quantized, ref = _load(path), _load(path, "none")
    assert quantized.weight_formats["gguf q4_1"] > 0
    ours, theirs = _logits(quantized.model, quantized.tokenizer), _logits(ref.model, ref.tokenizer)
    err = (ours - theirs).abs().max().item()
    assert err <= 1e-5 * theirs.abs().max().item(), f"{variant} seed={seed}: {err}"


def test_the_cpu_load_keeps_a_q8_0_table_as_its_blocks_never_dequantised(tmp_path, monkeypatch):
    """The CPU's quantised load (not the CUDA one above): the Q8_0 token embedding becomes the QuantEmbedding's
    blocks straight from the file, its q and d exactly, with no fp32 copy of the table made (dequantising the 270M's
    262k-row table and quantising it back took ~10 s of a first start); the tables, the head and the logits are
    those of the load that dequantises the table and quantises it again (which recovers Q8_0's blocks)."""
    from gemmaserve.models import loader

    monkeypatch.setenv("GEMMASERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("GEMMASERVE_QUANT_CACHE", "0")
    path = _file(tmp_path, "Q8_0", fresh_seed())
    real_load, read = GGUFFile.load, []
    monkeypatch.setattr(GGUFFile, "load", lambda self, name: read.append(name) or real_load(self, name))
    direct = load_model(str(path), torch.float32, torch.device("cpu"), quantized=True)
    assert "token_embd.weight" not in read and "blk.0.attn_q.weight" in read
    table, file_blocks = direct.model.model.embed_tokens, GGUFFile(path).int8_groups("token_embd.weight")
    assert torch.equal(table.qweight, file_blocks.q) and torch.equal(table.scales, file_blocks.scale)

    monkeypatch.setattr(loader, "_is_table", lambda model, name: False)   # the load before: through fp32
    requantised = load_model(str(path), torch.float32, torch.device("cpu"), quantized=True)
    assert "token_embd.weight" in read
    other = requantised.model.model.embed_tokens
    assert torch.equal(other.qweight, table.qweight) and torch.equal(other.scales, table.scales)
    assert torch.equal(_logits(direct.model, direct.tokenizer), _logits(requantised.model, requantised.tokenizer))
