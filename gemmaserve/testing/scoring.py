"""Teacher-forced scoring of token sequences by our model (for perplexity and agreement figures):
each sequence runs through the real paged path (V1 manager, torch attention) in chunks, and each
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

    @staticmethod
    def cat(parts: list["Scores"]) -> "Scores":
        """Several texts' scores as one (per-token figures over all of them; full log-probabilities dropped)."""
        kl = None if any(p.kl is None for p in parts) else torch.cat([p.kl for p in parts])
        return Scores(torch.cat([p.logprobs for p in parts]), torch.cat([p.argmax for p in parts]),
                      torch.cat([p.margin for p in parts]), kl)


def kl_from(reference: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """Per row KL(p || q) for log-probabilities `reference` (p) and `logprobs` (q), [n, vocab] -> [n]."""
    p = reference.float()
    return (p.exp() * (p - logprobs.float())).sum(-1)


class Scorer:
    """Scores sequences of up to `max_len` tokens through one KV pool (and, `compiled`, one compiled
    decode step, compiled once for every sequence). `chunk`: rows per forward (1 runs the decode
    kernels). `compiled` (chunk 1 only): every step through the compiled decode graph
    (engine/compile/compiled_decode.py), as the engine runs batch-1 decode once it is compiled; with
    `kv_manager` "v2" (the engine's for Gemma) its attention is traced into the graph, with "v1" the
    graph calls it through an op."""

    def __init__(self, model, max_len: int, chunk: int = 256, page_size: int = 16, compiled: bool = False,
                 kv_manager: str = "v1"):
        from ..attention.torch_backend import TorchAttentionBackend
        from ..engine.compile.compiled_decode import CompiledDecode
        from ..kv.manager_v1 import KVCacheManagerV1
        from ..kv.manager_v2 import KVCacheManagerV2

        if compiled and chunk != 1:
            raise ValueError("only decode steps (chunk=1) are compiled")
        self.model, self.max_len, self.chunk = model, max_len, chunk
        specs = model.kv_layer_specs(torch.float32)
        pages = -(-max_len // page_size) * len(specs) + 8
        if kv_manager == "v1":
            self.kv = KVCacheManagerV1(specs, page_size, pages)
        elif kv_manager == "v2":
            self.kv = KVCacheManagerV2(specs, page_size, pages, enable_prefix_caching=False, enable_scratch=False)
        else:
            raise ValueError(f"kv_manager must be v1 or v2, got {kv_manager!r}")
        self.backend = TorchAttentionBackend()
        # One page more: the compiled graph's warm-up writes to it (the null page).
        layout = dataclasses.replace(self.kv.layout, num_pages=self.kv.layout.num_pages + 1)
        self.cache = self.backend.allocate_kv_cache(specs, layout, torch.device("cpu"))
        self.step = None
        if compiled:
            self.step = CompiledDecode(model, self.backend, self.cache, self.kv.layer_slot, self.kv.groups,
                                       self.kv.layout.num_pages, max_batch=1, specs=specs,
                                       tokens_per_page=self.kv.layout.tokens_per_page)
            self.step.compile()

    def score(self, ids: list[int], keep_logprobs: bool = False, reference: Scores | None = None) -> Scores:
        """`reference`: a Scores with `full_logprobs` of the same ids, to measure the KL divergence from."""
        from ..attention.base import AttentionMetadata
        from ..models.base import ModelInputs

        if len(ids) > self.max_len:
            raise ValueError(f"{len(ids)} tokens: this scorer holds at most {self.max_len}")
        kv, chunk = self.kv, self.chunk
        target = torch.tensor(ids[1:] + [0])
        lp, top, margin, full, kl = [], [], [], [], []
        try:
            with torch.inference_mode():
                for start in range(0, len(ids), chunk):
                    end = min(start + chunk, len(ids))
                    if not kv.allocate("s", ids, start, end, prefill=end - start > 1):
                        raise RuntimeError("scoring KV pool too small")
                    md = AttentionMetadata([end - start], [end], kv.group_tables(["s"]), kv.layer_slot)
                    if self.step is not None:
                        logits = self.step.run(torch.tensor(ids[start:end]), torch.arange(start, end), md)[0].float()
                    else:
                        hidden = self.model(ModelInputs(torch.tensor(ids[start:end]), torch.arange(start, end),
                                                        self.backend.begin_batch(md, self.cache)))
                        logits = self.model.compute_logits(hidden).float()
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
        finally:
            kv.free("s")
        return Scores(torch.cat(lp)[:-1], torch.cat(top)[:-1], torch.cat(margin)[:-1],
                      torch.cat(kl) if kl else None, torch.cat(full)[:-1] if full else None)


def score(model, ids: list[int], chunk: int = 256, page_size: int = 16, keep_logprobs: bool = False,
          reference: Scores | None = None, compiled: bool = False, kv_manager: str = "v1") -> Scores:
    """One sequence through a fresh `Scorer` (see there for the arguments)."""
    return Scorer(model, len(ids), chunk, page_size, compiled, kv_manager).score(ids, keep_logprobs, reference)


def paired_nll_difference(a: Scores, b: Scores) -> tuple[float, float]:
    """Mean per-token difference of negative log-likelihood, a's minus b's, over the same tokens, and
    its standard error (tokens taken as independent). Negative: a assigns the text more probability;
    log(perplexity a / perplexity b) equals the mean."""
    if a.logprobs.shape != b.logprobs.shape:
        raise ValueError(f"scores of different texts: {tuple(a.logprobs.shape)} vs {tuple(b.logprobs.shape)}")
    d = (b.logprobs.double() - a.logprobs.double())
    se = float(d.std() / d.numel() ** 0.5) if d.numel() > 1 else float("nan")
    return float(d.mean()), se


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
