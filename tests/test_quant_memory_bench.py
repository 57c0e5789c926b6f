"""The W4A16 memory benchmark (benchmarks/gpu_quant_memory.py) without a GPU: its checkpoint writer lays tiny Gemma 4
configs out as transformers names them and as compressed-tensors packs them (its own unpacking of our words gives
the weights our loader holds), the checkpoint loads as W4A16 and generates, and the whole benchmark runs on the
CPU, writing every phase."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import gpu_quant_memory as bench
from gemmaserve.models.loader import load_model

from helpers import GEMMA4_BASE, GEMMA4_VARIANTS

CPU = torch.device("cpu")


def _raw(variant: str) -> dict:
    cfg = {**GEMMA4_BASE, **GEMMA4_VARIANTS[variant]}
    return {"architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text", **cfg}


def _checkpoint_module_names(path) -> dict[str, set[str]]:
    """Checkpoint module -> its tensors' leaves, over every shard the index names (each tensor in its shard)."""
    from safetensors import safe_open

    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    out: dict[str, set[str]] = {}
    for file in sorted(set(index.values())):
        with safe_open(str(path / file), framework="pt") as fh:
            for name in fh.keys():
                assert index[name] == file, name
                module, _, leaf = name.rpartition(".")
                out.setdefault(module, set()).add(leaf)
    assert sum(len(v) for v in out.values()) == len(index)
    return out


@pytest.mark.parametrize("variant", ["31b", "e4b", "e2b"])
def test_layout_is_transformers_and_loads_as_w4a16(tmp_path, variant):
    """Tensor names are transformers' own (its state dict, the tied head aside); attention and MLP projections are
    pack-quantized (weight_packed, weight_scale, weight_shape), everything else bf16; the loader takes every
    projection as W4A16 and leaves the per-layer-input Linears (E models) as saved."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    raw = _raw(variant)
    written = bench.write_w4a16_checkpoint(tmp_path / "ckpt", raw, shard_bytes=20_000, device="cpu")
    assert written.files > 1
    modules = _checkpoint_module_names(tmp_path / "ckpt")
    cfg = {k: v for k, v in raw.items() if k not in ("architectures", "model_type")}
    with torch.device("meta"):
        hf = Gemma4ForCausalLM(Gemma4TextConfig(**cfg))
    theirs = {n.rpartition(".")[0] if n.endswith(".weight") else n for n in hf.state_dict()} - {"lm_head"}
    ours = {m if leaves & {"weight", "weight_packed"} else f"{m}.{leaf}"
            for m, leaves in modules.items() for leaf in leaves}
    assert ours == theirs
    projections = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    for m, leaves in modules.items():
        if m.endswith(projections):
            assert leaves == {"weight_packed", "weight_scale", "weight_shape"}, m
        else:
            assert "weight_packed" not in leaves, m
    loaded = load_model(str(tmp_path / "ckpt"), torch.float32, CPU)
    n_proj = sum(m.endswith(projections) for m in modules)
    assert sum(loaded.weight_formats.values()) > 0 and "w4a16 g32" in loaded.weight_formats
    fused = sum(1 for m in modules if m.endswith(("o_proj", "down_proj")))   # one per attention / MLP
    assert loaded.weight_formats["w4a16 g32"] == 2 * fused < n_proj


def test_words_and_scales_are_compressed_tensors(tmp_path):
    """compressed-tensors validates the quantization_config and decompresses every module of the checkpoint to the
    weight our loader multiplies by (bit for bit, in bf16); the weights have about the spread random_model draws."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file

    raw = _raw("31b")
    path = tmp_path / "ckpt"
    bench.write_w4a16_checkpoint(path, raw, device="cpu")
    config = json.loads((path / "config.json").read_text())
    qcfg = QuantizationConfig.model_validate(config["quantization_config"])
    scheme = qcfg.config_groups["group_0"]
    compressor = BaseCompressor.get_value_from_registry(qcfg.format)
    tensors = load_file(str(path / "model.safetensors"))
    model = load_model(str(path), torch.float32, CPU).model
    checked = 0
    for name in tensors:
        if not name.endswith(".weight_packed"):
            continue
        module = name.removesuffix(".weight_packed")
        local = {k[len(module) + 1:]: v for k, v in tensors.items() if k.startswith(module + ".")}
        theirs = compressor.decompress(local, scheme)["weight"]
        prefix, part = module.rsplit(".", 1)
        fused, idx = model.stacked.get(part, (part, 0))
        ours_module = model.get_submodule(f"{prefix}.{fused}")
        sizes = model.shard_sizes(f"{prefix}.{fused}.weight") if part in model.stacked else (theirs.shape[0],)
        start = sum(sizes[:idx])
        mine = ours_module.dequantize()[start:start + sizes[idx]]
        assert theirs.dtype == torch.bfloat16 and torch.equal(mine.to(torch.bfloat16), theirs), module
        assert 0.6 < theirs.float().std().item() * theirs.shape[1] ** 0.5 < 1.4, module
        checked += 1
    assert checked == len([m for m in tensors if m.endswith(".weight_shape")]) > 0


def test_the_benchmark_runs_on_the_cpu(tmp_path, monkeypatch):
    """Every phase on a tiny config: written, loaded as W4A16 (its weights' bytes: packed words, scales, the rest),
    the KV figures, four prompts, a long one and batch-1 decode; the checkpoint removed afterwards."""
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(_raw("31b")))
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    ckpt = tmp_path / "ckpt"
    engine = {"kv_cache_memory": 8 << 20, "cpu_compile": "off", "max_model_len": 1024}
    rc = bench.main([str(config), "--device", "cpu", "--dir", str(ckpt), "--long", "300", "--new-tokens", "8",
                     "--decode-steps", "3", "--decode-context", "100", "--engine", json.dumps(engine)])
    res = json.loads((tmp_path / "out" / "gpu_quant_memory.json").read_text())
    assert rc == 0, res
    assert not ckpt.exists()
    write, load, serve = res["write"], res["load"], res["serve"]
    assert write["files"] == 1 and write["bytes_by_kind"]["int4"] > 0 and write["bytes_by_kind"]["scale"] > 0
    assert load["weights"] == "w4a16 g32 x 32, float32 x 1"   # 8 layers: qkv, o, gate_up, down
    weights = load["weight_bytes"]
    assert weights["packed"] > 0 and weights["scales"] > 0 and weights["dense"] > 0
    assert load["kv_bytes"] == load["kv_pages"] * load["page_bytes"] <= 8 << 20
    assert load["kv_tensor_bytes"] >= load["kv_bytes"]
    assert load["max_tokens_one_sequence"] > load["tokens_if_every_layer_kept_every_token"] > 0
    assert load["sequences_of_300"] >= 1 and "kv_target_met" not in load   # the target is checked on CUDA only
    assert serve["prompts"]["count"] == 4 and serve["prompts"]["repeat_equal"]
    assert serve["long"]["new_tokens"] == 8 and serve["long"]["peak_pages_used"] > 0
    assert serve["decode_batch1"]["tok_s"] > 0


def test_a_directory_that_is_not_empty_is_refused_and_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    (tmp_path / "mine.txt").write_text("keep me")
    assert bench.main(["--device", "cpu", "--dir", str(tmp_path)]) == 2
    assert (tmp_path / "mine.txt").read_text() == "keep me"
