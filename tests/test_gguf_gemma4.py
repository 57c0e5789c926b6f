"""Gemma 4 GGUF files as llama.cpp's converter writes them, loaded on the CPU and checked against the same weights
loaded from the Hugging Face directory they were converted from, and against transformers.

`convert` below writes a tiny saved checkpoint the way convert_hf_to_gguf.py's Gemma4Model does (llama.cpp,
conversion/gemma.py; the keys and tensor names are the `gguf` package's own):
* metadata: context/embedding length, block count, head count, head_count_kv (one number, or one per layer where
  the config has num_global_key_value_heads), key/value_length = global_head_dim and *_swa = head_dim,
  rope.freq_base (full layers' theta) and rope.freq_base_swa, rope.dimension_count(_swa), sliding_window,
  sliding_window_pattern (true = sliding, per layer), shared_kv_layers, embedding_length_per_layer_input (0 without
  PLE), feed_forward_length (one per layer with the double-wide MLP), final_logit_softcapping, expert counts;
* tokenizer "gemma4": tokenizer.json's pieces as they are (gguf.LlamaHfVocab), its merges and special ids
  (gguf.SpecialVocab), `<|channel>`-style tokens retyped USER_DEFINED, add_bos_token true;
* tensors: "model.language_model." (or "model.") stripped, names through gguf's tensor map, norms as stored (no +1),
  router.scale as ffn_gate_inp.scale, router.per_expert_scale as ffn_down_exps.scale, layer_scalar as
  layer_output_scale, the experts' 3-D gate_up / down as they are, the embedding cut to the tokenizer's size, and
  `rope_freqs` (1 for the rotated frequency pairs of full layers, 1e30 for the others);
* types: 1-D tensors F32; matrices F32, F16 or a block type (rows that are not whole blocks: F16).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from gemmaserve.models.gemma4 import Gemma4Config
from gemmaserve.models.loader import load_model
from gemmaserve.models.tokenizer import Tokenizer

from helpers import fresh_seed, paged_logits, routing_margin, tiny_gemma4_hf

FULL, SLIDING = "full_attention", "sliding_attention"
VOCAB = 384
# Gemma 4's control tokens (ids 5-19); the converter types six USER_DEFINED ("visible" to llama.cpp).
SPECIALS = ["<|turn>", "<turn|>", "<|image>", "<image|>", "<|image|>", "<|audio>",
            "<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", "<|tool_response>", '<|"|>', "<|video|>",
            "<audio|>", "<|audio|>"]
WORDS = ["\u2581hello", "\u2581world", "\u2581this", "\u2581is", "\u2581a", "\u2581test", "\u2581of", "\u2581sliding",
         "\u2581windows", "hello", "user", "model", "\u2581\u2581", "\n\n", "\u2581the", "\u2581thinking"]
TEXTS = ["hello world this is a test of sliding windows",
         "<|turn>user\nhello world<turn|>\n<|turn>model\n<|channel>thinking<channel|>the test",
         "  two  spaces,\n\nnew lines!  and \u00e9\u00e8 bytes \U0001F680 <|tool_call>call<tool_call|> <|\"|>q<|\"|>",
         "<bos>not a bos<eos> <unk> <|image|><|image|> <b>html</b>"]
PROMPT = TEXTS[0]
NEW_TOKENS = 10


# -- a tiny Gemma 4 tokenizer and checkpoint ----------------------------------------------------------------

def write_gemma4_tokenizer(path: Path) -> None:
    """A byte-fallback BPE tokenizer shaped like Gemma 4's: <pad> <eos> <bos> <unk> <mask>, the control tokens,
    256 byte tokens, characters, merged words (each through its chain of prefixes) and unused slots."""
    from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, normalizers, processors

    vocab: dict[str, int] = {}
    for t in ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"] + SPECIALS:
        vocab[t] = len(vocab)
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for ch in "\u2581abcdefghijklmnopqrstuvwxyz\n.,!":
        vocab[ch] = len(vocab)
    merges: list[tuple[str, str]] = []
    for word in WORDS:
        for cut in range(2, len(word) + 1):
            left, right = word[:cut - 1], word[cut - 1]
            if word[:cut] not in vocab:
                vocab[word[:cut]] = len(vocab)
                merges.append((left, right))
    while len(vocab) < VOCAB:
        vocab[f"<unused{len(vocab)}>"] = len(vocab)
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t in ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"] + SPECIALS])
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
        "unk_token": "<unk>", "pad_token": "<pad>", "mask_token": "<mask>", "add_bos_token": True,
        "extra_special_tokens": ["<|turn>", "<turn|>"],   # the others are special in tokenizer.json only
        "chat_template": "{{ bos_token }}{% for m in messages %}<|turn>{{ m.role }}\n{{ m.content }}<turn|>\n"
                         "{% endfor %}"}))


def save_gemma4(hf, path: Path) -> Path:
    """save_pretrained, with config.json in the released checkpoints' form (global_head_dim and
    num_global_key_value_heads, which the converter reads, where transformers 5.x saves per_layer_config)."""
    hf.save_pretrained(path, safe_serialization=True)
    top = json.loads((path / "config.json").read_text())
    cfg = top.get("text_config") or top
    per_layer = cfg.pop("per_layer_config")
    full = per_layer[str(cfg["layer_types"].index(FULL))]
    cfg["global_head_dim"] = full["head_dim"]
    if "num_key_value_heads" in full:
        cfg["num_global_key_value_heads"] = full["num_key_value_heads"]
    (path / "config.json").write_text(json.dumps(top, indent=1))
    write_gemma4_tokenizer(path)
    return path


def tiny(variant: str, seed: int):
    return tiny_gemma4_hf(seed, variant, vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB)


# -- the converter, as llama.cpp's Gemma4Model writes a file ---------------------------------------------------

VISIBLE = {"<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>", '<|"|>'}


def _store(w, name: str, value: np.ndarray, ftype: str) -> None:
    import gguf

    value = np.ascontiguousarray(value, dtype=np.float32)
    if value.ndim == 1 or ftype == "F32":
        w.add_tensor(name, value)
        return
    qtype = gguf.GGMLQuantizationType[ftype]
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if ftype == "F16" or value.shape[-1] % block:
        w.add_tensor(name, value.astype(np.float16))
    else:
        w.add_tensor(name, gguf.quants.quantize(value, qtype), raw_dtype=qtype)


ENCODERS = ("model.vision_tower.", "model.embed_vision.", "model.audio_tower.", "model.embed_audio.")


def gguf_name(name: str, n_layers: int) -> str:
    """The converter's name for a checkpoint tensor."""
    import gguf

    name = name.replace("model.language_model.", "model.")
    bid = int(name.split(".")[2]) if name.startswith("model.layers.") else None
    if name.endswith("router.scale"):
        return f"{gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.FFN_GATE_INP].format(bid=bid)}.scale"
    if name.endswith("router.per_expert_scale"):
        return f"{gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.FFN_DOWN_EXP].format(bid=bid)}.scale"
    if name.endswith("layer_scalar") or (".experts." in name and not name.endswith(".weight")):
        name += ".weight"
    found = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, n_layers).get_name(name, try_suffixes=(".weight",
                                                                                                      ".bias"))
    assert found is not None, name
    return found


def convert(hf_dir: Path, out: Path, ftype: str = "F32", edit=None) -> Path:
    """`edit(writer)`, if given, changes the metadata last (a key written again replaces the first)."""
    import gguf

    raw = json.loads((hf_dir / "config.json").read_text())
    h = raw.get("text_config") or raw
    n = h["num_hidden_layers"]
    arch = gguf.MODEL_ARCH.GEMMA4
    w = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[arch])
    # metadata
    w.add_context_length(h["max_position_embeddings"])
    w.add_embedding_length(h["hidden_size"])
    w.add_block_count(n)
    w.add_head_count(h["num_attention_heads"])
    w.add_layer_norm_rms_eps(h["rms_norm_eps"])
    w.add_sliding_window(h["sliding_window"])
    rope = h["rope_parameters"]
    w.add_rope_freq_base(rope[FULL]["rope_theta"])
    w.add_rope_freq_base_swa(rope[SLIDING]["rope_theta"])
    if h.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(h["final_logit_softcapping"])
    if h.get("enable_moe_block"):
        w.add_expert_count(h["num_experts"])
        w.add_expert_used_count(h["top_k_experts"])
        w.add_expert_feed_forward_length(h["moe_intermediate_size"])
    w.add_shared_kv_layers(h["num_kv_shared_layers"])
    w.add_embedding_length_per_layer_input(h.get("hidden_size_per_layer_input") or 0)
    swa = [t == SLIDING for t in h["layer_types"]]
    w.add_sliding_window_pattern(swa)
    d_full, d_swa = h["global_head_dim"], h["head_dim"]
    w.add_key_length(d_full)
    w.add_value_length(d_full)
    w.add_key_length_swa(d_swa)
    w.add_value_length_swa(d_swa)
    first_shared = n - h["num_kv_shared_layers"]
    ff = h["intermediate_size"]
    w.add_feed_forward_length([ff if i < first_shared else 2 * ff for i in range(n)]
                              if h.get("use_double_wide_mlp") else ff)
    kv_full = h.get("num_global_key_value_heads")
    w.add_head_count_kv([h["num_key_value_heads"] if s else kv_full for s in swa] if kv_full is not None
                        else h["num_key_value_heads"])
    w.add_rope_dimension_count(d_full)
    w.add_rope_dimension_count_swa(int(d_swa * h.get("partial_rotary_factor", 1.0)))
    # tokenizer
    vocab = gguf.LlamaHfVocab(hf_dir)
    tokens, scores, types = [], [], []
    for text, score, kind in vocab.all_tokens():
        tokens.append(text)
        scores.append(score)
        types.append(gguf.TokenType.USER_DEFINED if text.decode() in VISIBLE else kind)
    w.add_tokenizer_model("gemma4")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    gguf.SpecialVocab(hf_dir, load_merges=True).add_to_gguf(w)
    w.add_add_space_prefix(False)
    w.add_add_bos_token(True)
    # tensors
    tok_json = json.loads((hf_dir / "tokenizer.json").read_text())
    n_vocab = len(tok_json["model"]["vocab"]) + len(tok_json["added_tokens"])
    tensors = {}
    for file in sorted(hf_dir.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    for name, t in tensors.items():
        if name.startswith(ENCODERS):
            continue   # the mmproj file's
        value = t.to(torch.float32).numpy()
        if name.endswith("embed_tokens.weight"):
            value = value[:n_vocab]
        _store(w, gguf_name(name, n), value, ftype)
    d_rot = int(d_full * rope[FULL]["partial_rotary_factor"] / 2)
    w.add_tensor(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight",
                 np.array([1.0] * d_rot + [1e30] * (d_full // 2 - d_rot), dtype=np.float32))
    if edit is not None:
        edit(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _dequantised_copy(hf_dir: Path, gguf_path: Path, out: Path) -> Path:
    """`hf_dir` with every weight replaced by what the GGUF file holds for it (gguf's own dequantisation)."""
    import shutil

    import gguf

    shutil.copytree(hf_dir, out)
    reader = gguf.GGUFReader(str(gguf_path))
    held = {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in reader.tensors}
    raw = json.loads((hf_dir / "config.json").read_text())
    n = (raw.get("text_config") or raw)["num_hidden_layers"]
    (file,) = hf_dir.glob("*.safetensors")
    tensors = load_file(str(file))
    for name, t in tensors.items():
        if not name.startswith(ENCODERS):
            tensors[name] = torch.from_numpy(np.array(held[gguf_name(name, n)], dtype=np.float32)).reshape(t.shape)
    from safetensors.torch import save_file

    save_file(tensors, str(out / file.name), metadata={"format": "pt"})
    return out


# -- tests ------------------------------------------------------------------------------------------------------

def _load(path: Path):
    return load_model(str(path), torch.float32, torch.device("cpu"))


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Per variant: (seed, transformers model, HF dir, F32 GGUF file)."""
    cache = {}

    def get(variant: str):
        if variant not in cache:
            seed = fresh_seed()
            base = tmp_path_factory.mktemp(variant)
            hf = tiny(variant, seed)
            hf_dir = save_gemma4(hf, base / "hf")
            cache[variant] = seed, hf, hf_dir, convert(hf_dir, base / "f32.gguf")
        return cache[variant]
    return get


VARIANTS = ["e2b", "26b_a4b", "31b"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_f32_file_loads_as_the_hf_directory(converted, monkeypatch, tmp_path, variant):
    """E2B-like (PLE, KV sharing, double-wide MLP), 26B-A4B-like (MoE, K = V), 31B-like (K = V, per-layer KV
    heads): the config parsed from the file is the directory's; every weight is the directory's bit for bit;
    logits equal the directory load's and transformers' (fp32 rounding); greedy tokens equal transformers'."""
    monkeypatch.setenv("GEMMASERVE_CACHE_DIR", str(tmp_path / "cache"))
    seed, hf, hf_dir, path = converted(variant)
    ours, ref = _load(path), _load(hf_dir)

    parsed, expected = ours.model.config, ref.model.config
    carried = dict(rms_norm_eps=expected.rms_norm_eps, architecture=expected.architecture)   # eps: float32 in GGUF
    assert parsed.rms_norm_eps == pytest.approx(expected.rms_norm_eps, rel=1e-6)
    if not expected.hidden_size_per_layer_input:   # without PLE tensors GGUF has no per-layer vocabulary
        carried["vocab_size_per_layer_input"] = expected.vocab_size_per_layer_input
    assert dataclasses.replace(parsed, **carried) == expected, f"{variant} seed={seed}"

    a, b = _state(ours.model), _state(ref.model)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{variant} seed={seed}: {k} differs from the directory's"

    ids = ours.tokenizer.encode(PROMPT)
    assert ids == ref.tokenizer.encode(PROMPT)
    (got,), (want,) = paged_logits(ours.model, [ids]), paged_logits(ref.model, [ids])
    assert torch.allclose(got, want, rtol=0, atol=1e-6 * want.abs().max().item()), f"{variant} seed={seed}"
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0]
    err = (got - theirs).abs().max().item()
    assert err <= 2e-5 * theirs.abs().max().item(), f"{variant} seed={seed}: {err} from transformers"

    from gemmaserve import LLM, SamplingParams

    llm = LLM(model=str(path))
    out = llm.generate([PROMPT], SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))[0].outputs[0].token_ids
    with torch.no_grad():
        expected_ids = hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=[],
                                   pad_token_id=0)[0, len(ids):].tolist()
    if out != expected_ids:   # only a near tie (fp32 rounding) or an MoE near-tie may part them
        j = next(k for k, (x, y) in enumerate(zip(out, expected_ids)) if x != y)
        with torch.no_grad():
            last = hf(torch.tensor([ids + expected_ids[:j]])).logits[0, -1]
        gap = (last[expected_ids[j]] - last[out[j]]).item()
        assert gap < 1e-4 or routing_margin(hf, ids + expected_ids[:j]) < 1e-5, \
            f"{variant} seed={seed}: token {j} is {out[j]}, transformers' {expected_ids[j]} (gap {gap:.3g})"


@pytest.mark.parametrize("variant, ftype", [("e2b", "Q8_0"), ("26b_a4b", "Q4_0"), ("31b", "F16")])
def test_quantised_file_holds_ggufs_dequantisation(converted, tmp_path, variant, ftype):
    """Q8_0 / Q4_0 / F16 matrices (the MoE experts' 3-D ones too): each weight we load is gguf's dequantisation of
    the file's blocks bit for bit (a directory holding those values loads to the same state), so logits match."""
    seed, hf, hf_dir, _ = converted(variant)
    path = convert(hf_dir, tmp_path / f"{ftype}.gguf", ftype)
    import gguf

    kinds = {t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    assert ftype in kinds, kinds
    ours, ref = _load(path), _load(_dequantised_copy(hf_dir, path, tmp_path / "dequantised"))
    a, b = _state(ours.model), _state(ref.model)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{variant} {ftype} seed={seed}: {k}"
    ids = ours.tokenizer.encode(PROMPT)
    (got,), (want,) = paged_logits(ours.model, [ids]), paged_logits(ref.model, [ids])
    assert torch.equal(got, want), f"{variant} {ftype} seed={seed}"


def test_tokenizer_is_the_checkpoints(converted, tmp_path):
    """The file's "gemma4" tokenizer (pieces, merges, special ids) encodes and decodes as the directory's
    tokenizer.json: merged words, byte fallback, runs of spaces and newlines, control tokens (typed CONTROL,
    USER_DEFINED or NORMAL in the file) and the chat template; <turn|> ends a turn."""
    from gemmaserve.models.gguf_file import GGUFFile

    _, _, hf_dir, path = converted("e2b")
    ours, ref = Tokenizer.from_gguf(GGUFFile(path)), Tokenizer.from_checkpoint_dir(hf_dir)
    from tokenizers import Tokenizer as HFTokenizer

    raw = HFTokenizer.from_file(str(hf_dir / "tokenizer.json"))
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == ref.encode(text) == raw.encode(text).ids, text
        assert ours.decode(ids) == ref.decode(ids) and ours.decode(ids, False) == ref.decode(ids, False), text
    assert ours.encode(TEXTS[1])[:3] == [2, 5, ours.token_to_id("user")]   # <bos> <|turn> user: one token each
    assert ours.special_ids == ref.special_ids
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (2, 1, 0)
    assert ours.token_to_id("<turn|>") in ours.stop_token_ids
    assert ours.chat_template == json.loads((hf_dir / "tokenizer_config.json").read_text())["chat_template"]
    for _ in range(2):   # built and cached, then read from the cache: the same tokenizer
        cached = Tokenizer.from_gguf(GGUFFile(path), tmp_path / "tok.json")
        assert [cached.encode(t) for t in TEXTS] == [ours.encode(t) for t in TEXTS]
        assert (cached.special_ids, cached.stop_token_ids) == (ours.special_ids, ours.stop_token_ids)
    assert [p.name for p in tmp_path.glob("tok*.json")] == ["tok.gemma4.v1.json"]


def test_config_reads_the_converters_keys(converted):
    """The keys alone decide: 31B-like per-layer KV heads (an array), E2B-like one number; K = V from full layers
    without attn_v; the rotated fraction from rope_freqs."""
    from gemmaserve.models.gguf_file import GGUFFile

    _, hf, _, path = converted("31b")
    f = GGUFFile(path)
    assert hasattr(f.get("gemma4.attention.head_count_kv"), "__len__")
    cfg = Gemma4Config.from_gguf(f)
    assert cfg.attention_k_eq_v and cfg.rope[FULL].partial_rotary_factor == 0.25
    assert [cfg.kv_heads[i] for i, t in enumerate(cfg.layer_types) if t == FULL] == [1, 1]


def _clip_file(path: Path, projector: str, width: int, audio: tuple[str, int] | None = None) -> Path:
    """An mmproj file's header: its image projector and width, and `audio`'s (projector, width) if given."""
    import gguf

    w = gguf.GGUFWriter(str(path), "clip")
    w.add_clip_has_vision_encoder(True)
    w.add_clip_vision_projector_type(projector)
    w.add_vision_projection_dim(width)
    if audio is not None:
        w.add_clip_has_audio_encoder(True)
        w.add_clip_audio_projector_type(audio[0])
        w.add_audio_projection_dim(audio[1])
    w.add_tensor("v.patch_embd.weight", np.zeros((4, 3), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unsupported_files_are_named(converted, tmp_path):
    """Partial RoPE on sliding layers is refused by name; an mmproj file (architecture "clip") given as the model
    is told apart from a language model; --mmproj with a checkpoint directory, a file that is not GGUF, the 12B
    unified model's projector or another model's (image or audio) encoder are each refused by name."""
    from gemmaserve.errors import UserInputError

    _, hf, hf_dir, text = converted("e2b")
    path = convert(hf_dir, tmp_path / "partial.gguf", edit=lambda w: w.add_rope_dimension_count_swa(8))
    with pytest.raises(UserInputError, match=r"rope.dimension_count_swa is 8: sliding layers rotating part"):
        _load(path)
    mmproj = _clip_file(tmp_path / "mmproj.gguf", "gemma4v", hf.config.hidden_size + 1)
    with pytest.raises(UserInputError, match=r"multimodal projector \(mmproj"):
        _load(mmproj)

    def load(model, proj):
        return load_model(str(model), torch.float32, torch.device("cpu"), mmproj=str(proj))

    with pytest.raises(UserInputError, match=r"--mmproj goes with a \.gguf model"):
        load(hf_dir, mmproj)
    with pytest.raises(UserInputError, match=r"--mmproj '.*config\.json' is not a \.gguf file"):
        load(text, hf_dir / "config.json")
    with pytest.raises(UserInputError, match=r"--mmproj '.*absent\.gguf': no such file"):
        load(text, hf_dir / "absent.gguf")
    with pytest.raises(UserInputError, match=r"projects images to width 65, but the model's is 64"):
        load(text, mmproj)
    with pytest.raises(UserInputError, match=r"12B unified model's patch embedder \(gemma4uv\)"):
        load(text, _clip_file(tmp_path / "unified.gguf", "gemma4uv", hf.config.hidden_size))
    with pytest.raises(UserInputError, match=r"holds no Gemma 4 image encoder \(projector type 'gemma3'"):
        load(text, _clip_file(tmp_path / "g3.gguf", "gemma3", hf.config.hidden_size))
    width = hf.config.hidden_size
    with pytest.raises(UserInputError, match=r"audio encoder of projector type 'gemma3na', not Gemma 4's"):
        load(text, _clip_file(tmp_path / "a3n.gguf", "gemma4v", width, ("gemma3na", width)))
    with pytest.raises(UserInputError, match=rf"projects audio to width {width + 1}, but the model's is {width}"):
        load(text, _clip_file(tmp_path / "aw.gguf", "gemma4v", width, ("gemma4a", width + 1)))


@pytest.mark.parametrize("variant", VARIANTS)
def test_q4_0_projections_stay_4bit_as_on_cuda(converted, monkeypatch, tmp_path, variant):
    """A Q4_0 file loaded as on CUDA in bf16 (gguf_packed.keeps_packed told so; built on the CPU in fp32): every
    attention and MLP projection of every layer (q alone where K/V are shared, q+k where K = V) stored Q4_0 (rows
    of whole blocks; the converter stores the others F16) becomes a 4-bit
    QuantizedLinear found from the model (gguf_packed keeps Attention/GeGLU projections, and 4-bit 3-D experts
    as QuantizedExperts; the PLE gates and the router are dequantised); logits equal the dequantised load's."""
    from gemmaserve.models import gguf_packed
    from gemmaserve.quantization.linear import QuantizedLinear

    real = gguf_packed.keeps_packed
    monkeypatch.setattr(gguf_packed, "keeps_packed", lambda device, dtype, quantization, shard:
                        real(torch.device("cuda"), torch.bfloat16, quantization, shard))
    monkeypatch.setenv("GEMMASERVE_CACHE_DIR", str(tmp_path / "cache"))
    seed, _, hf_dir, _ = converted(variant)
    path = convert(hf_dir, tmp_path / "q4_0.gguf", "Q4_0")
    kept = load_model(str(path), torch.float32, torch.device("cpu"))
    ref = load_model(str(path), torch.float32, torch.device("cpu"), quantization="none")
    for i, layer in enumerate(kept.model.model.layers):
        for m in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            whole_blocks = ref.model.model.layers[i].get_submodule(m).in_features % 32 == 0   # else the file has F16
            assert isinstance(layer.get_submodule(m), QuantizedLinear) == whole_blocks, \
                f"{variant} seed={seed}: layer {i} {m}"
    assert kept.weight_formats["gguf q4_0"] > 0
    ids = kept.tokenizer.encode(PROMPT)
    (got,), (want,) = paged_logits(kept.model, [ids]), paged_logits(ref.model, [ids])
    err = (got - want).abs().max().item()
    assert err <= 1e-5 * want.abs().max().item(), f"{variant} seed={seed}: {err}"


# -- the image encoder's mmproj file ------------------------------------------------------------------------------

def convert_mmproj(hf_dir: Path, out: Path) -> Path:
    """The checkpoint's image encoder as the converter's Gemma4VisionAudioModel writes it (architecture "clip",
    projector type gemma4v): the tower's sizes under clip.vision.*, tensors renamed (encoder layers as
    vision_model.model.layers, `.linear.weight` as `.weight`, through gguf's mmproj map), the patch embedding as a
    conv kernel [H, 3, p, p], scalars as [1], the position table F32; the text model's tensors left out.
    Its audio encoder where the checkpoint has one (llama.cpp conversion/gemma.py, Gemma4VisionAudioModel and
    MmprojModel): projector type gemma4a, clip.audio.* sizes (projection_dim the text width, embedding_length,
    feed_forward_length 4 x hidden, block_count, head_count, num_mel_bins = input_feat_size or 128, layer-norm
    epsilon 1e-5 written as a constant), tensors renamed (model.audio_tower. as conformer., `.linear.` dropped,
    through gguf's mmproj map), per_dim_scale passed through softplus, the depthwise kernel [C, 1, K] as [C, K],
    scalars as [1]."""
    import gguf

    raw = json.loads((hf_dir / "config.json").read_text())
    v, a = raw["vision_config"], raw.get("audio_config")
    w = gguf.GGUFWriter(str(out), "clip")
    w.add_type(gguf.GGUFType.MMPROJ)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_clip_has_vision_encoder(True)
    w.add_vision_projection_dim(raw["text_config"]["hidden_size"])
    w.add_vision_image_size(224)   # the converter writes 224 (unused)
    w.add_vision_patch_size(v["patch_size"])
    w.add_vision_embedding_length(v["hidden_size"])
    w.add_vision_feed_forward_length(v["intermediate_size"])
    w.add_vision_block_count(v["num_hidden_layers"])
    w.add_vision_head_count(v["num_attention_heads"])
    w.add_vision_image_mean([0.0, 0.0, 0.0])
    w.add_vision_image_std([1.0, 1.0, 1.0])
    w.add_clip_vision_projector_type(gguf.VisionProjectorType.GEMMA4V)
    w.add_vision_attention_layernorm_eps(v.get("rms_norm_eps", 1e-6))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, max(v["num_hidden_layers"],
                                                                  a["num_hidden_layers"] if a else 0))
    suffixes = (".weight", ".bias", ".input_max", ".input_min", ".output_max", ".output_min")
    if a:
        w.add_clip_has_audio_encoder(True)
        w.add_audio_projection_dim(raw["text_config"]["hidden_size"])
        w.add_audio_embedding_length(a["hidden_size"])
        w.add_audio_feed_forward_length(a["hidden_size"] * 4)
        w.add_audio_block_count(a["num_hidden_layers"])
        w.add_audio_head_count(a["num_attention_heads"])
        w.add_clip_audio_projector_type(gguf.VisionProjectorType.GEMMA4A)
        w.add_audio_num_mel_bins(a.get("input_feat_size", 128))
        w.add_audio_attention_layernorm_eps(1e-5)
    for file in sorted(hf_dir.glob("*.safetensors")):
        for name, t in load_file(str(file)).items():
            value = t.to(torch.float32)
            if value.ndim == 0:
                value = value.unsqueeze(0)
            if name.startswith(("model.audio_tower.", "model.embed_audio.")):
                name = name.replace("model.audio_tower.", "conformer.").replace(".linear.", ".")
                if name.endswith(("per_dim_key_scale", "per_dim_scale")):
                    name += ".weight"
                    value = torch.nn.functional.softplus(value)
                if "lconv1d.depthwise_conv1d" in name and name.endswith(".weight"):
                    value = value.reshape(value.shape[0], value.shape[2])
                gname = names.get_name(name, try_suffixes=suffixes)
                assert gname is not None, name
                w.add_tensor(gname, value.numpy())
                continue
            if not name.startswith(("model.vision_tower.", "model.embed_vision.")):
                continue
            name = name.replace("model.vision_tower.encoder.", "vision_model.model.").replace(".linear.weight",
                                                                                            ".weight")
            if name.endswith(("layer_scalar", "position_embedding_table")):
                name += ".weight"
            if name.endswith("patch_embedder.input_proj.weight"):
                h, k = value.shape
                p = int((k // 3) ** 0.5)
                value = value.reshape(h, p, p, 3).permute(0, 3, 1, 2).contiguous()
            gname = names.get_name(name, try_suffixes=suffixes)
            assert gname is not None, name
            w.add_tensor(gname, value.numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def tiny_vision(variant: str, seed: int):
    """transformers' Gemma4ForConditionalGeneration with the ViT encoder, E2B-like (PLE, KV sharing, clipped
    encoder linears, causal images, and an audio tower: a 2-layer conformer with clipped linears, as E2B has) or
    31B-like (K = V, standardised features, bidirectional images, no audio), over this file's tokenizer ids, 280
    soft tokens per image (what the mmproj file implies), every weight random (clip bounds +-1.5)."""
    import transformers

    from helpers import GEMMA4_AUDIO_TOWER, GEMMA4_BASE, GEMMA4_VARIANTS, GEMMA4_VISION_TOWER, \
        GEMMA4_VISION_VARIANTS, _gemma4_random, randomize_tower_buffers

    text, vision = GEMMA4_VISION_VARIANTS[variant]
    tid = {t: 5 + i for i, t in enumerate(SPECIALS)}
    audio = {**GEMMA4_AUDIO_TOWER, "use_clipped_linears": True} if variant == "e2b" else None
    cfg = transformers.Gemma4Config(
        text_config={**GEMMA4_BASE, **GEMMA4_VARIANTS[variant], **text, "vocab_size": VOCAB,
                     "vocab_size_per_layer_input": VOCAB},
        vision_config={**GEMMA4_VISION_TOWER, **vision}, audio_config=audio, image_token_id=tid["<|image|>"],
        boi_token_id=tid["<|image>"], eoi_token_id=tid["<image|>"], video_token_id=tid["<|video|>"],
        **(dict(audio_token_id=tid["<|audio|>"], boa_token_id=tid["<|audio>"], eoa_token_index=tid["<audio|>"])
           if audio else {}))
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = _gemma4_random(transformers.Gemma4ForConditionalGeneration(cfg).eval(), seed, 0.5)
    randomize_tower_buffers(model, torch.Generator().manual_seed(seed))
    return model


def _images(seed: int):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (30, 40, 3), dtype=np.uint8))]


SPEECH = Path(__file__).parent / "data" / "speech_16k.wav"


@pytest.mark.parametrize("variant", ["e2b", "31b"])
def test_mmproj_file_gives_the_model_images(tmp_path, monkeypatch, variant):
    """A checkpoint with an image encoder converted to the text GGUF plus its mmproj file, loaded with --mmproj:
    the encoder's config and every weight equal the directory load's, prompt logits with an image (280 soft tokens)
    equal it (fp32 rounding) and greedy tokens are the same; the same file without --mmproj refuses images and
    says why (audio too). E2B's file also holds its audio encoder: its config equals the directory load's (but for
    per_dim_scale, which the file holds as softplus(raw)), so do its weights (per_dim_scale: the softplus of the
    directory's, bit for bit), and a spoken prompt's logits and greedy tokens; 31B's file has no audio encoder and
    audio is refused, saying so."""
    import soundfile

    from gemmaserve import LLM, SamplingParams
    from gemmaserve.errors import UserInputError

    from helpers import chunked_prompt_logits

    monkeypatch.setenv("GEMMASERVE_CACHE_DIR", str(tmp_path / "cache"))
    seed = fresh_seed()
    hf_dir = save_gemma4(tiny_vision(variant, seed), tmp_path / "hf")
    raw = json.loads((hf_dir / "config.json").read_text())
    raw["vision_soft_tokens_per_image"] = 280
    (hf_dir / "config.json").write_text(json.dumps(raw))
    if variant == "e2b":
        from transformers import Gemma4AudioFeatureExtractor

        Gemma4AudioFeatureExtractor().save_pretrained(hf_dir)   # as transformers' processor saves it
    text = convert(hf_dir, tmp_path / "model.gguf")
    proj = convert_mmproj(hf_dir, tmp_path / "mmproj.gguf")
    opts = dict(page_size=4, max_num_batched_tokens=1024, kv_cache_memory=16 << 20)
    ours, ref = LLM(model=str(text), mmproj=str(proj), **opts), LLM(model=str(hf_dir), **opts)
    a, b = ours.engine._model, ref.engine._model
    assert (a.mm_config.audio is not None) == (b.mm_config.audio is not None) == (variant == "e2b")
    if variant == "e2b":
        assert not a.mm_config.audio.raw_per_dim_scale and b.mm_config.audio.raw_per_dim_scale
    audio = b.mm_config.audio and dataclasses.replace(b.mm_config.audio, raw_per_dim_scale=False)
    assert dataclasses.replace(a.mm_config, text=b.mm_config.text) == dataclasses.replace(b.mm_config, audio=audio), \
        f"{variant} seed={seed}"
    assert a.config.bidirectional_vision == b.config.bidirectional_vision == (variant == "31b")
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        want = torch.nn.functional.softplus(sb[k]) if k.endswith("per_dim_scale") else sb[k]
        assert torch.equal(sa[k], want), f"{variant} seed={seed}: {k}"
    assert any(k.startswith("audio_tower.") for k in sa) == (variant == "e2b")

    prompt, images = "hello world this is a test", _images(seed)
    ids, items = ours.engine.inputs.prepare_images(prompt, images)
    ref_ids, ref_items = ref.engine.inputs.prepare_images(prompt, images)
    assert ids == ref_ids and len(items) == 1
    got, want = chunked_prompt_logits(a, ids, items, 1024), chunked_prompt_logits(b, ref_ids, ref_items, 1024)
    assert torch.allclose(got, want, rtol=0, atol=1e-5 * want.abs().max().item()), f"{variant} seed={seed}"
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    outs = [llm.generate([prompt], params, use_tqdm=False, images=[images])[0].outputs[0].token_ids
            for llm in (ours, ref)]
    assert outs[0] == outs[1], f"{variant} seed={seed}"

    clip = soundfile.read(SPEECH, dtype="float32")[0][:19_988]   # 1.25 s of espeak-ng speech: 31 tokens
    spoken = "hello <|audio|> world"
    if variant != "e2b":
        with pytest.raises(UserInputError, match=r"does not take audio \(its --mmproj file holds no audio encoder"):
            ours.generate([spoken], params, use_tqdm=False, audio=[[clip]])
        return
    ids, items = ours.engine.inputs.prepare(spoken, audio=[clip])
    ref_ids, ref_items = ref.engine.inputs.prepare(spoken, audio=[clip])
    assert ids == ref_ids and len(items) == 1 and ids.count(a.mm_config.audio_token_id) == 31
    got, want = chunked_prompt_logits(a, ids, items, 1024), chunked_prompt_logits(b, ref_ids, ref_items, 1024)
    assert torch.allclose(got, want, rtol=0, atol=1e-5 * want.abs().max().item()), f"audio seed={seed}"
    outs = [llm.generate([spoken], params, use_tqdm=False, audio=[[clip]])[0].outputs[0].token_ids
            for llm in (ours, ref)]
    assert outs[0] == outs[1], f"audio seed={seed}"

    text_only = LLM(model=str(text), **opts)
    with pytest.raises(UserInputError, match=r"does not take images \(a GGUF file holds the text model only: give "
                                             r"the model's mmproj .gguf file with --mmproj"):
        text_only.generate([prompt], params, use_tqdm=False, images=[images])
    with pytest.raises(UserInputError, match=r"does not take audio \(a GGUF file holds the text model only: .* "
                                             r"--mmproj for images \(and audio, E2B/E4B\)"):
        text_only.generate([spoken], params, use_tqdm=False, audio=[[clip]])
