"""Shared test helpers: tiny random Gemma 3 checkpoints and a paged forward that returns all logits."""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import torch

from gemmaserve.attention.torch_backend import TorchAttentionBackend
from gemmaserve.engine.model_runner import ModelRunner
from gemmaserve.engine.request import Request
from gemmaserve.engine.sampling_params import SamplingParams
from gemmaserve.engine.scheduler import ScheduledSeq
from gemmaserve.kv.manager_v1 import KVCacheManagerV1
from gemmaserve.kv.manager_v2 import KVCacheManagerV2
from gemmaserve.models.base import ModelInputs
from gemmaserve.models.gemma3 import Gemma3Config, Gemma3ForCausalLM


def fresh_seed() -> int:
    return secrets.randbits(31)


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


def ours_from_hf(hf_model) -> Gemma3ForCausalLM:
    cfg = Gemma3Config.from_hf(hf_model.config.to_dict())
    model = Gemma3ForCausalLM(cfg, torch.float32)
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


def make_manager(kind: str, specs, page_size: int, num_pages: int, **kw):
    if kind == "v1":
        return KVCacheManagerV1(specs, page_size, num_pages)
    return KVCacheManagerV2(specs, page_size, num_pages, **kw)


def paged_logits(model: Gemma3ForCausalLM, seqs: list[list[int]], chunk: int | None = None,
                 page_size: int = 4, first_chunk: int | None = None, manager: str = "v2",
                 scratch: bool = False) -> list[torch.Tensor]:
    """Run the sequences together through our paged engine pieces, `chunk` new tokens per sequence
    per step (None = everything at once; `first_chunk` overrides the first step), and return the
    logits at every position of each sequence."""
    specs = model.kv_layer_specs(torch.float32)
    total = sum(len(s) for s in seqs) * len(specs) + 64
    kv = make_manager(manager, specs, page_size, total, enable_prefix_caching=False, enable_scratch=scratch)
    backend = TorchAttentionBackend()
    runner = ModelRunner(model, backend, kv, specs, torch.device("cpu"))
    reqs = [Request(str(i), str(i), 0, "", list(s), SamplingParams(), frozenset(), 10**9, detokenizer=None)
            for i, s in enumerate(seqs)]
    outs: list[list[torch.Tensor]] = [[] for _ in seqs]
    step = 0
    while any(r.num_computed_tokens < r.num_tokens for r in reqs):
        batch = []
        for r in reqs:
            left = r.num_tokens - r.num_computed_tokens
            if left == 0:
                continue
            n = first_chunk if (step == 0 and first_chunk) else (chunk or left)
            n = min(n, left)
            start = r.num_computed_tokens
            assert kv.allocate(r.request_id, r.all_token_ids, start, start + n, prefill=n > 1)
            batch.append(ScheduledSeq(r, n))
        ids, pos, md = runner.build_metadata(batch)
        with torch.inference_mode():
            hidden = model(ModelInputs(ids, pos, backend.begin_batch(md, runner.kv_cache)))
            logits = model.compute_logits(hidden)
        start = 0
        for s in batch:
            outs[int(s.request.request_id)].append(logits[start:start + s.num_new_tokens])
            start += s.num_new_tokens
            s.request.num_computed_tokens += s.num_new_tokens
            kv.commit(s.request.request_id, s.request.all_token_ids, s.request.num_computed_tokens)
        kv.check_integrity()
        step += 1
    return [torch.cat(o) for o in outs]
