"""`gemmaserve bench memory`: KV memory accounting of V1 and V2 on real model shapes (CPU only, no
weights: it drives the KV managers themselves, without tensors).

For each shape and prompt length N it measures, with the real managers:
* bytes one sequence holds once its prompt is in the cache (ready to decode), for V1 and V2, against
  the theoretical minimum: global layers x N tokens + sliding layers x W tokens (KV-owning layers);
* the peak bytes during a chunked prefill (`--chunk`, 8K), V2 with scratch reuse off and on;
* how many such sequences fit at once in one KV budget (`--budget`): sequences are admitted one after
  another (each prefilled in chunks, then left resident) until the next cannot be allocated.

`--kv-cache-dtype fp8` sizes pages for an e4m3 cache (1 byte per element instead of bf16's 2).
"""

from __future__ import annotations

import argparse
import json
from datetime import date
from pathlib import Path

import torch

from ..config.options import format_bytes, parse_size, positive_int
from ..kv import KVCacheManagerV1, KVCacheManagerV2
from ..kv.groups import derive_groups
from ..testing.shapes import SHAPES, parse_shapes_and_lengths

DEFAULT_SHAPES = "gemma3-4b,gemma3-27b,gemma4-e2b,gemma4-31b"
KV_DTYPES = {"bfloat16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help=f"model shapes (default: {DEFAULT_SHAPES}; "
                        f"known: {', '.join(SHAPES)})")
    parser.add_argument("--lengths", default="8192,32768,131072", help="prompt lengths in tokens")
    parser.add_argument("--chunk", type=positive_int, default=8192, help="prefill chunk (tokens per step)")
    parser.add_argument("--page-size", type=positive_int, default=16, help="tokens per page (largest layers)")
    parser.add_argument("--budget", default="80GiB", help="KV budget for the concurrency column")
    parser.add_argument("--kv-cache-dtype", choices=list(KV_DTYPES), default="bfloat16", help="KV storage dtype")
    parser.add_argument("--out", default="bench-out/memory.json", help="JSON output; the plot goes beside it (.png)")


class _Sim:
    """One KV manager driven the way the scheduler would drive it."""

    def __init__(self, manager, chunk: int):
        self.kv = manager
        self.chunk = chunk
        self.n = 0

    def prefill(self, length: int, sliding_peak: bool = False) -> tuple[bool, int, int]:
        """Admit one sequence of `length` fresh tokens. Returns (fitted, peak pages in use, peak pages
        of sliding groups (only if `sliding_peak`: it costs a stats() walk per chunk))."""
        sid = f"s{self.n}"
        self.n += 1
        tokens = [self.n * 1_000_003 + i for i in range(length)]  # distinct: no prefix sharing
        peak = peak_sliding = pos = 0
        while pos < length:
            end = min(pos + self.chunk, length)
            if not self.kv.allocate(sid, tokens, pos, end, prefill=True):
                self.kv.free(sid)
                return False, peak, peak_sliding
            peak = max(peak, self.kv.num_used_pages)
            if sliding_peak:
                peak_sliding = max(peak_sliding, sum(g.pages_used for g in self.kv.stats().groups if g.window))
            self.kv.commit(sid, tokens, end)
            pos = end
        return True, peak, peak_sliding

    def used_bytes(self) -> int:
        return self.kv.num_used_pages * self.kv.page_bytes


def _v2(specs, page_size, pages, scratch):
    return KVCacheManagerV2(specs, page_size, pages, enable_prefix_caching=False, enable_scratch=scratch)


def measure(shape_name: str, length: int, chunk: int, page_size: int, budget: int,
            kv_dtype: torch.dtype = torch.bfloat16) -> dict:
    shape = SHAPES[shape_name]
    specs = shape.layer_specs(kv_dtype)
    owners = [s for s in specs if s.owns_kv]
    minimum = sum(s.bytes_per_token() * (length if s.window is None else min(length, s.window)) for s in owners)
    row = {"shape": shape_name, "tokens": length, "min_bytes": minimum}

    v1_page = KVCacheManagerV1.page_bytes_for(specs, page_size)
    row["v1_bytes"] = -(-length // page_size) * v1_page
    v2_page = derive_groups(specs, page_size).page_bytes
    roomy = 4 * (-(-row["v1_bytes"] // v2_page)) + 1024
    for scratch in (False, True):
        sim = _Sim(_v2(specs, page_size, roomy, scratch), chunk)
        ok, peak, sliding = sim.prefill(length, sliding_peak=True)
        assert ok
        key = "v2_scratch" if scratch else "v2"
        row[f"{key}_bytes"] = sim.used_bytes()
        row[f"{key}_peak_bytes"] = peak * v2_page
        row[f"{key}_sliding_peak_bytes"] = sliding * v2_page
        sim.kv.check_integrity()
    groups = derive_groups(specs, page_size).groups
    # Target for the sliding groups' scratch peak: every layer's window plus one page, plus one layer's
    # worth of the chunk (what the first chunk needs; later chunks also hold the previous window).
    row["scratch_sliding_target_bytes"] = v2_page * sum(
        g.num_layers * (g.num_blocks(g.window) + 1) + g.num_blocks(min(chunk, length)) for g in groups if g.sliding)
    row["v2_over_min_pages_per_layer"] = round((row["v2_bytes"] - minimum) / v2_page / sum(g.num_layers for g in groups), 3)

    # Concurrency in one budget.
    row["budget_bytes"] = budget
    v1_pages = budget // v1_page
    row["v1_max_seqs"] = _fill(_Sim(KVCacheManagerV1(specs, page_size, v1_pages), chunk), length)
    for scratch in (False, True):
        sim = _Sim(_v2(specs, page_size, budget // v2_page, scratch), chunk)
        row["v2_scratch_max_seqs" if scratch else "v2_max_seqs"] = _fill(sim, length)
    return row


def _fill(sim: _Sim, length: int, cap: int = 100_000) -> int:
    count = 0
    while count < cap:
        ok, _, _ = sim.prefill(length)
        if not ok:
            break
        count += 1
    sim.kv.check_integrity()
    return count


def run(args: argparse.Namespace) -> int:
    shapes, lengths = parse_shapes_and_lengths(args.shapes, args.lengths)
    budget = parse_size(args.budget)
    kv_dtype = args.kv_cache_dtype
    rows = [measure(s, n, args.chunk, args.page_size, budget, KV_DTYPES[kv_dtype]) for s in shapes for n in lengths]
    result = {"benchmark": "memory", "date": date.today().isoformat(), "chunk": args.chunk,
              "page_size": args.page_size, "budget_bytes": budget, "dtype": kv_dtype, "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    _print(result)
    png = out.with_suffix(".png")
    if _plot(result, png):
        print(f"wrote {out} and {png}")
    else:
        print(f"wrote {out} (install matplotlib for the plot)")
    return 0


def _print(result: dict) -> None:
    f = format_bytes
    print(f"KV bytes per sequence ({result['dtype']}, page {result['page_size']}), chunk {result['chunk']}, "
          f"concurrency in {f(result['budget_bytes'])}")
    print(f"{'shape':<11} {'tokens':>7} {'minimum':>10} {'V1':>10} {'V2':>10} {'V2/min':>7} {'peak':>10} "
          f"{'peak+scr':>10} {'SWA peak':>10} {'SWA+scr':>10} {'target':>10} {'seqs V1':>8} {'V2':>6} {'V2+scr':>7}")
    for r in result["rows"]:
        print(f"{r['shape']:<11} {r['tokens']:>7} {f(r['min_bytes']):>10} {f(r['v1_bytes']):>10} "
              f"{f(r['v2_bytes']):>10} {r['v2_bytes'] / r['min_bytes']:>7.3f} {f(r['v2_peak_bytes']):>10} "
              f"{f(r['v2_scratch_peak_bytes']):>10} {f(r['v2_sliding_peak_bytes']):>10} "
              f"{f(r['v2_scratch_sliding_peak_bytes']):>10} {f(r['scratch_sliding_target_bytes']):>10} "
              f"{r['v1_max_seqs']:>8} {r['v2_max_seqs']:>6} {r['v2_scratch_max_seqs']:>7}")


def _plot(result: dict, png: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = result["rows"]
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    fig, axes = plt.subplots(2, len(shapes), figsize=(4.2 * len(shapes), 7.5), squeeze=False)
    gib = 2**30
    for col, shape in enumerate(shapes):
        rs = [r for r in rows if r["shape"] == shape]
        x = [r["tokens"] // 1024 for r in rs]
        ax = axes[0][col]
        for key, label, style in (("v1_bytes", "V1", "o-"), ("v2_bytes", "V2", "s-"),
                                  ("min_bytes", "minimum", "k--"), ("v2_peak_bytes", "V2 prefill peak", "^:"),
                                  ("v2_scratch_peak_bytes", "V2+scratch prefill peak", "v:")):
            ax.plot(x, [r[key] / gib for r in rs], style, label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(shape)
        ax.set_xlabel("prompt (K tokens)")
        ax.set_ylabel("KV GiB per sequence")
        ax.grid(alpha=0.3)
        if col == 0:
            ax.legend(fontsize=7)
        ax = axes[1][col]
        width = 0.27
        pos = range(len(rs))
        for i, (key, label) in enumerate((("v1_max_seqs", "V1"), ("v2_max_seqs", "V2"),
                                          ("v2_scratch_max_seqs", "V2+scratch"))):
            ax.bar([p + (i - 1) * width for p in pos], [max(r[key], 0.5) for r in rs], width, label=label)
        ax.set_xticks(list(pos), [f"{t}K" for t in x])
        ax.set_yscale("log")
        ax.set_ylabel(f"sequences in {format_bytes(result['budget_bytes'])}")
        ax.grid(alpha=0.3, axis="y")
        if col == 0:
            ax.legend(fontsize=7)
    fig.suptitle(f"KV cache per sequence and concurrency ({result['dtype']}, chunk {result['chunk']}, "
                 f"{result['date']})")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return True
