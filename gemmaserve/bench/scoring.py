"""Teacher-forced scoring of one token sequence by our model (for perplexity and agreement figures):
the sequence runs through the real paged path (V1 manager, torch attention) in chunks, and each
position's next-token log-probability, argmax and top-2 margin are kept. The [T, vocab] log-softmax
is kept only when asked (a reference for `kl_from`), the KL divergence from one when given."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Scores:
    logprobs: torch.Tensor   # [T-1] log p(ids[i+1] | ids[:i+1])
    argmax: torch.Tensor     # [T-1] the model's top token after ids[:i+1]
    margin: torch.Tensor     # [T-1] top-1 minus top-2 logit there
    kl: torch.Tensor | None = None              # [T-1] KL(reference || this model), if a reference was given
    full_logprobs: torch.Tensor | None = None   # [T-1, vocab], if kept

    @property
    def perplexity(self) -> float:
        return float(torch.exp(-self.logprobs.double().mean()))

    @property
    def mean_kl(self) -> float | None:
        return None if self.kl is None else float(self.kl.double().mean())


def kl_from(reference: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """Per row KL(p || q) for log-probabilities `reference` (p) and `logprobs` (q), [n, vocab] -> [n]."""
    p = reference.float()
    return (p.exp() * (p - logprobs.float())).sum(-1)


def score(model, ids: list[int], chunk: int = 256, page_size: int = 16, keep_logprobs: bool = False,
          reference: Scores | None = None, compiled: bool = False, kv_manager: str = "v1") -> Scores:
    """`chunk`: rows per forward (1 runs the decode kernels); `reference`: a Scores with
    `full_logprobs` of the same ids, to measure this model's KL divergence from. `compiled` (chunk 1
    only): every step through the compiled decode graph (engine/compiled_decode.py), as the engine
    runs batch-1 decode once it is compiled; with `kv_manager` "v2" (the engine's for Gemma) its
    attention is traced into the graph, with "v1" the graph calls it through an op."""
    from ..attention.base import AttentionMetadata
    from ..attention.torch_backend import TorchAttentionBackend
    from ..engine.compiled_decode import CompiledDecode
    from ..kv.manager_v1 import KVCacheManagerV1
    from ..kv.manager_v2 import KVCacheManagerV2
    from ..models.base import ModelInputs

    if compiled and chunk != 1:
        raise ValueError("only decode steps (chunk=1) are compiled")
    specs = model.kv_layer_specs(torch.float32)
    pages = -(-len(ids) // page_size) * len(specs) + 8
    if kv_manager == "v1":
        kv = KVCacheManagerV1(specs, page_size, pages)
    elif kv_manager == "v2":
        kv = KVCacheManagerV2(specs, page_size, pages, enable_prefix_caching=False, enable_scratch=False)
    else:
        raise ValueError(f"kv_manager must be v1 or v2, got {kv_manager!r}")
    backend = TorchAttentionBackend()
    # One page more: the compiled graph's warm-up writes to it (the null page).
    cache = backend.allocate_kv_cache(specs, dataclasses.replace(kv.layout, num_pages=kv.layout.num_pages + 1),
                                      torch.device("cpu"))
    step = None
    if compiled:
        step = CompiledDecode(model, backend, cache, kv.layer_slot, kv.groups, kv.layout.num_pages, max_batch=1,
                              specs=specs, tokens_per_page=kv.layout.tokens_per_page)
        step.compile()
    target = torch.tensor(ids[1:] + [0])
    lp, top, margin, full, kl = [], [], [], [], []
    with torch.inference_mode():
        for start in range(0, len(ids), chunk):
            end = min(start + chunk, len(ids))
            if not kv.allocate("s", ids, start, end, prefill=end - start > 1):
                raise RuntimeError("scoring KV pool too small")
            md = AttentionMetadata([end - start], [end], kv.group_tables(["s"]), kv.layer_slot)
            if step is not None:
                logits = step.run(torch.tensor(ids[start:end]), torch.arange(start, end), md).float()
            else:
                hidden = model(ModelInputs(torch.tensor(ids[start:end]), torch.arange(start, end),
                                           backend.begin_batch(md, cache)))
                logits = model.compute_logits(hidden).float()
            kv.commit("s", ids, end)
            log_softmax = torch.log_softmax(logits, -1)
            lp.append(log_softmax.gather(1, target[start:end, None])[:, 0])
            if keep_logprobs:
                full.append(log_softmax)
            if reference is not None:
                ref_rows = reference.full_logprobs[start:end]   # T-1 rows: the last chunk has one fewer
                kl.append(kl_from(ref_rows, log_softmax[:len(ref_rows)]))
            two = logits.topk(2, dim=-1)
            top.append(two.indices[:, 0])
            margin.append(two.values[:, 0] - two.values[:, 1])
    return Scores(torch.cat(lp)[:-1], torch.cat(top)[:-1], torch.cat(margin)[:-1],
                  torch.cat(kl) if kl else None, torch.cat(full)[:-1] if full else None)


def first_divergence(a: list[int], b: list[int]) -> int:
    """Tokens two greedy continuations share before they first differ (the shorter's length if never)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def greedy_totals(rows: list[dict], names, new_tokens: int) -> dict[str, dict]:
    """Per engine over `rows` (each {name: {"tokens_until_divergence", "ref_margin_there"}}, the
    margin None where it never diverged): tokens kept, divergences, and the largest reference margin
    a divergence overrode."""
    return {name: {
        "tokens_until_divergence": sum(r[name]["tokens_until_divergence"] for r in rows),
        "of": len(rows) * new_tokens,
        "diverged": sum(r[name]["ref_margin_there"] is not None for r in rows),
        "largest_margin_overridden": max((r[name]["ref_margin_there"] for r in rows
                                          if r[name]["ref_margin_there"] is not None), default=None)}
        for name in names}
