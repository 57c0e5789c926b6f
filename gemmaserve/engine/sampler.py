"""Next-token choice from logits.

    raw logits -> log-probabilities reported to the user (logprobs)
               -> penalties (repetition: HF semantics; presence / frequency: OpenAI semantics)
               -> greedy argmax, or temperature -> top-k -> top-p -> min-p -> draw

Filtering is batched; the draw runs per request with that request's own generator, so a seeded
request gives the same tokens whatever else is in the batch.
"""

from __future__ import annotations

import torch

from .request import Request, TokenLogprob


def sample(logits: torch.Tensor, requests: list[Request]) -> tuple[list[int], list[TokenLogprob | None]]:
    """logits: [N, V] for N requests -> one token id (and its logprob record, if asked) each."""
    raw = logits.float()
    logits = raw
    dev = raw.device
    penalized = [i for i, r in enumerate(requests) if r.params.has_penalties]
    if penalized:
        logits = raw.clone()
        rows = torch.tensor(penalized, device=dev)
        logits[rows] = apply_penalties(logits[rows], [requests[i] for i in penalized])
    tokens = logits.argmax(dim=-1)
    random_rows = [i for i, r in enumerate(requests) if not r.params.greedy]
    if random_rows:
        rows = torch.tensor(random_rows, device=dev)
        params = [requests[i].params for i in random_rows]
        probs = filtered_probs(
            logits[rows],
            torch.tensor([p.temperature for p in params], device=dev),
            [p.top_k for p in params],
            torch.tensor([p.top_p for p in params], device=dev),
            torch.tensor([p.min_p for p in params], device=dev),
        )
        for j, i in enumerate(random_rows):
            tokens[i] = torch.multinomial(probs[j], 1, generator=requests[i].generator)[0]
    chosen = tokens.tolist()
    records: list[TokenLogprob | None] = [None] * len(requests)
    want = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
    if want:
        logp = torch.log_softmax(raw[torch.tensor(want, device=dev)], dim=-1)
        k = max(requests[i].params.logprobs for i in want)
        top_v, top_i = logp.topk(max(k, 1), dim=-1)
        picked = logp.gather(1, torch.tensor([[chosen[i]] for i in want], device=dev))[:, 0].tolist()
        top_v, top_i = top_v.tolist(), top_i.tolist()
        for j, i in enumerate(want):
            n = requests[i].params.logprobs
            records[i] = TokenLogprob(chosen[i], picked[j], tuple(zip(top_i[j][:n], top_v[j][:n])))
    return chosen, records


def apply_penalties(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Repetition penalty over prompt + output tokens (divide positive logits, multiply negative
    ones); presence and frequency penalties over output tokens (subtract p * [count > 0] + f * count)."""
    n, vocab = logits.shape
    dev = logits.device
    rep = torch.tensor([r.params.repetition_penalty for r in requests], device=dev)[:, None]
    presence = torch.tensor([r.params.presence_penalty for r in requests], device=dev)[:, None]
    frequency = torch.tensor([r.params.frequency_penalty for r in requests], device=dev)[:, None]
    seen = torch.zeros(n, vocab, dtype=torch.bool, device=dev)
    counts = torch.zeros(n, vocab, device=dev)
    for row, r in enumerate(requests):
        seen[row, torch.tensor(r.prompt_token_ids + r.output_token_ids, dtype=torch.long, device=dev)] = True
        if r.output_token_ids:
            out = torch.tensor(r.output_token_ids, device=dev)
            counts[row].index_add_(0, out, torch.ones(len(out), device=dev))
    penalized = torch.where(logits < 0, logits * rep, logits / rep)
    logits = torch.where(seen, penalized, logits)
    return logits - presence * (counts > 0) - frequency * counts


def filtered_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: list[int],
                   top_p: torch.Tensor, min_p: torch.Tensor | None = None) -> torch.Tensor:
    """Temperature, then top-k, then top-p (smallest set whose probability reaches top_p; the most
    likely token always stays), then min-p. Returns probabilities [N, V]."""
    logits = logits / temperature[:, None]
    vocab = logits.shape[-1]
    if any(0 < k < vocab for k in top_k):
        ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_k], device=logits.device)
        kth = logits.topk(int(ks.max()), dim=-1).values.gather(1, (ks - 1)[:, None])
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if bool((top_p < 1.0).any()):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = mass_before >= top_p[:, None]
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(dim=-1)
    if min_p is not None and bool((min_p > 0).any()):
        keep = probs >= min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = torch.where(keep, probs, torch.zeros_like(probs))
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs
