"""Shared test helpers: tiny random Gemma 3 checkpoints and a paged forward that returns all logits."""

from __future__ import annotations

import enum
import hashlib
import json
import os
import sys
from pathlib import Path

import torch

from gemmaserve.attention.base import AttentionMetadata
from gemmaserve.attention.torch_backend import TorchAttentionBackend
from gemmaserve.kv.manager_v1 import KVCacheManagerV1
from gemmaserve.kv.manager_v2 import KVCacheManagerV2
from gemmaserve.models.base import ModelInputs


def fresh_seed() -> int:
    """A seed fixed by the calling test function (file and name), so a failure reproduces on a rerun,
    whatever tests were selected. GEMMASERVE_TEST_SEED=<n> draws another fixed set (to explore)."""
    caller = sys._getframe(1).f_code
    key = f"{os.environ.get('GEMMASERVE_TEST_SEED', '0')}/{Path(caller.co_filename).name}/{caller.co_name}"
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=4).digest(), "little") >> 1


def tiny_hf_model(seed: int, **overrides):
    """A transformers Gemma3ForCausalLM with every weight random (norms too, so (1+w) matters)."""
    from transformers import Gemma3ForCausalLM as HFGemma3, Gemma3TextConfig

    cfg = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=7, num_attention_heads=4,
               num_key_value_heads=1, head_dim=16, sliding_window=4, query_pre_attn_scalar=20,
               max_position_embeddings=4096, bos_token_id=2, eos_token_id=1, pad_token_id=0)
    cfg.update(overrides)
    hf_cfg = Gemma3TextConfig(**cfg)
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = HFGemma3(hf_cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.3 if "norm" in name else 0.5 / p.shape[-1] ** 0.5
            p.copy_(torch.randn(p.shape, generator=gen) * scale)
    model.tie_weights()
    return model


_SLIDING, _FULL = "sliding_attention", "full_attention"


def _pattern(n: int, every: int) -> list[str]:
    return [_FULL if (i + 1) % every == 0 else _SLIDING for i in range(n)]


# Tiny Gemma 4 configs, one per released variant (head dims 512/256 scaled to 32/16, windows to a few
# tokens, so prompts span several windows).
GEMMA4_BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_attention_heads=4, head_dim=16,
                   global_head_dim=32, max_position_embeddings=4096, final_logit_softcapping=30.0,
                   hidden_size_per_layer_input=0, bos_token_id=2, eos_token_id=1, pad_token_id=0,
                   vocab_size_per_layer_input=300)
GEMMA4_VARIANTS = {
    # 31B: dense, K = V on full layers (16/4 KV heads -> 2/1), (5 + 1) pattern
    "31b": dict(num_hidden_layers=8, layer_types=_pattern(8, 6)[:7] + [_FULL], num_key_value_heads=2,
                num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=6),
    # 26B-A4B: MoE (top-k of E experts) in parallel with a dense MLP, K = V
    "26b_a4b": dict(num_hidden_layers=6, layer_types=_pattern(6, 3), num_key_value_heads=2,
                    num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=5, intermediate_size=40,
                    enable_moe_block=True, num_experts=8, top_k_experts=3, moe_intermediate_size=24),
    # E2B: PLE, KV sharing (the last 4 of 9 layers), double-wide MLP on shared layers, (4 + 1) pattern
    "e2b": dict(num_hidden_layers=9, layer_types=_pattern(9, 5)[:8] + [_FULL], num_key_value_heads=1,
                sliding_window=4, hidden_size_per_layer_input=8, num_kv_shared_layers=4, use_double_wide_mlp=True),
    # E4B: PLE, KV sharing, 2 KV heads everywhere, (5 + 1) pattern
    "e4b": dict(num_hidden_layers=8, layer_types=_pattern(8, 3)[:7] + [_FULL], num_key_value_heads=2,
                sliding_window=5, hidden_size_per_layer_input=8, num_kv_shared_layers=3),
    # 12B gemma4_unified: K = V with 8/1 KV heads (-> 4/1), no PLE, no MoE
    "12b_unified": dict(num_hidden_layers=7, layer_types=_pattern(7, 6)[:6] + [_FULL], num_key_value_heads=4,
                        num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=6, unified=True),
}


def tiny_gemma4_hf(seed: int, variant: str, **overrides):
    """A transformers Gemma 4 text model of `variant` with every weight random (norm weights, layer
    scalars, router and per-expert scales around 1, so their flavour matters). q/k norm gains are
    around D^-1/4, as trained ones are: with attention scale 1 they carry the temperature."""
    import transformers

    cfg = {**GEMMA4_BASE, **GEMMA4_VARIANTS[variant], **overrides}
    unified = cfg.pop("unified", False)
    if unified:
        for key in ("hidden_size_per_layer_input", "vocab_size_per_layer_input"):
            cfg.pop(key)
        hf_cfg = transformers.Gemma4UnifiedTextConfig(**cfg)
        cls = transformers.Gemma4UnifiedForCausalLM
    else:
        hf_cfg = transformers.Gemma4TextConfig(**cfg)
        cls = transformers.Gemma4ForCausalLM
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    return _gemma4_random(cls(hf_cfg).eval(), seed, 0.5)


def _gemma4_random(model, seed: int, spread: float):
    """Every weight of a transformers Gemma 4 model random: norm weights, layer scalars and scales around 1
    (so their flavour matters), q/k norm gains around D^-1/4 (with attention scale 1 they carry the
    temperature, as trained ones do), matrices with rows of norm ~`spread`."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("scale"):
                gain = p.shape[-1] ** -0.25 if name.endswith(("q_norm.weight", "k_norm.weight")) else 1.0
                p.copy_(gain * (1.0 + 0.3 * torch.randn(p.shape, generator=gen)))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * spread / p.shape[-1] ** 0.5)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand(b.shape, generator=gen))
    model.tie_weights()
    return model


def routing_margin(hf_model, ids: list[int]) -> float:
    """The smallest gap, over every layer and token of `ids`, between the k-th and (k+1)-th router
    probabilities of an HF Gemma 4 MoE model (inf for dense models). Below ~1e-5 a ~1e-6 difference
    in the router's input can swap an expert: at such a near tie either choice is right."""
    routers = [layer.router for layer in hf_model.model.layers if hasattr(layer, "router")]
    if not routers:
        return float("inf")
    k = hf_model.config.top_k_experts
    gaps: list[float] = []
    hooks = [r.register_forward_hook(
        lambda m, a, out: gaps.append((lambda p: (p[..., k - 1] - p[..., k]).min().item())(
            out[0].sort(dim=-1, descending=True).values))) for r in routers]
    with torch.no_grad():
        hf_model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return min(gaps)


def ours_from_hf(hf_model):
    """Our model (the class the registry picks for this config) holding the HF model's weights."""
    from gemmaserve.models.registry import model_class_for_hf

    raw = hf_model.config.to_dict()
    cls = model_class_for_hf([type(hf_model).__name__], raw.get("model_type"))
    model = cls(cls.config_class.from_hf(raw), torch.float32)
    model.load_weights(model.map_checkpoint(hf_model.state_dict().items()))
    return model.eval()


def write_tokenizer(path: Path, vocab_size: int) -> None:
    """A byte-fallback BPE tokenizer over ids [0, vocab_size): specials, 256 bytes, then letters."""
    from tokenizers import Tokenizer, decoders, models, processors

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for ch in "abcdefghijklmnopqrstuvwxyz ":
        if len(vocab) < vocab_size:
            vocab.setdefault(ch.replace(" ", "\u2581"), len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    from tokenizers import normalizers
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens(["<pad>", "<eos>", "<bos>", "<unk>"])
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>", "eos_token": "<eos>"}))


def save_checkpoint(hf_model, path: Path) -> Path:
    hf_model.save_pretrained(path, safe_serialization=True)
    write_tokenizer(path, hf_model.config.vocab_size)
    return path


# Tiny Gemma3ForConditionalGeneration: image specials at the top of a 300-token vocabulary, 28 px
# images of 7 px patches (a 4x4 grid) pooled to 4 tokens.
BOI, EOI, IMG = 297, 298, 299
VID = 291   # Gemma 4's "<|video|>" (a frame: <|image> + N x <|video|> + <image|>)
VISION_TOKENS_PER_IMAGE = 4
VISION_TEXT = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, sliding_window=6, query_pre_attn_scalar=20,
                   max_position_embeddings=4096, bos_token_id=2, eos_token_id=1, pad_token_id=0,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"])
VISION_TOWER = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, image_size=28,
                    patch_size=7, vision_use_head=False)


def tiny_hf_vision(seed: int):
    """A transformers Gemma3ForConditionalGeneration with every weight random."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    cfg = Gemma3Config(text_config=VISION_TEXT, vision_config=VISION_TOWER, mm_tokens_per_image=VISION_TOKENS_PER_IMAGE,
                       image_token_id=IMG, boi_token_id=BOI, eoi_token_id=EOI)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if "norm" in name else 0.5 / p.shape[-1] ** 0.5))
    return model


GEMMA4_SOFT_TOKENS = 70   # per image (the smallest budget): short prompts
GEMMA4_VISION_TOWER = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                           num_key_value_heads=2, head_dim=16, patch_size=4, position_embedding_size=128,
                           pooling_kernel_size=3)
# (text overrides, vision overrides) per variant: 31B-like bidirectional images and standardised
# features; E2B-like PLE, KV sharing, causal images and clipped encoder linears.
GEMMA4_VISION_VARIANTS = {"31b": (dict(use_bidirectional_attention="vision"), dict(standardize=True)),
                          "e2b": (dict(), dict(use_clipped_linears=True))}


def tiny_hf_gemma4_vision(seed: int, variant: str):
    """A transformers Gemma4ForConditionalGeneration (ViT encoder) with every weight random; clip
    bounds and standardisation buffers set so that they matter."""
    import transformers

    text, vision = GEMMA4_VISION_VARIANTS[variant]
    cfg = transformers.Gemma4Config(text_config={**GEMMA4_BASE, **GEMMA4_VARIANTS[variant], **text},
                                    vision_config={**GEMMA4_VISION_TOWER, **vision}, audio_config=None,
                                    image_token_id=IMG, boi_token_id=BOI, eoi_token_id=EOI, video_token_id=VID)
    cfg.vision_soft_tokens_per_image = GEMMA4_SOFT_TOKENS
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.Gemma4ForConditionalGeneration(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("scale"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5 / p.shape[-1] ** 0.5)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand(b.shape, generator=gen))
        randomize_tower_buffers(model, gen)
    return model


def randomize_tower_buffers(model, gen: torch.Generator) -> None:
    """A Gemma 4 media tower's buffers random or set: its standardisation (bias, scale) and the clipped linears'
    bounds (+-1.5, so clipping happens)."""
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("std_bias"):
                b.copy_(torch.randn(b.shape, generator=gen))
            elif name.endswith("std_scale"):
                b.copy_(0.5 + torch.rand(b.shape, generator=gen))
            elif name.endswith(("input_min", "output_min")):
                b.fill_(-1.5)
            elif name.endswith(("input_max", "output_max")):
                b.fill_(1.5)


GEMMA3_IMAGE_SPECIALS = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")
GEMMA4_IMAGE_SPECIALS = ("<|image>", "<image|>", "<|image|>")


def save_vision_checkpoint(hf_model, path: Path, specials: tuple[str, str, str] = GEMMA3_IMAGE_SPECIALS) -> Path:
    """save_pretrained plus a tokenizer that knows the image specials (begin, end, image token) at the
    config's ids."""
    hf_model.save_pretrained(path, safe_serialization=True)
    write_tokenizer(path, BOI)
    add_special_tokens(path, dict(zip((BOI, EOI, IMG), specials)))
    return path


def save_gemma4_vision_checkpoint(hf, path: Path) -> Path:
    save_vision_checkpoint(hf, path, GEMMA4_IMAGE_SPECIALS)
    add_special_tokens(path, {VID: "<|video|>"})
    return path


# Tiny E2B-like Gemma 4 with both towers: audio specials below the image ones, a 2-layer conformer
BOA, EOA, AUD = 294, 295, 296
GEMMA4_AUDIO_SPECIALS = ("<|audio>", "<audio|>", "<|audio|>")
GEMMA4_AUDIO_TOWER = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                          subsampling_conv_channels=[128, 4], output_proj_dims=24)   # transformers sizes its projection from c0 // 4: c0 = the 128 mel bins


def tiny_hf_gemma4_audio(seed: int, vision: bool = True, text: dict | None = None, audio: dict | None = None,
                         rescaled: bool = True, clip_bounds: float | None = 2.0):
    """A transformers E2B-like Gemma4ForConditionalGeneration with an audio tower (and, with `vision`, an image
    tower). `text`, `audio`: overrides of the text and audio configs. `rescaled`: every weight random (norms
    around 1, matrices with rows of norm ~0.5), else transformers' own initialisation; `clip_bounds`: the
    clamped linears' ranges (+-2 bite), None for transformers' +-inf."""
    import transformers

    cfg = transformers.Gemma4Config(
        text_config={**GEMMA4_BASE, **GEMMA4_VARIANTS["e2b"], **(text or {})},
        vision_config={**GEMMA4_VISION_TOWER, "use_clipped_linears": True} if vision else None,
        audio_config={**GEMMA4_AUDIO_TOWER, "use_clipped_linears": True, **(audio or {})},
        image_token_id=IMG, boi_token_id=BOI, eoi_token_id=EOI, audio_token_id=AUD, boa_token_id=BOA,
        eoa_token_index=EOA, video_token_id=VID)
    cfg.vision_soft_tokens_per_image = GEMMA4_SOFT_TOKENS
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.Gemma4ForConditionalGeneration(cfg).eval()
    if rescaled:
        model = _gemma4_random(model, seed, 0.5)
    if clip_bounds is not None:
        with torch.no_grad():
            for name, b in model.named_buffers():
                if name.endswith(("_min", "_max")):
                    b.fill_(clip_bounds if name.endswith("_max") else -clip_bounds)
    return model


CHANNEL_BEGIN, CHANNEL_END = 292, 293   # Gemma 4's thought channel markers, "<|channel>" and "<channel|>"


def add_special_tokens(path: Path, tokens: dict[int, str]) -> None:
    """Special tokens at the given ids of a tokenizer.json written by write_tokenizer."""
    tok = json.loads((path / "tokenizer.json").read_text())
    for i, text in tokens.items():
        tok["added_tokens"].append(dict(id=i, content=text, single_word=False, lstrip=False, rstrip=False,
                                        normalized=False, special=True))
        tok["model"]["vocab"][text] = i
    (path / "tokenizer.json").write_text(json.dumps(tok))


def save_gemma4_audio_checkpoint(hf, path: Path) -> Path:
    """save_pretrained, a tokenizer knowing the image and audio specials, and the audio feature extractor's
    config as transformers' processor saves it."""
    from transformers import Gemma4AudioFeatureExtractor

    save_vision_checkpoint(hf, path, GEMMA4_IMAGE_SPECIALS)
    add_special_tokens(path, {**dict(zip((BOA, EOA, AUD), GEMMA4_AUDIO_SPECIALS)), VID: "<|video|>",
                              CHANNEL_BEGIN: "<|channel>", CHANNEL_END: "<channel|>"})
    Gemma4AudioFeatureExtractor().save_pretrained(path)   # preprocessor_config.json
    return path


def chunked_prompt_logits(model, ids: list[int], items, chunk: int,
                          feats: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Our logits at every prompt position, the prompt run in chunks of at most `chunk` tokens (never splitting
    an item) through our model, KV manager and attention backend, each item's soft tokens from its encoder (or
    `feats`, the caller's encoding of them)."""
    from types import SimpleNamespace

    from gemmaserve.attention.base import AttentionMetadata
    from gemmaserve.attention.torch_backend import TorchAttentionBackend
    from gemmaserve.engine.scheduler import Scheduler
    from gemmaserve.models.base import ModelInputs

    if feats is None:
        feats = [model.encode_media(it.modality, [it.data], [it.extra], torch.device("cpu"))[0] for it in items]
    specs = model.kv_layer_specs(torch.float32)
    kv = make_manager("v2", specs, 4, 4096, enable_prefix_caching=False)   # a whole prompt's pages in every layer
    backend = TorchAttentionBackend()
    cache = backend.allocate_kv_cache(specs, kv.layout, torch.device("cpu"))
    req = SimpleNamespace(max_chunk_tokens=None, media=items)
    done, outs = 0, []
    while done < len(ids):
        n = Scheduler._chunk(req, done, len(ids) - done, chunk)
        end = done + n
        assert n > 0 and kv.allocate("0", ids, done, end, prefill=n > 1)
        t = torch.tensor(ids[done:end])
        embeds = model.embed(t)
        for it, f in zip(items, feats):
            lo, hi = max(it.start, done), min(it.end, end)
            if lo < hi:
                embeds[lo - done:hi - done] = f[lo - it.start:hi - it.start]
        spans = [[(it.start, it.end) for it in items if it.bidirectional and it.start < end and it.end > done]]
        md = AttentionMetadata([n], [end], kv.group_tables(["0"]), kv.layer_slot, image_spans=spans)
        with torch.inference_mode():
            hidden = model(ModelInputs(t, torch.arange(done, end), backend.begin_batch(md, cache), inputs_embeds=embeds))
            outs.append(model.compute_logits(hidden))
        kv.commit("0", ids, end)
        done = end
    return torch.cat(outs)


def assert_image_prompt_matches(ids: list[int], items, ref, types_key: str) -> None:
    """Our expanded prompt `ids` and image `items` (engine.prepare_images) against transformers'
    processor output `ref`: the same ids, the images' spans where its token types (`types_key`) say, the
    same pixels."""
    import numpy as np

    assert ids == ref["input_ids"][0].tolist()
    types = np.zeros(len(ids), dtype=int)
    for it in items:
        types[it.start:it.end] = 1
    assert types.tolist() == ref[types_key][0].tolist()
    np.testing.assert_allclose(np.stack([it.data for it in items]), ref["pixel_values"], atol=1e-6, rtol=0)


def hf_vision_processor(path: Path, family: str, monkeypatch=None, max_frames: int = 32):
    """transformers' own processor for a tiny vision checkpoint saved above (its tokenizer.json, the image
    specials named as Gemma's tokenizers name them), built offline: the reference for how a prompt's image
    placeholders expand (begin/end tokens, soft-token counts, separators) and for the pixels. "gemma4_video": the
    whole Gemma4Processor with its video processor (sampling at most `max_frames`), which needs `monkeypatch`
    (`hf_gemma4_video_processor`)."""
    from transformers import PreTrainedTokenizerFast

    specials = GEMMA3_IMAGE_SPECIALS if family == "gemma3" else GEMMA4_IMAGE_SPECIALS
    extra = dict(zip(("boi_token", "eoi_token", "image_token"), specials))
    if family in ("gemma4", "gemma4_video"):   # Gemma4Processor checks these exist even for images alone
        extra.update(boa_token="<|audio>", eoa_token="<audio|>")
    if family == "gemma4_audio":
        extra.update(zip(("boa_token", "eoa_token", "audio_token"), GEMMA4_AUDIO_SPECIALS))
    tok = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"), bos_token="<bos>", eos_token="<eos>",
                                  pad_token="<pad>", extra_special_tokens=extra)
    if family == "gemma3":
        from transformers import Gemma3Processor
        from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

        size = VISION_TOWER["image_size"]
        images = Gemma3ImageProcessorPil(size={"height": size, "width": size}, image_mean=[0.5] * 3, image_std=[0.5] * 3)
        return Gemma3Processor(images, tok, image_seq_length=VISION_TOKENS_PER_IMAGE)
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil
    from transformers.models.gemma4.processing_gemma4 import Gemma4Processor
    from transformers.processing_utils import ProcessorMixin

    class Gemma4ImageProcessor(Gemma4Processor):
        """Gemma4Processor without its audio feature extractor and video processor (the latter needs
        torchvision): the image attributes its __init__ sets, and everything else (placeholder
        expansion, soft-token counts, the call) transformers' own."""

        def __init__(self, image_processor, tokenizer, image_seq_length):
            self.image_seq_length = image_seq_length
            self.image_token_id = tokenizer.image_token_id
            self.boi_token, self.eoi_token, self.image_token = tokenizer.boi_token, tokenizer.eoi_token, tokenizer.image_token
            self.audio_token = self.audio_token_id = None
            self.boa_token, self.eoa_token = tokenizer.boa_token, tokenizer.eoa_token
            ProcessorMixin.__init__(self, image_processor=image_processor, tokenizer=tokenizer)

    if family == "gemma4_audio":
        return _gemma4_audio_processor(tok)
    tower = GEMMA4_VISION_TOWER
    if family == "gemma4_video":
        from transformers import Gemma4AudioFeatureExtractor

        images = Gemma4ImageProcessorPil(patch_size=tower["patch_size"], max_soft_tokens=GEMMA4_SOFT_TOKENS,
                                         pooling_kernel_size=tower["pooling_kernel_size"])
        videos = hf_gemma4_video_processor(monkeypatch)(patch_size=tower["patch_size"], max_soft_tokens=70,
                                                        pooling_kernel_size=tower["pooling_kernel_size"],
                                                        num_frames=max_frames)

        class Gemma4ProcessorWithVideo(Gemma4Processor):
            def check_argument_for_proper_class(self, name, argument):   # (the video class table needs torchvision)
                return type(argument) if name == "video_processor" else super().check_argument_for_proper_class(
                    name, argument)

        return Gemma4ProcessorWithVideo(Gemma4AudioFeatureExtractor(), images, tok, videos,
                                        image_seq_length=GEMMA4_SOFT_TOKENS)
    images = Gemma4ImageProcessorPil(patch_size=tower["patch_size"], max_soft_tokens=GEMMA4_SOFT_TOKENS,
                                     pooling_kernel_size=tower["pooling_kernel_size"])
    return Gemma4ImageProcessor(images, tok, GEMMA4_SOFT_TOKENS)


class TorchvisionStandIn:
    """What transformers' Gemma4VideoProcessor and its base classes call of torchvision.transforms.v2.functional
    (`tvF`), as torchvision 0.28 computes it for their inputs, for a machine where torchvision does not import
    (its PyPI wheels are CUDA builds, which do not load beside the CPU torch). resize: a uint8 tensor resized
    bicubic with antialiasing by torch's own kernel on the bytes (torchvision's `resize_image` keeps uint8 for
    bicubic on the CPU), a float one likewise; normalize: (x - mean) / std in x's dtype. Checked once against
    torchvision 0.28's own functions (its C++ ops aside, which these do not use) on every clip of
    test_gemma4_video.py: the same bytes."""

    class InterpolationMode(enum.Enum):
        NEAREST = "nearest"
        BILINEAR = "bilinear"
        BICUBIC = "bicubic"

    @staticmethod
    def resize(image: torch.Tensor, size: list[int], interpolation=None, max_size=None,
               antialias: bool = True) -> torch.Tensor:
        bicubic = TorchvisionStandIn.InterpolationMode.BICUBIC
        if interpolation not in (bicubic, 3) or max_size is not None or len(size) != 2:   # 3: PIL's BICUBIC
            raise NotImplementedError(f"the stand-in resizes bicubic to [height, width] only, not {interpolation}")
        c, h, w = image.shape[-3:]
        if (h, w) == tuple(size):
            return image
        out = torch.nn.functional.interpolate(image.reshape(-1, c, h, w), size=list(size), mode="bicubic",
                                              align_corners=False, antialias=antialias)
        return out.reshape(*image.shape[:-2], *size)

    @staticmethod
    def normalize(image: torch.Tensor, mean, std, inplace: bool = False) -> torch.Tensor:
        mean = torch.as_tensor(mean, dtype=image.dtype).view(-1, 1, 1)
        std = torch.as_tensor(std, dtype=image.dtype).view(-1, 1, 1)
        return (image.sub_(mean) if inplace else image.sub(mean)).div_(std)

    @staticmethod
    def grayscale_to_rgb(image: torch.Tensor) -> torch.Tensor:
        return image if image.shape[-3] >= 3 else image.repeat_interleave(3, dim=-3)


def hf_gemma4_video_processor(monkeypatch):
    """transformers' Gemma4VideoProcessor class, its module run with `tvF` bound to `TorchvisionStandIn` (and
    the base classes' modules given it through `monkeypatch`): frame sampling, target sizes, rescaling,
    patches, positions, padding and soft-token counts are transformers' own code; only torchvision's resize
    and normalize kernels are the stand-in's."""
    import importlib.util

    import transformers.image_processing_backends as backends
    import transformers.video_processing_utils as video_utils

    for module in (backends, video_utils):
        if not hasattr(module, "tvF"):   # (where torchvision imports, its own functions run)
            monkeypatch.setattr(module, "tvF", TorchvisionStandIn, raising=False)
    spec = importlib.util.find_spec("transformers.models.gemma4.video_processing_gemma4")
    module = importlib.util.module_from_spec(spec)
    module.tvF = TorchvisionStandIn   # (its own import of torchvision is skipped where torchvision is missing)
    monkeypatch.setitem(sys.modules, spec.name, module)   # its docstring decorator looks its source file up
    spec.loader.exec_module(module)
    return module.Gemma4VideoProcessor


def assert_server_kv_clean(background_server, timeout: float = 60.0) -> None:
    """Once every request has ended: no page held by a request, the integrity check holds, and no
    completion is still counted against the admission bound (--max-queue-len)."""
    import time

    engine = background_server.server.async_engine
    deadline = time.monotonic() + timeout
    while engine.call_blocking(lambda e: e.has_unfinished_requests()):
        assert time.monotonic() < deadline, "requests still running"
        time.sleep(0.02)

    def check(e):
        e.check_integrity()
        return e.snapshot()

    st = engine.call_blocking(check)
    assert st.pages_used == 0 and st.pages_free + st.pages_cached == st.pages_total
    assert engine.bound.count == 0, f"{engine.bound.count} completions still counted as in the server"


def serve_process(*args: str, timeout: float = 120.0):
    """`gemmaserve serve --port 0 ARGS` in its own process; returns (process, port) once uvicorn listens
    (the model may still be loading: /health answers 503 until it is ready)."""
    import os
    import re
    import subprocess
    import sys
    import time

    proc = subprocess.Popen([sys.executable, "-m", "gemmaserve", "serve", "--port", "0", *args],
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        assert line or proc.poll() is None, "server exited"
        m = re.search(r"Uvicorn running on http://127\.0\.0\.1:(\d+)", line)
        if m:
            return proc, int(m.group(1))
    proc.kill()
    raise AssertionError("no startup line")


def make_manager(kind: str, specs, page_size: int, num_pages: int, **kw):
    if kind == "v1":
        return KVCacheManagerV1(specs, page_size, num_pages)
    return KVCacheManagerV2(specs, page_size, num_pages, **kw)


def paged_logits(model, seqs: list[list[int]], chunk: int | None = None,
                 page_size: int = 4, first_chunk: int | None = None, manager: str = "v2",
                 scratch: bool = False, specs=None, backend=None, lora=None) -> list[torch.Tensor]:
    """Run the sequences together through our paged engine pieces, `chunk` new tokens per sequence
    per step (None = everything at once; `first_chunk` overrides the first step), and return the
    logits at every position of each sequence. `specs` (default: the model's, fp32) set the KV
    storage; `backend` defaults to the torch one. `lora`: (LoRAWeights, the slot of each sequence, -1 for
    none)."""
    from gemmaserve.models.lora import LoRABatch

    specs = specs or model.kv_layer_specs(torch.float32)
    total = sum(len(s) for s in seqs) * len(specs) + 64
    kv = make_manager(manager, specs, page_size, total, enable_prefix_caching=False, enable_scratch=scratch)
    backend = backend or TorchAttentionBackend()
    cache = backend.allocate_kv_cache(specs, kv.layout, torch.device("cpu"))
    done = [0] * len(seqs)
    outs: list[list[torch.Tensor]] = [[] for _ in seqs]
    step = 0
    while any(d < len(s) for d, s in zip(done, seqs)):
        batch = []   # (sequence, start, end)
        for b, s in enumerate(seqs):
            left = len(s) - done[b]
            if left == 0:
                continue
            n = min(first_chunk if (step == 0 and first_chunk) else (chunk or left), left)
            assert kv.allocate(str(b), list(s), done[b], done[b] + n, prefill=n > 1)
            batch.append((b, done[b], done[b] + n))
        ids = torch.tensor([t for b, st, e in batch for t in seqs[b][st:e]], dtype=torch.long)
        pos = torch.tensor([p for _, st, e in batch for p in range(st, e)], dtype=torch.long)
        md = AttentionMetadata([e - st for _, st, e in batch], [e for _, _, e in batch],
                               kv.group_tables([str(b) for b, _, _ in batch]), kv.layer_slot)
        adapters = None
        if lora is not None:
            starts = [sum(e - st for _, st, e in batch[:i]) for i in range(len(batch))]
            adapters = LoRABatch.from_segments(lora[0], [(r, r + e - st, lora[1][b]) for r, (b, st, e) in
                                                         zip(starts, batch) if lora[1][b] >= 0], torch.device("cpu"))
        with torch.inference_mode():
            hidden = model(ModelInputs(ids, pos, backend.begin_batch(md, cache), lora=adapters))
            logits = model.compute_logits(hidden)
        row = 0
        for b, st, e in batch:
            outs[b].append(logits[row:row + e - st])
            row += e - st
            done[b] = e
            kv.commit(str(b), list(seqs[b]), e)
        kv.check_integrity()
        step += 1
    return [torch.cat(o) for o in outs]


def tiny_gemma4_assistant(seed: int, variant: str, ordered: bool = False, hidden_size: int = 48,
                          layer_types: tuple[str, ...] = (_SLIDING, _SLIDING, _SLIDING, _FULL)):
    """A transformers Gemma4AssistantForCausalLM (an MTP drafter) made for `tiny_gemma4_hf(_, variant)`: its
    layers read that target's KV shapes; `ordered`: the centroid head of the small drafters (10 centroids
    of 30 tokens, top 3), with a random token ordering. Weights random as in `tiny_gemma4_hf`."""
    import transformers

    tc = {**GEMMA4_BASE, **GEMMA4_VARIANTS[variant]}
    text = dict(vocab_size=tc["vocab_size"], hidden_size=hidden_size, intermediate_size=80,
                num_hidden_layers=len(layer_types), layer_types=list(layer_types), num_attention_heads=4,
                head_dim=tc["head_dim"], global_head_dim=tc["global_head_dim"],
                num_key_value_heads=tc["num_key_value_heads"],
                num_global_key_value_heads=tc.get("num_global_key_value_heads"),
                attention_k_eq_v=tc.get("attention_k_eq_v", False), sliding_window=tc["sliding_window"],
                hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, num_kv_shared_layers=len(layer_types),
                max_position_embeddings=tc["max_position_embeddings"], bos_token_id=2, eos_token_id=1, pad_token_id=0)
    cfg = transformers.Gemma4AssistantConfig(text_config=text, backbone_hidden_size=tc["hidden_size"],
                                             use_ordered_embeddings=ordered, num_centroids=10,
                                             centroid_intermediate_top_k=3)
    cfg.text_config._attn_implementation = "eager"
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = _gemma4_random(transformers.Gemma4AssistantForCausalLM(cfg).eval(), seed, 1.0)
    if ordered:
        with torch.no_grad():
            model.masked_embedding.token_ordering.copy_(
                torch.randperm(tc["vocab_size"], generator=torch.Generator().manual_seed(seed + 1)))
    return model


def completion_rows(outs) -> list:
    """Each completion's (token ids, finish reason, logprobs) of `LLM.generate`'s outputs."""
    return [(c.token_ids, c.finish_reason, [(lp.token_id, lp.logprob) for lp in c.logprobs or []])
            for o in outs for c in o.outputs]


def run_rows(llm, prompts: list[str], params) -> list:
    """`completion_rows` of `prompts` on `llm`, its KV integrity checked after."""
    outs = llm.generate(prompts, params)
    llm.engine._kv.check_integrity()
    return completion_rows(outs)


def generate_rows(path: str, base, options: dict, params, spec: dict | None, prompts: list[str]):
    """An engine over `base`'s weights with `options` and `spec` (speculative config): `run_rows` of `prompts`
    on it, and the engine."""
    from gemmaserve import LLM
    from gemmaserve.config.engine import EngineConfig

    llm = LLM.from_config(EngineConfig(model=path, page_size=4, **options, speculative_config=spec), base)
    return run_rows(llm, prompts, params), llm.engine


def check_warm_rerun(llm, prompts: list[str], params, want: list, rows=completion_rows) -> None:
    """`prompts` again on `llm`, whose one earlier run (of the same prompts, giving `rows` `want`) left its prefix
    cache warm and its speculative counters: every prompt is served from the prefix cache up to its last token
    (whole pages), the rows are `want` again, and the counters grow by exactly the first run's (the same drafts
    made and accepted on the cached KV: a draft model's included)."""
    import copy

    engine = llm.engine
    first, hits = copy.deepcopy(engine._scheduler.spec_stats), engine._kv.stats().prefix_hit_tokens
    assert first.drafted > 0
    outs = llm.generate(prompts, params)
    engine._kv.check_integrity()
    assert rows(outs) == want
    page = engine._kv.page_size
    cached = [o.num_cached_tokens for o in outs]
    assert cached == [(len(o.prompt_token_ids) - 1) // page * page for o in outs], cached
    assert engine._kv.stats().prefix_hit_tokens - hits == sum(cached)
    st = engine._scheduler.spec_stats
    assert ((st.steps, st.drafted, st.accepted, st.drafted_at, st.accepted_at)
            == (2 * first.steps, 2 * first.drafted, 2 * first.accepted, [2 * n for n in first.drafted_at],
                [2 * n for n in first.accepted_at])), (first, st)


def paged_kv(model, backend: str, num_pages: int, page_size: int = 4):
    """(KV manager V2, attention backend "torch" or "triton", its cache) for `model`'s fp32 layers, no prefix
    caching: the pieces a test drives steps through by hand."""
    specs = model.kv_layer_specs(torch.float32)
    kv = make_manager("v2", specs, page_size, num_pages, enable_prefix_caching=False)
    if backend == "triton":
        from gemmaserve.attention.triton_backend import TritonAttentionBackend

        attention = TritonAttentionBackend()
    else:
        attention = TorchAttentionBackend()
    return kv, attention, attention.allocate_kv_cache(specs, kv.layout, torch.device("cpu"))


def check_grammar_cut(path: str, base, speculative_config: dict, prompts: list[str], max_tokens: int) -> None:
    """Structured output with speculation: every draft the target verifies is one the grammar allows, some
    were cut, the statistics count only the verified ones, and the texts equal `base`'s without drafts."""
    from gemmaserve import LLM, SamplingParams
    from gemmaserve.config.engine import EngineConfig

    so = {"kind": "regex", "spec": "(ab|cd|aa|bb)+x"}
    params = SamplingParams(max_tokens=max_tokens, structured_output=so)
    spec = LLM.from_config(EngineConfig(model=path, page_size=4, speculative_config=speculative_config), base)
    counts = watch_grammar_drafts(spec.engine, so)
    want = [o.outputs[0].text for o in base.generate(prompts, params)]
    assert [o.outputs[0].text for o in spec.generate(prompts, params)] == want
    assert counts["verified"] > 0 and counts["cut"] > 0, counts
    assert spec.engine._scheduler.spec_stats.drafted == counts["verified"]


def watch_grammar_drafts(engine, so: dict) -> dict:
    """Wraps the engine runner's forward: every draft it verifies must be one the grammar `so` allows after
    the request's output so far (drafts it forbids are cut before the forward). Counts what it verified
    and what was cut."""
    from gemmaserve.engine.step import DRAFT_TOKEN
    from gemmaserve.engine.structured.structured_output import StructuredOutput

    counts = {"verified": 0, "cut": 0}
    run_model = engine._runner.run_model

    def checked(seqs, want_hidden=False, drafts=None):
        out = run_model(seqs, want_hidden, drafts)
        for planned, ran in zip(seqs, out.seqs):
            if not planned.num_drafts:
                continue
            verified = ran.token_ids[len(ran.token_ids) - ran.num_drafts:]
            if DRAFT_TOKEN in verified:   # a drafter's slots: what it filled in
                verified = (drafts or {})[ran.req_id]
            matcher = engine._grammars.matcher(StructuredOutput.parse(so))
            for t in engine._request(ran.req_id).output_token_ids:
                matcher.accept(t)
            assert matcher.allowed_prefix(verified) == len(verified), (ran.req_id, verified)
            counts["verified"] += len(verified)
            counts["cut"] += planned.num_drafts - ran.num_drafts
        return out

    engine._runner.run_model = checked
    return counts


def _gemma4_audio_processor(tok):
    """transformers' Gemma4Processor with its image processor and audio feature extractor (no video processor: it
    needs torchvision): the reference for prompt expansion, pixels and audio features."""
    from transformers import Gemma4AudioFeatureExtractor
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil
    from transformers.models.gemma4.processing_gemma4 import Gemma4Processor
    from transformers.processing_utils import ProcessorMixin

    class Gemma4AudioProcessor(Gemma4Processor):
        def __init__(self, image_processor, feature_extractor, tokenizer):
            self.image_seq_length = GEMMA4_SOFT_TOKENS
            self.audio_seq_length, self.audio_ms_per_token = 750, 40
            self.image_token_id, self.audio_token_id = tokenizer.image_token_id, tokenizer.audio_token_id
            self.boi_token, self.eoi_token, self.image_token = tokenizer.boi_token, tokenizer.eoi_token, tokenizer.image_token
            self.boa_token, self.eoa_token, self.audio_token = tokenizer.boa_token, tokenizer.eoa_token, tokenizer.audio_token
            ProcessorMixin.__init__(self, image_processor=image_processor, feature_extractor=feature_extractor,
                                    tokenizer=tokenizer)

    tower = GEMMA4_VISION_TOWER
    images = Gemma4ImageProcessorPil(patch_size=tower["patch_size"], max_soft_tokens=GEMMA4_SOFT_TOKENS,
                                     pooling_kernel_size=tower["pooling_kernel_size"])
    return Gemma4AudioProcessor(images, Gemma4AudioFeatureExtractor(), tok)


def scripted_logits(model, tokens: list[int]) -> list[int]:
    """Make `model` (run eagerly, one request at a time) emit `tokens` first, whatever its weights say: each
    logits call k < len(tokens) puts all its weight on tokens[k] (a grammar mask still applies after). Returns
    the call counter (clear it to replay); `del model.compute_logits` undoes it."""
    original = model.compute_logits
    calls: list[int] = []

    def forced(hidden):
        logits = original(hidden)
        k = len(calls)
        calls.append(k)
        if k < len(tokens):
            logits = torch.full_like(logits, -1e4)
            logits[:, tokens[k]] = 0.0
        return logits

    model.compute_logits = forced
    return calls



def _pages_held(engine, seq_id: str, layers: range | None = None) -> set[int]:
    """The KV pages a running request's block tables hold in `layers` (default: all of the pool's)."""
    kv, out = engine._kv, set()
    for g in range(len(kv.groups)):
        _, rows = kv.block_table(seq_id, g)
        cols = [c for layer, (group, c) in enumerate(kv.layer_slot)
                if group == g and (layers is None or layer in layers)]
        if rows and cols:
            out.update(pages[c] for pages in kv.slot_rows(g, list(rows))[1] for c in cols)
    return out


def check_aborts_mid_speculation(engine, prompts: list[str], params, want: list[list[int]]) -> None:
    """Aborts on a speculating `engine` (a draft model's or MTP's), in one batch with requests that go on: the first
    and third of `prompts` each at the first step (from the 3rd, from the 6th) after which drafts are in flight for
    it: in the step launched (asynchronous scheduling) or, a step at a time, verified by the step just done and, where
    the drafter works after the step (MTP), made for the next one. At each abort its pages (its draft model's layers'
    too) leave use at once and no running request holds them. At the end the others have their tokens of `want` (one
    token per step), the aborted ones a prefix of theirs, every page is free or cached, the runner keeps nothing of
    any request, and the speculative counters (/metrics) are the sum of the requests' own (usage, --json), the
    aborted ones' included, with drafts accepted."""
    ids = [engine.add_request(p, params) for p in prompts]
    victims = {ids[0]: 3, ids[2]: 6}   # request -> the first step after which it is aborted
    drafter = engine._runner.drafter
    first_draft_layer = getattr(drafter, "first_layer", None)   # a draft model's KV layers follow the target's
    draft_layers = range(first_draft_layer, len(engine._kv.layer_slot)) if first_draft_layer is not None else None
    last: dict[str, int] = {}   # request -> the drafts its last scheduled step carries
    schedule = engine._scheduler.schedule

    def recorded():
        plan = schedule()
        last.update((s.req_id, s.num_drafts) for s in plan.seqs)
        return plan

    engine._scheduler.schedule = recorded

    def drafts_in_flight(rid: str) -> bool:
        if engine._inflight is not None:
            return any(s.req_id == rid and s.num_drafts for s in engine._inflight[0].seqs)
        return last.get(rid, 0) > 0 and (not engine._scheduler.proposer.drafts_after_step
                                         or bool(engine._request(rid).drafts))

    final, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        steps += 1
        for rid, at in victims.items():
            if rid in final or steps < at or not drafts_in_flight(rid):
                continue
            held, used = _pages_held(engine, rid), engine._kv.stats().pages_used
            assert len(held) == engine._kv.pages_held(rid)
            assert draft_layers is None or _pages_held(engine, rid, draft_layers)   # it holds draft-model KV
            for out in engine.abort_request(rid):
                final[out.request_id] = out
            engine._kv.check_integrity()
            assert engine._kv.pages_held(rid) == 0 and engine._kv.stats().pages_used == used - len(held)
            assert not held & set().union(*(_pages_held(engine, r.request_id) for r in engine._scheduler.running))
    engine.step()   # an empty step: the runner hears of the last finished requests
    assert [final[i].outputs[0].finish_reason for i in ids] == ["abort", "length", "abort", "length"]
    for i, tokens in zip(ids, want):
        got = final[i].outputs[0].token_ids
        assert got == (tokens[:len(got)] if final[i].outputs[0].finish_reason == "abort" else tokens)
    engine._kv.check_integrity()
    st = engine._kv.stats()
    assert st.pages_used == 0 and st.pages_free + st.pages_cached == st.num_pages
    runner = engine._runner
    assert not runner.sampling and not runner._last_sampled and not any(i in runner.tables for i in ids)
    spec = engine._scheduler.spec_stats
    assert spec.accepted > 0
    assert sum(final[i].outputs[0].num_draft_tokens for i in ids) == spec.drafted == sum(spec.drafted_at)
    assert sum(final[i].outputs[0].num_accepted_tokens for i in ids) == spec.accepted == sum(spec.accepted_at)


def gguf_vocabulary(size: int):
    """A SentencePiece-style vocabulary as Gemma's GGUF files store it: specials, 256 byte tokens, letters,
    a space token spelled with a real space, a few merged pieces, then unused slots."""
    import gguf

    tt = gguf.TokenType
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [tt.CONTROL] * 3 + [tt.UNKNOWN] + [tt.BYTE] * 256
    pieces = list("abcdefghijklmnopqrstuvwxyz") + [" ", "he", "ll", "llo", "hello", "\u2581w", "or", "is", "\u2581t"]
    tokens += pieces
    types += [tt.NORMAL] * len(pieces)
    tokens += [f"<unused{i}>" for i in range(size - len(tokens))]
    types += [tt.UNUSED] * (size - len(types))
    assert len(tokens) == size
    return tokens, types


def add_gguf_tokenizer(w, vocab_size: int) -> None:
    """`gguf_vocabulary` and Gemma's special ids into a GGUFWriter."""
    tokens, token_types = gguf_vocabulary(vocab_size)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([-float(i) for i in range(len(tokens))])
    w.add_token_types(token_types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)


def add_gemma3_gguf_header(w, cfg) -> None:
    """A transformers Gemma 3 text config's hyperparameters as llama.cpp's gemma3 GGUF keys (the writer made
    with architecture "gemma3"; query_pre_attn_scalar as attention.scale)."""
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_sliding_window(cfg.sliding_window)
    w.add_float32("gemma3.attention.scale", cfg.query_pre_attn_scalar ** -0.5)
    w.add_rope_freq_base(cfg.rope_parameters["full_attention"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
