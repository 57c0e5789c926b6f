"""An untied output head (config tie_word_embeddings: false, lm_head.weight apart from the embedding), as
transformers serves it: Gemma 3 and Gemma 4 checkpoints give transformers' logits and greedy tokens; GGUF files
carry it as output.weight, F32 (exact) and Q8_0 (the quantised path: the head a QuantEmbedding of its own); a
config that unties the head with no lm_head.weight in the checkpoint is refused by name."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from gemmaserve import LLM, SamplingParams
from gemmaserve.models.quant import QuantEmbedding

from helpers import (add_gemma3_gguf_header, add_gguf_tokenizer, fresh_seed, paged_logits, save_checkpoint,
                     tiny_gemma4_hf, tiny_hf_model)
from test_gemma4_loading import NEW_TOKENS, PROMPT, _assert_greedy_like_hf, _write_gguf, add_gguf_tensor

TOL = 1e-4   # fp32 against fp32 (test_model_vs_hf.py's)


def _untied(family: str, seed: int):
    hf = (tiny_hf_model(seed, tie_word_embeddings=False) if family == "gemma3"
          else tiny_gemma4_hf(seed, "e2b", tie_word_embeddings=False))
    head, table = hf.lm_head.weight, hf.model.embed_tokens.weight
    assert not hf.config.tie_word_embeddings and head.data_ptr() != table.data_ptr()
    assert (head - table).abs().max() > 0.1   # a distinct head: serving the table instead is far off
    return hf


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def _ids(llm: LLM) -> list[int]:
    return llm.tokenizer.encode(PROMPT)


@pytest.mark.parametrize("family", ["gemma3", "gemma4"])
def test_untied_head_gives_transformers_logits_and_tokens(tmp_path, family):
    seed = fresh_seed()
    hf = _untied(family, seed)
    path = save_checkpoint(hf, tmp_path / family)
    assert "lm_head.weight" in load_file(str(next(path.glob("*.safetensors"))))
    llm = LLM(model=str(path), dtype="float32", page_size=4, kv_cache_memory=16 << 20)
    model = llm.engine._model
    assert model.output_embedding_name() == "lm_head"
    ids = _ids(llm)
    err = (paged_logits(model, [ids])[0] - _hf_logits(hf, ids)).abs().max().item()
    assert err < TOL, f"{family} seed={seed}: max abs diff {err}"
    out = llm.generate([PROMPT], SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))[0]
    _assert_greedy_like_hf(hf, out.prompt_token_ids, out.outputs[0].token_ids, NEW_TOKENS, f"{family} seed={seed}")


@pytest.mark.parametrize("family", ["gemma3", "gemma4"])
def test_untied_config_without_lm_head_is_refused_by_name(tmp_path, family):
    path = save_checkpoint(_untied(family, fresh_seed()), tmp_path / family)
    (file,) = path.glob("*.safetensors")
    tensors = load_file(str(file))
    del tensors["lm_head.weight"]
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing lm_head\.weight: its config says tie_word_embeddings: false"):
        LLM(model=str(path), dtype="float32")


# -- GGUF: output.weight ----------------------------------------------------------------------------------
def _write_gemma3_gguf(hf, path: Path, q8_0: bool) -> Path:
    """The tiny HF Gemma 3 as llama.cpp's gemma3 GGUF: norms stored as 1 + w, a full layer every 6th (the
    tiny config's default pattern), query_pre_attn_scalar as attention.scale; the untied head as output.weight."""
    import gguf
    from gguf.constants import MODEL_ARCH, MODEL_TENSOR as T, MODEL_TENSORS, TENSOR_NAMES

    cfg = hf.config
    assert list(cfg.layer_types) == ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                     for i in range(cfg.num_hidden_layers)]
    w = gguf.GGUFWriter(str(path), "gemma3")
    add_gemma3_gguf_header(w, cfg)
    add_gguf_tokenizer(w, cfg.vocab_size)
    layer = {"input_layernorm": T.ATTN_NORM, "self_attn.q_proj": T.ATTN_Q, "self_attn.k_proj": T.ATTN_K,
             "self_attn.v_proj": T.ATTN_V, "self_attn.o_proj": T.ATTN_OUT, "self_attn.q_norm": T.ATTN_Q_NORM,
             "self_attn.k_norm": T.ATTN_K_NORM, "post_attention_layernorm": T.ATTN_POST_NORM,
             "pre_feedforward_layernorm": T.FFN_PRE_NORM, "post_feedforward_layernorm": T.FFN_POST_NORM,
             "mlp.gate_proj": T.FFN_GATE, "mlp.up_proj": T.FFN_UP, "mlp.down_proj": T.FFN_DOWN}
    top = {"model.embed_tokens": T.TOKEN_EMBD, "model.norm": T.OUTPUT_NORM, "lm_head": T.OUTPUT}
    for name, t in hf.state_dict().items():
        module = name.removesuffix(".weight")
        if module.startswith("model.layers."):
            _, _, bid, rest = module.split(".", 3)
            kind, bid = layer[rest], int(bid)
        else:
            kind, bid = top[module], None
        assert kind in MODEL_TENSORS[MODEL_ARCH.GEMMA3], kind
        value = t.detach().float().numpy().copy()
        add_gguf_tensor(w, TENSOR_NAMES[kind].format(bid=bid) + ".weight",
                        value + 1.0 if "norm" in module else value, q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _gguf(family: str, hf, path: Path, q8_0: bool) -> Path:
    return _write_gemma3_gguf(hf, path, q8_0) if family == "gemma3" else _write_gguf(hf, path, q8_0=q8_0)


@pytest.mark.parametrize("family", ["gemma3", "gemma4"])
def test_gguf_output_weight_is_the_head(tmp_path, monkeypatch, family):
    """F32: transformers' logits and greedy tokens. Q8_0 (quantised on the CPU, dtype auto): the head is a
    QuantEmbedding of its own (the embedding then a lookup-only table) and its logits are those of the same
    file loaded dequantised in fp32, within int8's error; the embedding as the head would be ~100% off."""
    monkeypatch.setenv("GEMMASERVE_CACHE_DIR", str(tmp_path / "cache"))   # tokenizer and quantised weights
    seed = fresh_seed()
    hf = _untied(family, seed)
    exact = LLM(model=str(_gguf(family, hf, tmp_path / "f32.gguf", q8_0=False)), dtype="float32", page_size=4,
                kv_cache_memory=16 << 20)
    assert not exact.engine._model.config.tie_word_embeddings
    ids = _ids(exact)
    err = (paged_logits(exact.engine._model, [ids])[0] - _hf_logits(hf, ids)).abs().max().item()
    assert err < TOL, f"{family} seed={seed}: max abs diff {err}"
    out = exact.generate([PROMPT], SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))[0]
    _assert_greedy_like_hf(hf, out.prompt_token_ids, out.outputs[0].token_ids, NEW_TOKENS, f"{family} seed={seed}")

    q8 = _gguf(family, hf, tmp_path / "q8.gguf", q8_0=True)
    quant = LLM(model=str(q8), page_size=4, kv_cache_memory=16 << 20)
    model = quant.engine._model
    assert isinstance(model.lm_head, QuantEmbedding) and model.lm_head.head4 is not None
    assert isinstance(model.model.embed_tokens, QuantEmbedding)
    assert model.model.embed_tokens.head4 is None and model.model.embed_tokens.head is None
    ref = paged_logits(LLM(model=str(q8), dtype="float32").engine._model, [ids])[0]
    got = paged_logits(model, [ids])[0]
    rel = ((got - ref).norm() / ref.norm()).item()
    assert rel < 0.15, f"{family} seed={seed}: quantised logits {rel:.3f} from the fp32 ones"
    assert np.isfinite(rel)
