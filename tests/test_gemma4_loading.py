"""Gemma 4 loading on tiny random models: the command line on a KV-sharing checkpoint (carrying the unused
consumer k/v tensors real E2B/E4B checkpoints carry), llama.cpp-style GGUF files (PLE + KV sharing, MoE),
a Gemma4ForConditionalGeneration checkpoint served text-only, and clear errors for bad input.

The reference is transformers' greedy `generate` on the prompt ids our tokenizer produced."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from gemmaserve import LLM, SamplingParams
from gemmaserve.models.gemma4 import Gemma4Config
from gemmaserve.models.tokenizer import Tokenizer

from helpers import add_gguf_tokenizer, fresh_seed, routing_margin, save_checkpoint, tiny_gemma4_hf

FULL, SLIDING = "full_attention", "sliding_attention"
PROMPT = "hello world this is a test of sliding windows"   # ~45 tokens: many windows of 4-6
NEW_TOKENS = 12


def _hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    """transformers' greedy continuation that never stops at EOS, as `ignore_eos` does (min_new_tokens
    would instead forbid EOS and so change the argmax where EOS wins)."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=[], pad_token_id=0)
    tokens = out[0, len(ids):].tolist()
    assert len(tokens) == n
    return tokens


def _assert_greedy_like_hf(hf, ids: list[int], got: list[int], n: int, what: str, stop_at_eos: bool = False) -> None:
    """`got` is transformers' greedy continuation, except past a near tie: both run fp32 (~1e-5 apart), so
    where HF's two best logits are within 1e-4 either pick is right and the continuations part."""
    expected = _hf_greedy(hf, ids, n)
    if stop_at_eos and 1 in expected:
        expected = expected[:expected.index(1) + 1]   # EOS (1) ends the completion and is reported
    j = next((k for k, (a, b) in enumerate(zip(got, expected)) if a != b), None)
    if j is None:
        assert got == expected, f"{what}: {got} != {expected}"
        return
    with torch.no_grad():
        logits = hf(torch.tensor([ids + expected[:j]])).logits[0, -1]
    gap = (logits[expected[j]] - logits[got[j]]).item()
    if gap >= 1e-4 and routing_margin(hf, ids + expected[:j]) < 1e-5:
        return   # an MoE router's top-k was a near tie on the way: either expert set is right
    assert gap < 1e-4, f"{what}: token {j} is {got[j]}, transformers' is {expected[j]} (logit gap {gap:.3g})"


def _kv_geometry(hf) -> list[tuple[int, int, bool]]:
    """(KV heads, head dim, KV-shared) per layer, read from transformers' own attention modules."""
    heads = hf.config.num_attention_heads
    return [(heads // a.num_key_value_groups, a.head_dim, a.is_kv_shared_layer)
            for a in (layer.self_attn for layer in hf.model.layers)]


# -- 1. the command line -----------------------------------------------------------------------------

def _add_unused_shared_kv(hf, path: Path, seed: int) -> list[str]:
    """Add the k_proj/v_proj/k_norm/v_norm tensors HF checkpoints keep for KV-shared layers, as garbage."""
    (file,) = path.glob("*.safetensors")
    tensors = load_file(str(file))
    gen = torch.Generator().manual_seed(seed)
    h = hf.config.hidden_size
    added = []
    for i, (kv, d, shared) in enumerate(_kv_geometry(hf)):
        if not shared:
            continue
        p = f"model.layers.{i}.self_attn."
        for name, shape in (("k_proj.weight", (kv * d, h)), ("v_proj.weight", (kv * d, h)),
                            ("k_norm.weight", (d,)), ("v_norm.weight", (d,))):
            assert p + name not in tensors
            tensors[p + name] = 100.0 * torch.randn(shape, generator=gen)
            added.append(p + name)
    save_file(tensors, str(file), metadata={"format": "pt"})
    return added


def test_command_line_generates_like_transformers(tmp_path):
    """`gemmaserve generate --json --model DIR` on an E2B-style checkpoint (PLE, KV sharing, double-wide MLP)
    whose KV-shared layers carry garbage k/v weights that must never be used."""
    seed = fresh_seed()
    hf = tiny_gemma4_hf(seed, "e2b")
    path = save_checkpoint(hf, tmp_path / "e2b")
    assert len(_add_unused_shared_kv(hf, path, seed)) == 4 * 4   # the last 4 of 9 layers
    res = subprocess.run([sys.executable, "-m", "gemmaserve", "generate", "--json", "--model", str(path),
                          "--max-tokens", str(NEW_TOKENS), "--temperature", "0", "--kv-cache-memory", "64MiB",
                          PROMPT], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, f"seed={seed}: {res.stderr}"
    (row,) = [json.loads(line) for line in res.stdout.splitlines()]
    ids = Tokenizer.from_checkpoint_dir(path).encode(PROMPT)
    assert row["prompt_tokens"] == len(ids) and ids[0] == 2
    # The command line has no --ignore-eos: it stops after EOS (1), which it reports as the last token.
    tokens = row["token_ids"]
    _assert_greedy_like_hf(hf, ids, tokens, NEW_TOKENS, f"seed={seed}", stop_at_eos=True)
    assert row["finish_reason"] == ("stop" if tokens[-1] == 1 else "length")


# -- 2. GGUF ---------------------------------------------------------------------------------------

def _tensor_names():
    from gguf.constants import MODEL_TENSOR as T

    layer = {   # transformers name inside a layer -> (llama.cpp tensor, suffix)
        "input_layernorm.weight": (T.ATTN_NORM, "weight"),
        "self_attn.q_proj.weight": (T.ATTN_Q, "weight"), "self_attn.k_proj.weight": (T.ATTN_K, "weight"),
        "self_attn.v_proj.weight": (T.ATTN_V, "weight"), "self_attn.o_proj.weight": (T.ATTN_OUT, "weight"),
        "self_attn.q_norm.weight": (T.ATTN_Q_NORM, "weight"), "self_attn.k_norm.weight": (T.ATTN_K_NORM, "weight"),
        "post_attention_layernorm.weight": (T.ATTN_POST_NORM, "weight"),
        "pre_feedforward_layernorm.weight": (T.FFN_PRE_NORM, "weight"),
        "post_feedforward_layernorm.weight": (T.FFN_POST_NORM, "weight"),
        "mlp.gate_proj.weight": (T.FFN_GATE, "weight"), "mlp.up_proj.weight": (T.FFN_UP, "weight"),
        "mlp.down_proj.weight": (T.FFN_DOWN, "weight"),
        "pre_feedforward_layernorm_2.weight": (T.FFN_PRE_NORM_2, "weight"),
        "post_feedforward_layernorm_1.weight": (T.FFN_POST_NORM_1, "weight"),
        "post_feedforward_layernorm_2.weight": (T.FFN_POST_NORM_2, "weight"),
        "router.proj.weight": (T.FFN_GATE_INP, "weight"), "router.scale": (T.FFN_GATE_INP, "scale"),
        "router.per_expert_scale": (T.FFN_DOWN_EXP, "scale"),
        "experts.gate_up_proj": (T.FFN_GATE_UP_EXP, "weight"), "experts.down_proj": (T.FFN_DOWN_EXP, "weight"),
        "layer_scalar": (T.LAYER_OUT_SCALE, "weight"),
        "per_layer_input_gate.weight": (T.PER_LAYER_INP_GATE, "weight"),
        "per_layer_projection.weight": (T.PER_LAYER_PROJ, "weight"),
        "post_per_layer_input_norm.weight": (T.PER_LAYER_POST_NORM, "weight"),
    }
    top = {
        "model.embed_tokens.weight": (T.TOKEN_EMBD, "weight"), "model.norm.weight": (T.OUTPUT_NORM, "weight"),
        "model.embed_tokens_per_layer.weight": (T.PER_LAYER_TOKEN_EMBD, "weight"),
        "model.per_layer_model_projection.weight": (T.PER_LAYER_MODEL_PROJ, "weight"),
        "model.per_layer_projection_norm.weight": (T.PER_LAYER_PROJ_NORM, "weight"),
        "lm_head.weight": (T.OUTPUT, "weight"),   # untied checkpoints only
    }
    return layer, top


def add_gguf_tensor(w, name: str, value: np.ndarray, q8_0: bool) -> None:
    """F32, or with `q8_0` a matrix whose rows are whole blocks of 32 as Q8_0 (GGUF's usual 8-bit type)."""
    import gguf

    if q8_0 and value.ndim == 2 and value.shape[-1] % 32 == 0:
        qtype = gguf.GGMLQuantizationType.Q8_0
        w.add_tensor(name, gguf.quants.quantize(value, qtype), raw_dtype=qtype)
    else:
        w.add_tensor(name, value)


def _gguf_name(kind, suffix: str, bid: int | None = None) -> str:
    from gguf.constants import MODEL_ARCH, MODEL_TENSORS, TENSOR_NAMES

    assert kind in MODEL_TENSORS[MODEL_ARCH.GEMMA4], kind
    return f"{TENSOR_NAMES[kind].format(bid=bid)}.{suffix}"


def _write_gguf(hf, path: Path, extra: dict[str, np.ndarray] | None = None, q8_0: bool = False) -> Path:
    """The tiny HF model as llama.cpp's gemma4 GGUF (F32): norms as plain w, proportional RoPE as rope_freqs,
    per-layer arrays where layers differ, K = V implied by full layers without attn_v; an untied head as
    `output.weight`. `q8_0`: matrices whose rows are whole Q8_0 blocks stored Q8_0 (a quantised file)."""
    import gguf

    cfg = hf.config
    n, types = cfg.num_hidden_layers, list(cfg.layer_types)
    geometry = _kv_geometry(hf)
    full = types.index(FULL)
    w = gguf.GGUFWriter(str(path), "gemma4")
    w.add_block_count(n)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    ffn = [layer.mlp.gate_proj.weight.shape[0] for layer in hf.model.layers]
    w.add_feed_forward_length(ffn if len(set(ffn)) > 1 else ffn[0])
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv([kv for kv, _, _ in geometry])
    w.add_key_length(geometry[full][1])
    w.add_value_length(geometry[full][1])
    w.add_key_length_swa(geometry[types.index(SLIDING)][1])
    w.add_value_length_swa(geometry[types.index(SLIDING)][1])
    w.add_sliding_window(cfg.sliding_window)
    w.add_sliding_window_pattern([t == SLIDING for t in types])
    w.add_shared_kv_layers(cfg.num_kv_shared_layers)
    if cfg.hidden_size_per_layer_input:
        w.add_embedding_length_per_layer_input(cfg.hidden_size_per_layer_input)
    w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    rope = cfg.rope_parameters
    w.add_rope_freq_base(rope[FULL]["rope_theta"])
    w.add_rope_freq_base_swa(rope[SLIDING]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if cfg.enable_moe_block:
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.top_k_experts)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    add_gguf_tokenizer(w, cfg.vocab_size)

    from gguf.constants import MODEL_TENSOR

    # llama.cpp's proportional RoPE: frequency divisors, 1 for the rotated pairs, huge for the pass-through.
    d_full = geometry[full][1]
    rotated = int(rope[FULL]["partial_rotary_factor"] * d_full // 2)
    w.add_tensor(_gguf_name(MODEL_TENSOR.ROPE_FREQS, "weight"),
                 np.where(np.arange(d_full // 2) < rotated, 1.0, 1e30).astype(np.float32))
    layer_names, top_names = _tensor_names()
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue   # tied to the embedding
        if name.startswith("model.layers."):
            _, _, bid, rest = name.split(".", 3)
            gname = _gguf_name(*layer_names[rest], int(bid))
        else:
            gname = _gguf_name(*top_names[name])
        add_gguf_tensor(w, gname, t.detach().to(torch.float32).numpy().copy(), q8_0)
    for name, value in (extra or {}).items():
        w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _unused_shared_kv_gguf(hf, seed: int) -> dict[str, np.ndarray]:
    """attn_k / attn_v / attn_k_norm for the KV-shared layers, as garbage a converter may have kept."""
    rng = np.random.default_rng(seed)
    h = hf.config.hidden_size
    out = {}
    for i, (kv, d, shared) in enumerate(_kv_geometry(hf)):
        if shared:
            for name, shape in (("attn_k.weight", (kv * d, h)), ("attn_v.weight", (kv * d, h)),
                                ("attn_k_norm.weight", (d,))):
                out[f"blk.{i}.{name}"] = (100.0 * rng.standard_normal(shape)).astype(np.float32)
    return out


# 26B-A4B with RoPE other than the defaults, so the config must come from the file (freq bases, and the
# rotated fraction from rope_freqs).
_GGUF_CASES = {"e4b": {}, "e2b": {}, "26b_a4b": dict(rope_parameters={
    SLIDING: {"rope_type": "default", "rope_theta": 20_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 500_000.0}})}


@pytest.mark.parametrize("variant", sorted(_GGUF_CASES))
def test_gguf_generates_like_transformers(tmp_path, monkeypatch, variant):
    """E4B / E2B-style (PLE, KV sharing; the GGUF also carries garbage attn_k/attn_v for the shared layers;
    E2B's double-wide MLP makes feed_forward_length an array) and 26B-A4B-style (MoE beside the dense MLP,
    K = V): config and greedy tokens as transformers."""
    monkeypatch.setenv("GEMMASERVE_CACHE_DIR", str(tmp_path / "cache"))   # the rebuilt tokenizer's cache
    seed = fresh_seed()
    hf = tiny_gemma4_hf(seed, variant, **_GGUF_CASES[variant])
    path = _write_gguf(hf, tmp_path / f"{variant}.gguf", extra=_unused_shared_kv_gguf(hf, seed))
    llm = LLM(model=str(path))

    parsed, expected = llm.engine._model.config, Gemma4Config.from_hf(hf.config.to_dict())
    assert parsed.rms_norm_eps == pytest.approx(expected.rms_norm_eps, rel=1e-6)   # GGUF keeps it as float32
    carried = dict(rms_norm_eps=expected.rms_norm_eps)
    if not expected.hidden_size_per_layer_input:   # without PLE tensors GGUF has no per-layer vocabulary
        carried["vocab_size_per_layer_input"] = expected.vocab_size_per_layer_input
    assert dataclasses.replace(parsed, **carried) == expected
    assert (parsed.moe, parsed.hidden_size_per_layer_input > 0) == (variant == "26b_a4b", variant != "26b_a4b")
    assert any(s is not None for s in parsed.kv_sources) == (variant != "26b_a4b")
    assert (len(set(parsed.mlp_sizes)) > 1) == (variant == "e2b")
    assert parsed.attention_k_eq_v == (variant == "26b_a4b")

    out = llm.generate([PROMPT], SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))[0]
    ids = out.prompt_token_ids
    assert ids[0] == 2 and llm.tokenizer.decode(ids) == PROMPT
    assert llm.tokenizer.token_to_id("hello") in ids   # merges rebuilt from the vocabulary
    _assert_greedy_like_hf(hf, ids, out.outputs[0].token_ids, NEW_TOKENS, f"{variant} seed={seed}")


# -- 3. bad input ------------------------------------------------------------------------------------

@pytest.fixture
def checkpoint(tmp_path):
    """A saved tiny 31B-style checkpoint (K = V on full layers) and its HF model."""
    hf = tiny_gemma4_hf(fresh_seed(), "31b")
    return save_checkpoint(hf, tmp_path / "31b"), hf


def _edit_tensors(path: Path, edit) -> None:
    (file,) = path.glob("*.safetensors")
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def _edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_missing_tensor_is_named(checkpoint):
    path, _ = checkpoint
    _edit_tensors(path, lambda t: t.pop("model.layers.3.mlp.down_proj.weight"))
    with pytest.raises(ValueError, match=r"missing weights.*'model\.layers\.3\.mlp\.down_proj\.weight'"):
        LLM(model=str(path))


@pytest.mark.parametrize("name, why", [
    ("model.layers.0.self_attn.bogus_proj.weight", r"has no place in the model"),
    ("model.layers.7.self_attn.v_proj.weight", r"has no place in the model \(this layer has no v_proj"),  # K = V
])
def test_unknown_tensor_is_named(checkpoint, name, why):
    path, hf = checkpoint
    assert hf.config.layer_types[7] == FULL and hf.config.attention_k_eq_v
    _edit_tensors(path, lambda t: t.__setitem__(name, torch.zeros(16, hf.config.hidden_size)))
    with pytest.raises(ValueError, match=f"'{name}' " + why):
        LLM(model=str(path))


def test_unknown_rope_type_is_named(checkpoint):
    path, hf = checkpoint
    rope = dict(hf.config.rope_parameters)
    rope[FULL] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}
    _edit_config(path, rope_parameters=rope)
    with pytest.raises(ValueError, match=r"unsupported RoPE type 'yarn' on full_attention layers"):
        LLM(model=str(path))


def test_bidirectional_all_is_refused(checkpoint):
    path, _ = checkpoint
    _edit_config(path, use_bidirectional_attention="all")
    with pytest.raises(ValueError, match=r"bidirectional \(embedding\) Gemma 4 models are not supported"):
        LLM(model=str(path))


@pytest.mark.parametrize("name", ["blk.0.attn_bogus.weight", "blk.99.attn_q.weight"])
def test_gguf_unexpected_tensor_is_named(tmp_path, monkeypatch, name):
    monkeypatch.setenv("GEMMASERVE_CACHE_DIR", str(tmp_path / "cache"))
    hf = tiny_gemma4_hf(fresh_seed(), "31b")
    path = _write_gguf(hf, tmp_path / "bad.gguf", extra={name: np.zeros((4, 4), dtype=np.float32)})
    with pytest.raises(ValueError, match=f"unexpected tensor '{name}'"):
        LLM(model=str(path))


# -- multimodal checkpoints ---------------------------------------------------------------------------

def test_conditional_generation_checkpoint_loads_both_towers(tmp_path):
    """Gemma4ForConditionalGeneration: nested text_config, `model.language_model.` / `model.vision_tower.` /
    `model.embed_vision.` weights all load; scratch reuse off by default (an image must not be split
    across chunks); text prompts generate as transformers' does."""
    from helpers import save_gemma4_vision_checkpoint, tiny_hf_gemma4_vision

    seed = fresh_seed()
    hf = tiny_hf_gemma4_vision(seed, "31b")
    mm = save_gemma4_vision_checkpoint(hf, tmp_path / "mm")
    (file,) = mm.glob("*.safetensors")
    tensors = load_file(str(file))
    assert any("vision_tower." in k for k in tensors)
    assert any("embed_vision." in k for k in tensors)
    llm = LLM(model=str(mm))
    assert llm.engine._model.config.multimodal and llm.engine.inputs.image_layout is not None
    assert llm.engine.info.swa_scratch_reuse is False
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    out = llm.generate([PROMPT], params)[0]
    _assert_greedy_like_hf(hf, out.prompt_token_ids, out.outputs[0].token_ids, NEW_TOKENS, f"seed={seed}")
