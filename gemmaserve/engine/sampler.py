"""Next-token choice from logits: greedy, or temperature / top-k / top-p sampling.

Filtering is batched; the final draw runs per request with that request's own generator, so a
seeded request gives the same tokens whatever else is in the batch.
"""

from __future__ import annotations

import torch

from .request import Request


def sample(logits: torch.Tensor, requests: list[Request]) -> list[int]:
    """logits: [N, V] for N requests -> one token id each."""
    logits = logits.float()
    tokens = logits.argmax(dim=-1)
    random_rows = [i for i, r in enumerate(requests) if not r.params.greedy]
    if random_rows:
        rows = torch.tensor(random_rows, device=logits.device)
        params = [requests[i].params for i in random_rows]
        probs = filtered_probs(
            logits[rows],
            torch.tensor([p.temperature for p in params], device=logits.device),
            [p.top_k for p in params],
            torch.tensor([p.top_p for p in params], device=logits.device),
        )
        for j, i in enumerate(random_rows):
            tokens[i] = torch.multinomial(probs[j], 1, generator=requests[i].generator)[0]
    return tokens.tolist()


def filtered_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: list[int],
                   top_p: torch.Tensor) -> torch.Tensor:
    """Temperature, then top-k, then top-p (smallest set whose probability reaches top_p; the most
    likely token always stays). Returns probabilities [N, V]."""
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
    return logits.softmax(dim=-1)
