"""The embedded 270M's output head on the CPU: the 4-bit scan with the near-top tokens exact (cpu_head.py) against
the int8 scan with the 32 highest exact that it replaced, on the real Q8_0 table and real hidden states
(`python -m benchmarks.cpu_head [--rows 1,8]`).

Hidden states: the quantised model's, teacher-forced over bench quality's passages. Per row count: the median
time of each head (alternating), and over the captured rows: the KL divergence of each from the exact Q8_0
head (every logit recomputed in fp32), greedy agreement with it, the mean difference of the text's next-token
negative log-likelihood from the exact head's, the tokens the new head refines per row.
Writes $OUT/cpu_head.json (or bench-out/).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import date
from pathlib import Path

import torch


def _capture(quant, texts: list[list[int]]) -> torch.Tensor:
    from gemmaserve.testing.scoring import Scorer

    model = quant.model
    seen: list[torch.Tensor] = []
    head = model.compute_logits

    def capture(hidden: torch.Tensor) -> torch.Tensor:
        seen.append(hidden.detach().reshape(-1, hidden.shape[-1]).clone())
        return head(hidden)

    model.compute_logits = capture
    try:
        scorer = Scorer(model, max(len(t) for t in texts))
        for ids in texts:
            scorer.score(ids)
    finally:
        del model.compute_logits
    return torch.cat(seen)


def main(argv: list[str] | None = None) -> int:
    from gemmaserve.bench.quality_texts import load as load_texts
    from gemmaserve.models import cpu_head, cpu_library
    from gemmaserve.models.loader import load_model
    from gemmaserve.models.quant import Int8Matmul, QuantEmbedding, _BlockRows, default_int8_kernel, int8_rows
    from gemmaserve.testing.scoring import kl_from

    ap = argparse.ArgumentParser(prog="cpu_head")
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--positions", type=int, default=400, help="captured rows scored for KL (random, seeded)")
    args = ap.parse_args(argv)
    out = Path(os.environ.get("OUT", "bench-out")) / "cpu_head.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    assert cpu_library.load() is None
    quant = load_model("gemma3-270m", torch.float32, torch.device("cpu"), quantized=True)
    table: QuantEmbedding = quant.model.model.embed_tokens
    assert table.head4 is not None, "the embedded model's table is not scanned in 4 bits"
    old = QuantEmbedding.__new__(QuantEmbedding)   # the int8 scan + top-32 head, on the same blocks
    torch.nn.Module.__init__(old)
    old.num_embeddings, old.embedding_dim, old.head4 = table.num_embeddings, table.embedding_dim, None
    old.register_buffer("qweight", table.qweight)
    old.register_buffer("scales", table.scales)
    old.head = Int8Matmul(*int8_rows(_BlockRows(old)), default_int8_kernel())

    tok = quant.tokenizer
    texts = [tok.encode(t) for t in load_texts().passages[:3]]
    hidden = _capture(quant, texts)
    assert len(hidden) == sum(map(len, texts)), "one hidden row per position"
    # each position's next token (a text's last position has none: -1)
    targets = torch.cat([torch.tensor(t[1:] + [-1]) for t in texts])
    order = torch.randperm(len(hidden), generator=torch.Generator().manual_seed(0))
    order = order[targets[order] >= 0][:args.positions]
    pick, target = hidden[order], targets[order]
    w = (table.qweight.float().view(table.num_embeddings, -1, 32) * table.scales.float()[..., None])
    exact = pick @ w.view(table.num_embeddings, -1).T
    ref = torch.log_softmax(exact, -1)
    result: dict = {"benchmark": "cpu_head", "date": date.today().isoformat(), "threads": torch.get_num_threads(),
                    "int8_kernel": default_int8_kernel().value, "vocab": table.num_embeddings,
                    "width": table.embedding_dim, "margin": cpu_head.REFINE_MARGIN, "positions": len(pick)}
    quality = {}
    for name, fn in (("int8_scan_top32", old.as_head), ("4bit_scan_margin", table.as_head)):
        got = torch.cat([fn(pick[i:i + 8]) for i in range(0, len(pick), 8)])
        logp = torch.log_softmax(got, -1)
        quality[name] = {"kl_from_exact_q8": float(kl_from(ref, logp).double().mean()),
                         "argmax_agreement": float((got.argmax(-1) == exact.argmax(-1)).float().mean()),
                         "nll_minus_exact_head": float((ref - logp).gather(1, target[:, None]).double().mean())}
    scan = torch.ops.gemmaserve.head_logits(pick, *table.head4, table.qweight, table.scales, -1e30)
    refined = (scan >= scan.amax(-1, keepdim=True) - cpu_head.REFINE_MARGIN).sum(-1).float()
    quality["4bit_scan_margin"]["refined_per_row"] = {"mean": float(refined.mean()), "max": int(refined.max())}
    result["quality"] = quality
    timing = {}
    for m in (int(r) for r in args.rows.split(",")):
        h = pick[:m].contiguous()
        times: dict[str, list[float]] = {"int8_scan_top32": [], "4bit_scan_margin": [], "4bit_scan_alone": []}
        scan_alone = lambda x: torch.ops.gemmaserve.head_logits(x, *table.head4, table.qweight, table.scales, -1e30)  # noqa: E731
        for _ in range(args.repeats):
            for name, fn in (("int8_scan_top32", old.as_head), ("4bit_scan_margin", table.as_head),
                             ("4bit_scan_alone", scan_alone)):
                t0 = time.perf_counter()
                fn(h)
                times[name].append((time.perf_counter() - t0) * 1e3)
        med = {k: statistics.median(v[2:]) for k, v in times.items()}
        timing[str(m)] = {**{f"{k}_ms": round(v, 3) for k, v in med.items()},
                          "speedup": round(med["int8_scan_top32"] / med["4bit_scan_margin"], 3)}
    result["timing"] = timing
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
