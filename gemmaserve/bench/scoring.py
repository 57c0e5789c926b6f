"""Teacher-forced scoring of one token sequence by our model (for perplexity and agreement figures):
the sequence runs through the real paged path (V1 manager, torch attention) in chunks, and each
position's next-token log-probability, argmax and top-2 margin are kept (not the [T, vocab] logits)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Scores:
    logprobs: torch.Tensor   # [T-1] log p(ids[i+1] | ids[:i+1])
    argmax: torch.Tensor     # [T-1] the model's top token after ids[:i+1]
    margin: torch.Tensor     # [T-1] top-1 minus top-2 logit there

    @property
    def perplexity(self) -> float:
        return float(torch.exp(-self.logprobs.double().mean()))


def score(model, ids: list[int], chunk: int = 256, page_size: int = 16) -> Scores:
    from ..attention.base import AttentionMetadata
    from ..attention.torch_backend import TorchAttentionBackend
    from ..kv.manager_v1 import KVCacheManagerV1
    from ..models.base import ModelInputs

    specs = model.kv_layer_specs(torch.float32)
    kv = KVCacheManagerV1(specs, page_size, -(-len(ids) // page_size) * len(specs) + 8)
    backend = TorchAttentionBackend()
    cache = backend.allocate_kv_cache(specs, kv.layout, torch.device("cpu"))
    target = torch.tensor(ids[1:] + [0])
    lp, top, margin = [], [], []
    with torch.inference_mode():
        for start in range(0, len(ids), chunk):
            end = min(start + chunk, len(ids))
            if not kv.allocate("s", ids, start, end, prefill=end - start > 1):
                raise RuntimeError("scoring KV pool too small")
            md = AttentionMetadata([end - start], [end], kv.group_tables(["s"]), kv.layer_slot)
            hidden = model(ModelInputs(torch.tensor(ids[start:end]), torch.arange(start, end),
                                       backend.begin_batch(md, cache)))
            logits = model.compute_logits(hidden).float()
            kv.commit("s", ids, end)
            lp.append(torch.log_softmax(logits, -1).gather(1, target[start:end, None])[:, 0])
            two = logits.topk(2, dim=-1)
            top.append(two.indices[:, 0])
            margin.append(two.values[:, 0] - two.values[:, 1])
    return Scores(torch.cat(lp)[:-1], torch.cat(top)[:-1], torch.cat(margin)[:-1])
