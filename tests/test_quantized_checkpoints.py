"""compressed-tensors checkpoints (W4A16 int4 groups, FP8 per channel and in blocks) and --quantization fp8:
loaded exactly against their format.

Checkpoints are written with compressed-tensors' own tooling (apply_quantization_config, its qparams, its
ModelCompressor) over tiny random transformers models, then read back by our loader. Checked:
  (a) our weights equal compressed-tensors' own decompression bit for bit (in the dtype it decompresses to);
  (b) logits against transformers loading the same checkpoint (its compressed-tensors integration, dequantised at
      load: dense weights rounded to the checkpoint's bf16; our fp32 path multiplies by the exact weights, so the
      bound is the bf16 rounding of the weights) and, tightly, against transformers holding our exact weights;
      for FP8 the reference also quantises activations per token, as the scheme says (compressed-tensors'
      own dynamic fake quantisation on the inputs of transformers' Linears);
  (c) --quantization fp8 on a float checkpoint against the scheme's reference;
  (d) bad input: each a UserInputError naming the tensor or the format.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from gemmaserve.errors import UserInputError
from gemmaserve.models.loader import load_model
from gemmaserve.quantization.compressed_tensors import QuantPlan
from gemmaserve.quantization.linear import QuantizedLinear

from helpers import paged_logits, save_checkpoint, tiny_gemma4_hf, tiny_hf_model

import compressed_tensors as ct  # noqa: E402  (a test dependency: pyproject.toml)
from compressed_tensors.compressors import ModelCompressor  # noqa: E402
from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,  # noqa: E402
                                             QuantizationStatus, apply_quantization_config)
from compressed_tensors.quantization.utils import calculate_qparams  # noqa: E402

CPU = torch.device("cpu")
# Widths that are multiples of 128 (fp8 blocks of fused parts align) and of 8 (packed zero points stack).
TEXT = dict(hidden_size=128, intermediate_size=256, head_dim=32, num_attention_heads=4, num_key_value_heads=4,
            num_hidden_layers=3, vocab_size=300)
IDS = [2, 40, 51, 62, 73, 84, 95, 106, 117, 128, 139]

W4A16_G32 = dict(weights=dict(num_bits=4, type="int", strategy="group", group_size=32, symmetric=True))
W4A16_G128_ASYM = dict(weights=dict(num_bits=4, type="int", strategy="group", group_size=128, symmetric=False))
FP8_CHANNEL = dict(weights=dict(num_bits=8, type="float", strategy="channel", symmetric=True),
                   input_activations=dict(num_bits=8, type="float", strategy="token", symmetric=True, dynamic=True))
FP8_BLOCK = dict(weights=dict(num_bits=8, type="float", strategy="block", block_structure=[128, 128], symmetric=True),
                 input_activations=dict(num_bits=8, type="float", strategy="group", group_size=128, symmetric=True,
                                        dynamic=True))
FORMATS = {"w4a16_g32": (W4A16_G32, "pack-quantized"), "w4a16_g128_asym": (W4A16_G128_ASYM, "pack-quantized"),
           "fp8_channel": (FP8_CHANNEL, "float-quantized"), "fp8_block": (FP8_BLOCK, "float-quantized")}


def _observe(module) -> None:
    """Weight scales (and zero points) by min-max over each group / row / block, as compressed-tensors computes
    them from observed ranges."""
    args = module.quantization_scheme.weights
    w = module.weight.data.float()
    n, k = w.shape
    if args.strategy == "group":
        v = w.view(n, k // args.group_size, args.group_size)
        lo, hi = v.amin(-1), v.amax(-1)
    elif args.strategy == "channel":
        lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    else:
        bn, bk = args.block_structure
        v = w.view(n // bn, bn, k // bk, bk)
        lo, hi = v.amin((1, 3)), v.amax((1, 3))
    scale, zero = calculate_qparams(lo, hi, args)
    module.weight_scale.data.copy_(scale)
    if not args.symmetric:
        module.weight_zero_point.data.copy_(zero.round())
    module.quantization_status = QuantizationStatus.FROZEN


def write_quantized(hf, path: Path, scheme: dict, fmt: str, ignore=("lm_head",)) -> Path:
    """`hf` (bf16) quantised with compressed-tensors and saved as a checkpoint directory."""
    group = QuantizationScheme(targets=["Linear"], **{k: QuantizationArgs(**v) for k, v in scheme.items()})
    apply_quantization_config(hf, QuantizationConfig(config_groups={"group_0": group}, ignore=list(ignore),
                                                     format=fmt), show_progress=False)
    for m in hf.modules():
        if getattr(m, "quantization_scheme", None) is not None:
            _observe(m)
    compressor = ModelCompressor.from_pretrained_model(hf, fmt)
    compressor.compress_model(hf)
    save_checkpoint(hf, path)
    compressor.update_config(str(path))
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("qckpt")
    out = {}
    for name, (scheme, fmt) in FORMATS.items():
        hf = tiny_hf_model(7, **TEXT).to(torch.bfloat16)
        out[name] = write_quantized(hf, root / name, scheme, fmt)
    out["bf16"] = save_checkpoint(tiny_hf_model(7, **TEXT).to(torch.bfloat16), root / "bf16")
    return out


def _hf_decompressed(path: Path):
    """transformers' model of the checkpoint, its compressed-tensors weights decompressed (dense, bf16 values)."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                quantization_config=CompressedTensorsConfig(dequantize=True)).eval()


def _ct_weights(path: Path) -> dict[str, torch.Tensor]:
    """compressed-tensors' own decompression of every quantised module, by checkpoint module name."""
    from safetensors.torch import load_file

    cfg = json.loads((path / "config.json").read_text())["quantization_config"]
    qcfg = QuantizationConfig.model_validate(cfg)
    scheme = next(iter(qcfg.config_groups.values()))
    compressor = ct.compressors.BaseCompressor.get_value_from_registry(qcfg.format)
    tensors = load_file(str(path / "model.safetensors"))
    out = {}
    for name in tensors:
        if name.endswith(".weight_scale"):
            module = name.removesuffix(".weight_scale")
            local = {k[len(module) + 1:]: v for k, v in tensors.items() if k.startswith(module + ".")}
            out[module] = compressor.decompress(local, scheme)["weight"]
    return out


def _ours_dequantized(model, module: str) -> torch.Tensor:
    """Our fused module's weight, as the kernel multiplies by (fp32)."""
    m = model.get_submodule(module)
    return m.dequantize() if hasattr(m, "dequantize") else m.weight.data.float()


def _fused_rows(model, ckpt: str) -> tuple[str, slice]:
    """A checkpoint module (model.layers.i.self_attn.k_proj) -> our module and its rows there."""
    prefix, part = ckpt.rsplit(".", 1)
    fused, idx = model.stacked.get(part, (part, 0))
    sizes = model.shard_sizes(f"{prefix}.{fused}.weight") if part in model.stacked else None
    if sizes is None:
        return ckpt, slice(None)
    start = sum(sizes[:idx])
    return f"{prefix}.{fused}", slice(start, start + sizes[idx])


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_weights_equal_compressed_tensors_decompression(checkpoints, fmt):
    """(a) bit for bit in bf16 (compressed-tensors decompresses in the scale's dtype, one rounding)."""
    model = load_model(str(checkpoints[fmt]), torch.float32, CPU).model
    theirs = _ct_weights(checkpoints[fmt])
    assert len(theirs) == 3 * 7
    for ckpt, w in theirs.items():
        ours, rows = _fused_rows(model, ckpt)
        mine = _ours_dequantized(model, ours)[rows]
        assert w.dtype == torch.bfloat16
        assert torch.equal(mine.to(torch.bfloat16), w), ckpt


def _scheme_reference(hf, scheme: dict):
    """Fake-quantise each Linear's input as the scheme says (compressed-tensors' dynamic quantisation)."""
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    act = scheme.get("input_activations")
    if act is None:
        return []
    args = QuantizationArgs(**act)

    def hook(module, inputs):
        x = inputs[0]   # [batch, tokens, hidden], as compressed-tensors expects activations
        s, z = compute_dynamic_scales_and_zp(value=x, args=args, module=module)
        return (fake_quantize(x, s, z, args),)

    return [m.register_forward_pre_hook(hook) for n, m in hf.named_modules()
            if isinstance(m, torch.nn.Linear) and n != "lm_head"]


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_logits_match_transformers(checkpoints, fmt):
    """(b) Against transformers' decompressed model: within the bf16 rounding of the weights; against transformers
    holding our exact (fp32) dequantised weights: to fp32 summation order."""
    loaded = load_model(str(checkpoints[fmt]), torch.float32, CPU, quantized=True)
    assert loaded.weight_formats and "float32" in loaded.weight_formats
    ours = paged_logits(loaded.model, [IDS])[0]
    hf = _hf_decompressed(checkpoints[fmt])
    hooks = _scheme_reference(hf, FORMATS[fmt][0])
    with torch.no_grad():
        loose = hf(torch.tensor([IDS])).logits[0]
        for name, m in hf.named_modules():   # our exact weights into transformers' model
            if isinstance(m, torch.nn.Linear) and name != "lm_head":
                ours_name, rows = _fused_rows(loaded.model, name)
                m.weight.copy_(_ours_dequantized(loaded.model, ours_name)[rows])
        tight = hf(torch.tensor([IDS])).logits[0]
    for h in hooks:
        h.remove()
    scale = tight.abs().max().item()
    assert (ours - tight).abs().max().item() < 2e-5 * scale
    # The weights' bf16 rounding (2^-9 relative) through 3 layers: a few 1e-3 of the logits' range. With fp8
    # activations that rounding also flips some activations by a whole fp8 step (2^-3 relative): a few 1e-2.
    bound = 2e-2 if fmt.startswith("w4a16") else 0.15
    assert (ours - loose).abs().max().item() < bound * scale
    assert ours.argmax(-1).tolist() == tight.argmax(-1).tolist()


def test_int4_maps_onto_cpu_int4_exactly(checkpoints):
    """On the CPU a W4A16 module is models/quant.py's INT4 kernel (fp32 s, m = s * zero) with the format's weight."""
    from gemmaserve.models.quant import QuantLinear

    model = load_model(str(checkpoints["w4a16_g128_asym"]), torch.float32, CPU).model
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, QuantLinear) and qkv.format.value == "int4"
    x = torch.randn(5, qkv.in_features)
    assert torch.allclose(qkv(x), x @ qkv.dequantize().t(), rtol=1e-5, atol=1e-5)


def test_fp8_quantises_activations_per_token(checkpoints):
    """The FP8 product is the scheme's: a row's result does not change when another row's scale does, and it
    differs from the unquantised-activation product."""
    model = load_model(str(checkpoints["fp8_channel"]), torch.float32, CPU).model
    o = model.model.layers[0].self_attn.o_proj
    assert isinstance(o, QuantizedLinear)
    x = torch.randn(4, o.in_features)
    y = o(x)
    x2 = x.clone()
    x2[1:] *= 100
    assert torch.equal(o(x2)[0], y[0])
    assert not torch.equal(y, x @ o.dequantize().t())


def test_engine_info_and_generation(checkpoints):
    from gemmaserve.engine.llm import LLM
    from gemmaserve.config.engine import EngineConfig
    from gemmaserve.engine.sampling_params import SamplingParams

    llm = LLM.from_config(EngineConfig(model=str(checkpoints["w4a16_g32"]), device="cpu", cpu_compile="off",
                                       kv_cache_memory=8 << 20, max_model_len=64))
    try:
        assert llm.engine.info.weights == "w4a16 g32 x 12, float32 x 1"
        out = llm.generate(["ab"], SamplingParams(max_tokens=4, temperature=0.0))
        assert len(out[0].outputs[0].token_ids) == 4
    finally:
        llm.close()


def test_gemma4_kv_shared_w4a16(tmp_path):
    """Gemma 4 E4B-like: KV-shared layers (their k/v never loaded), per-layer projections left as saved by ignore."""
    hf = tiny_gemma4_hf(5, "e4b", hidden_size=128, intermediate_size=256, head_dim=32, global_head_dim=64,
                        num_attention_heads=4).to(torch.bfloat16)
    path = write_quantized(hf, tmp_path / "g4", W4A16_G32, "pack-quantized",
                           ignore=("lm_head", "re:.*per_layer.*"))
    loaded = load_model(str(path), torch.float32, CPU)
    ours = paged_logits(loaded.model, [IDS])[0]
    theirs = _hf_decompressed(path)
    with torch.no_grad():
        for name, m in theirs.named_modules():
            if isinstance(m, torch.nn.Linear) and hasattr(m, "weight") and "per_layer" not in name and name != "lm_head":
                if loaded.model.checkpoint_name(f"{name}.weight") is None:
                    continue
                ours_name, rows = _fused_rows(loaded.model, name)
                m.weight.copy_(_ours_dequantized(loaded.model, ours_name)[rows])
        tight = theirs(torch.tensor([IDS])).logits[0]
    assert (ours - tight).abs().max().item() < 2e-5 * tight.abs().max().item()


def test_fp8_online_matches_the_scheme(checkpoints):
    """(c) --quantization fp8 on a bf16 checkpoint: every projection per channel, activations per token."""
    from gemmaserve.quantization.fp8_kernels import dequantize_activations, quantize_activations_torch
    from gemmaserve.quantization.schemes import quantize_fp8_per_channel

    def quantize_activations(x: torch.Tensor, group: None) -> torch.Tensor:   # per token, back to fp32
        x2 = x.reshape(-1, x.shape[-1])
        return dequantize_activations(*quantize_activations_torch(x2, x2.shape[1])).view(x.shape)

    plain = load_model(str(checkpoints["bf16"]), torch.float32, CPU).model
    loaded = load_model(str(checkpoints["bf16"]), torch.float32, CPU, quantization="fp8")
    assert loaded.weight_formats == {"fp8 channel": 12, "float32": 1}
    gate_up = loaded.model.model.layers[1].mlp.gate_up_proj
    w = plain.model.layers[1].mlp.gate_up_proj.weight.data
    assert torch.equal(gate_up.dequantize(), quantize_fp8_per_channel(w).dequantize())
    x = torch.randn(3, w.shape[1])
    want = quantize_activations(x, None) @ quantize_fp8_per_channel(w).dequantize().t()
    assert torch.allclose(gate_up(x), want, rtol=1e-6, atol=1e-6)
    # The whole model against the float one with the scheme applied by hand to every attention and MLP projection.
    for layer in plain.model.layers:
        for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            m.weight.data.copy_(quantize_fp8_per_channel(m.weight.data).dequantize())
            m.register_forward_pre_hook(lambda mod, inp: (quantize_activations(inp[0], None),))
    ours, ref = paged_logits(loaded.model, [IDS])[0], paged_logits(plain, [IDS])[0]
    assert (ours - ref).abs().max().item() < 2e-5 * ref.abs().max().item()


# -- (d) bad input ------------------------------------------------------------------------------------------------
def _edit_config(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg["quantization_config"])
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("edit, words", [
    (lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=8), ["group_0", "int8 weights"]),
    (lambda q: q["config_groups"]["group_0"].update(input_activations=dict(num_bits=8, type="int", strategy="token",
                                                                           dynamic=True)),
     ["group_0", "quantised int activations"]),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(group_size=48), ["group_size 48"]),
    (lambda q: q.update(format="float-quantized") or q["config_groups"]["group_0"].pop("format", None),
     ["format 'float-quantized'"]),
])
def test_unsupported_int_config_is_refused(checkpoints, tmp_path, edit, words):
    path = _edit_config(checkpoints["w4a16_g32"], tmp_path / "bad", edit)
    with pytest.raises(UserInputError) as err:
        load_model(str(path), torch.float32, CPU)
    for w in words:
        assert w in str(err.value)
    assert "config.json" in str(err.value)


def test_static_activations_and_mixed_groups_are_refused():
    fp8_static = json.loads(json.dumps(FP8_CHANNEL))
    fp8_static["input_activations"].update(dynamic=False, strategy="tensor")
    raw = {"quant_method": "compressed-tensors", "format": "mixed-precision", "config_groups": {
        "int4": {"targets": ["re:.*mlp.*"], "format": "pack-quantized", **W4A16_G32},
        "int2": {"targets": ["re:.*o_proj"], "format": "pack-quantized",
                 "weights": {**W4A16_G32["weights"], "num_bits": 2}},
        "int8": {"targets": ["re:.*q_proj"], "format": "naive-quantized",
                 "weights": {**W4A16_G32["weights"], "num_bits": 8}},
        "fp8s": {"targets": ["re:.*k_proj"], "format": "float-quantized", **fp8_static}}}
    with pytest.raises(UserInputError) as err:
        QuantPlan.from_hf(raw, "config.json")
    msg = str(err.value)
    assert "'int2' (int2 weights)" in msg and "'int8' (int8 weights)" in msg and "'fp8s' (static activation" in msg
    assert "'int4'" not in msg
    del raw["config_groups"]["int2"], raw["config_groups"]["int8"], raw["config_groups"]["fp8s"]
    plan = QuantPlan.from_hf(raw, "config.json")
    assert plan.for_module("model.layers.0.mlp.down_proj", True).label == "w4a16 g32"
    assert plan.for_module("model.layers.0.self_attn.o_proj", True) is None


def test_wrong_scale_shape_is_refused(checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    dst = tmp_path / "bad"
    shutil.copytree(checkpoints["w4a16_g32"], dst)
    tensors = load_file(str(dst / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.weight_scale"
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UserInputError, match=r"model\.layers\.1\.mlp\.down_proj\.weight_scale: shape"):
        load_model(str(dst), torch.float32, CPU)


def test_fp8_weight_of_wrong_dtype_is_refused(checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    dst = tmp_path / "bad"
    shutil.copytree(checkpoints["fp8_channel"], dst)
    tensors = load_file(str(dst / "model.safetensors"))
    name = "model.layers.0.self_attn.q_proj.weight"
    tensors[name] = tensors[name].to(torch.bfloat16)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UserInputError, match=r"self_attn\.q_proj\.weight is BF16, expected F8_E4M3 for fp8 channel"):
        load_model(str(dst), torch.float32, CPU)


def test_impossible_combinations(checkpoints, tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")   # refused before it is read
    with pytest.raises(UserInputError, match="--quantization fp8 needs a Hugging Face checkpoint directory"):
        load_model(str(gguf), torch.float32, CPU, quantization="fp8")
    with pytest.raises(UserInputError, match="declares no quantization_config"):
        load_model(str(checkpoints["bf16"]), torch.float32, CPU, quantization="compressed-tensors")
    with pytest.raises(UserInputError, match="already quantised"):
        load_model(str(checkpoints["fp8_channel"]), torch.float32, CPU, quantization="fp8")
    from gemmaserve.config.engine import EngineConfig
    with pytest.raises(UserInputError, match="quantization must be one of"):
        EngineConfig(quantization="int8")


@pytest.mark.parametrize("fmt", ["w4a16_g32", "fp8_channel"])
def test_lora_over_a_quantised_base_equals_peft(checkpoints, tmp_path, fmt):
    """A LoRA adapter over a quantised base (the base's product as the format defines it, the delta beside it)
    equals PEFT's adapter over transformers' model holding our exact weights (for FP8 with compressed-tensors'
    activation quantisation on each base Linear), and moves the logits."""
    import copy

    from peft import LoraConfig, get_peft_model

    from gemmaserve.engine.llm import LLM
    from gemmaserve.engine.step import LoRALoad

    path = checkpoints[fmt]
    llm = LLM(str(path), dtype="float32", page_size=4, cpu_compile="off", kv_cache_memory=8 << 20)
    try:
        model = llm.engine._model
        hf = _hf_decompressed(path)
        _scheme_reference(hf, FORMATS[fmt][0])
        with torch.no_grad():
            for name, m in hf.named_modules():   # our exact weights into transformers' model
                if isinstance(m, torch.nn.Linear) and name != "lm_head":
                    ours_name, rows = _fused_rows(model, name)
                    m.weight.copy_(_ours_dequantized(model, ours_name)[rows])
        torch.manual_seed(11)
        cfg = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                         target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
        peft_model = get_peft_model(copy.deepcopy(hf), cfg).eval()
        peft_model.save_pretrained(tmp_path / "adapter")
        llm.add_lora("a", str(tmp_path / "adapter"))
        ref = llm.engine._loras.get("a")
        llm.engine._runner.lora.load(LoRALoad(0, ref.name, ref.path, ref.digest))
        got = paged_logits(model, [IDS], lora=(llm.engine._runner.lora.weights, [0]))[0]
        with torch.no_grad():
            if fmt.startswith("w4a16"):   # over the CPU's INT4 kernel the slots hold A and B in bf16 (engine/lora.py)
                for n, p in peft_model.named_parameters():
                    if "lora_" in n:
                        p.copy_(p.bfloat16().float())
            want = peft_model(torch.tensor([IDS])).logits[0]
            base = hf(torch.tensor([IDS])).logits[0]
    finally:
        llm.close()
    scale = want.abs().max().item()
    assert (want - base).abs().max().item() > 0.05 * scale   # the adapter matters, so the comparison does
    assert (got - want).abs().max().item() < 2e-5 * scale


def test_the_background_builder_computes_the_engines_key(checkpoints):
    """The compiled CPU steps' builder process is started with the engine's options that decide the packages' key;
    --quantization is one of them (without it the builder loaded the float model and refused to build)."""
    from gemmaserve.config.engine import EngineConfig
    from gemmaserve.engine.aot_builder import builder_config
    from gemmaserve.engine.compile.compiled_steps import build_fields
    from gemmaserve.engine.llm_engine import LLMEngine

    config = EngineConfig(model=str(checkpoints["bf16"]), quantization="fp8", cpu_compile="off",
                          kv_cache_memory=8 << 20)
    with LLMEngine(config) as engine, LLMEngine(builder_config(build_fields(config))) as builder:
        assert engine.info.weights == builder.info.weights == "fp8 channel x 12, float32 x 1"
        assert engine._compiled_steps.store() == builder._compiled_steps.store()
