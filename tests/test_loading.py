"""Loading: HF checkpoint directories (text-only and multimodal naming), GGUF, the embedded alias."""


import pytest
import torch

from gemmaserve import LLM, SamplingParams
from gemmaserve.errors import UserInputError
from gemmaserve.models.gemma3 import Gemma3Config

from helpers import fresh_seed, save_checkpoint, save_vision_checkpoint, tiny_hf_model, tiny_hf_vision


def _hf_greedy(hf, ids, n):
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0,
                          eos_token_id=[])   # never stop, like ignore_eos (min_new_tokens would forbid EOS)
    return out[0, len(ids):].tolist()


def test_checkpoint_dir_generates_like_transformers(tmp_path):
    hf = tiny_hf_model(fresh_seed(), sliding_window=6)
    path = save_checkpoint(hf, tmp_path / "ckpt")
    llm = LLM(model=str(path))
    out = llm.generate(["hello world this is a test of sliding windows"],
                       SamplingParams(max_tokens=20, ignore_eos=True))[0]
    assert out.prompt_token_ids[0] == 2  # BOS from the tokenizer's post-processor
    assert out.outputs[0].token_ids == _hf_greedy(hf, out.prompt_token_ids, 20)


def test_multimodal_checkpoint_names_load_both_towers(tmp_path):
    """Gemma3ForConditionalGeneration: nested text_config, `model.language_model.` / `model.vision_tower.`
    prefixes (the vision tower and projector load too); text-only prompts generate as transformers'."""
    from safetensors.torch import save_file

    hf = tiny_hf_vision(fresh_seed())
    path = save_vision_checkpoint(hf, tmp_path / "mm")
    for f in path.glob("*.safetensors"):
        f.unlink()
    save_file({k: v.contiguous() for k, v in hf.state_dict().items() if k != "lm_head.weight"},
              str(path / "model.safetensors"))
    llm = LLM(model=str(path))
    assert llm.engine.inputs.image_layout is not None
    out = llm.generate(["some text"], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == _hf_greedy(hf, out.prompt_token_ids, 8)


def test_missing_weight_is_an_error(tmp_path):
    from safetensors.torch import load_file, save_file

    path = save_checkpoint(tiny_hf_model(fresh_seed()), tmp_path / "ckpt")
    f = next(path.glob("*.safetensors"))
    tensors = load_file(str(f))
    del tensors["model.layers.3.self_attn.k_proj.weight"]
    save_file(tensors, str(f))
    with pytest.raises(ValueError, match="missing weights.*layers.3.self_attn.qkv_proj"):
        LLM(model=str(path))
    f.write_bytes(f.read_bytes()[:1000])   # a truncated download
    with pytest.raises(UserInputError, match="cannot read .*safetensors"):
        LLM(model=str(path))


def test_legacy_rope_fields_parse_like_rope_parameters():
    new = Gemma3Config.from_hf(dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4, head_dim=16,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}))
    old = Gemma3Config.from_hf(dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4, head_dim=16,
        rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0},
        sliding_window_pattern=6))
    assert new == old
    assert old.layer_types[5] == "full_attention" and old.layer_types[4] == "sliding_attention"
    with pytest.raises(ValueError, match="unsupported RoPE type 'yarn'"):
        Gemma3Config.from_hf(dict(hidden_size=64, intermediate_size=96, num_hidden_layers=6,
                                  rope_scaling={"rope_type": "yarn", "factor": 4.0}))


def test_embedded_gguf_config_and_weights(llm_270m):
    model = llm_270m.engine._model
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.head_dim, cfg.sliding_window) == (18, 640, 256, 512)
    assert cfg.layer_types.count("full_attention") == 3 and cfg.layer_types[5] == "full_attention"
    assert cfg.query_pre_attn_scalar == 256 and cfg.vocab_size == 262144
    assert llm_270m.engine.info.load_seconds < 60  # a sanity bound; BENCHMARKS.md has the measured figure


def test_embedded_model_predicts_natural_text(llm_270m):
    """Weights decoded right (GGUF stores Gemma norms as 1 + w): mean NLL of a plain English passage is
    ~1.9 nats; with the norm offset left in it is ~18."""
    from helpers import paged_logits

    text = ("The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It is named "
            "after the engineer Gustave Eiffel, whose company designed and built the tower from 1887 to 1889.")
    ids = llm_270m.tokenizer.encode(text)
    logits = paged_logits(llm_270m.engine._model, [ids], page_size=16)[0]
    nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:])).item()
    assert nll < 3.0, nll


def test_q8_0_fast_path_equals_gguf_dequantize():
    import gguf
    import numpy as np

    from gemmaserve.models.gguf_file import dequantize_q8_0

    rng = np.random.default_rng(fresh_seed())
    values = rng.standard_normal((8, 64)).astype(np.float32)
    packed = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0)
    ref = gguf.quants.dequantize(packed, gguf.GGMLQuantizationType.Q8_0)
    assert torch.equal(dequantize_q8_0(packed).reshape(8, 64), torch.from_numpy(ref))


def test_gguf_tensor_names_all_map(llm_270m):
    from gemmaserve.models.gguf_file import GGUFFile
    from gemmaserve.models.loader import resolve_model

    f = GGUFFile(resolve_model("gemma3-270m").path)
    kinds = {t.quant_type for t in f.tensors()}
    assert {"Q4_K", "Q5_0", "Q6_K", "Q8_0", "F32"} <= kinds
    model = llm_270m.engine._model
    names = {model.gguf_name(t.name)[0] for t in f.tensors()}
    assert len(names) == len(f.tensors())
