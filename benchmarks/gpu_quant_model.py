"""Quantised weights in the whole engine on CUDA (`python -m benchmarks.gpu_quant_model [shapes] [--schemes ...]`):
random bf16 weights at real Gemma 4 shapes, then every attention and MLP projection quantised in place (W4A16: int4
groups of 32 by rounding to nearest; FP8: e4m3 per output channel, activations per token), and a MoE model's
experts too (26B-A4B: each expert's gate_up and down the same way, per expert, into QuantizedExperts and the grouped
kernels of quantization/grouped_kernels.py), the head and embeddings as they are, as a W4A16 / FP8 checkpoint would
load. For each shape and scheme, in the same run:

  * the batch-1 decode step (1K-token context) as the engine runs it and as its captured CUDA graph replays,
    against the roofline: bytes of weights (packed weights and scales; of a MoE's experts, the top-k a token
    reads) + KV read per step over the HBM copy bandwidth measured in this run;
  * batch-1 tokens/s (the engine's step) and, with `--batch64`, batch-64 throughput (1K in, 128 out);
  * each ratio against bf16 of the same shape.

Shapes (default: gemma4-e4b gemma4-31b; also gemma4-26b-a4b, the MoE, or any of testing/synthetic.py's); schemes
(default: bf16 w4a16 fp8). Writes $OUT/gpu_quant_model.json
after every row; a table last. The 31B's bf16 weights take 62 GB: run it on an 80 GB card alone."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch

from benchmarks.gpu_bench import GiB, _engine, _prompts, _run_all, batch1_decode
from gemmaserve.bench.gpu_check import copy_bandwidth
from gemmaserve.bench.sections import release_device_memory
from gemmaserve.testing.synthetic import random_model

SCHEMES = ("bf16", "w4a16", "fp8")


def _quantize(loaded, scheme: str) -> None:
    from gemmaserve.models.quantized import formats, over_stacked_rows, quantize_expert_blocks, quantize_projections
    from gemmaserve.quantization.compressed_tensors import ModuleQuant
    from gemmaserve.quantization.schemes import Scheme, quantize_fp8_per_channel, quantize_int4_groups

    if scheme == "w4a16":
        quant, quantize = ModuleQuant(Scheme.W4A16, group=32), lambda _, w: quantize_int4_groups(w, 32, torch.bfloat16)
    elif scheme == "fp8":
        quant, quantize = ModuleQuant(Scheme.FP8), lambda _, w: quantize_fp8_per_channel(w)
    else:
        return
    done = quantize_projections(loaded.model, quant, quantize)
    # Experts [E, N, K]: the same scheme over their stacked rows [E * N, K] (per expert and output channel / group).
    done |= quantize_expert_blocks(loaded.model, quant, over_stacked_rows(quantize))
    loaded.weight_formats = formats(loaded.model, done, torch.bfloat16)


def _tensor_bytes(obj) -> int:
    """Bytes of the tensors a kernel's weight dataclass holds (0 for None)."""
    if obj is None:
        return 0
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if dataclasses.is_dataclass(obj):
        return sum(_tensor_bytes(getattr(obj, f.name)) for f in dataclasses.fields(obj))
    return 0


def _weight_bytes(model) -> int:
    """Bytes a decode step reads of the weights: parameters, plus each quantised layer's kernel tensors; of a MoE
    experts block (bf16 or quantised), the top-k experts' share that one token reads."""
    from gemmaserve.models.moe import GroupedExperts
    from gemmaserve.models.quantized_experts import QuantizedExperts
    from gemmaserve.quantization.linear import QuantizedLinear

    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    in_experts = {id(p) for m in experts for p in m.parameters()}
    total = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in in_experts)
    for m in model.modules():
        if isinstance(m, QuantizedLinear):
            total += _tensor_bytes(m.kernel_weight)
    top_k = getattr(model.config, "top_k_experts", 0)
    for m in experts:
        block = sum(p.numel() * p.element_size() for p in m.parameters())
        if isinstance(m, QuantizedExperts):
            block += sum(_tensor_bytes(w) for w in m.kernel_weights.values())
        total += block * min(top_k, m.num_experts) // m.num_experts
    return total


def _row(shape: str, scheme: str, hbm: float, batch64: bool) -> dict:
    start = time.perf_counter()
    loaded = random_model(shape, torch.bfloat16, torch.device("cuda"))
    _quantize(loaded, scheme)
    release_device_memory()
    build_s = time.perf_counter() - start
    llm = _engine(loaded, kv_cache_memory=8 * GiB, max_num_seqs=64)
    eng = llm.engine
    cfg = loaded.model.config
    step_ms, graph_ms, kv_bytes = batch1_decode(llm, loaded.model)
    weights = _weight_bytes(loaded.model)
    roof_ms = (weights + kv_bytes) / (hbm * 1e9) * 1e3
    row = {"shape": shape, "scheme": scheme, "weights": eng.info.weights, "weight_GB": round(weights / 1e9, 2),
           "kv_read_MB": round(kv_bytes / 1e6, 1), "roofline_ms": round(roof_ms, 3), "graph_ms": round(graph_ms, 3),
           "engine_step_ms": round(step_ms, 3), "graph_over_roofline": round(graph_ms / roof_ms, 2),
           "step_over_roofline": round(step_ms / roof_ms, 2), "batch1_tok_s": round(1e3 / step_ms, 1),
           "build_s": round(build_s, 1)}
    if batch64:
        _run_all(llm, _prompts(64, 1024, cfg.vocab_size, seed=65), 8)   # warm-up at these shapes
        secs = _run_all(llm, _prompts(64, 1024, cfg.vocab_size, seed=64), 128)
        row["batch64_tok_s"] = round(64 * 128 / secs, 1)
    llm.close()
    return row


def _use_pairs_table(table: dict[str, dict]) -> None:
    """This process's int4 pairs products take `table`'s configuration for its (N, K), the library's elsewhere:
    what an engine with those configurations in `pairs_config` would run (int4_pairs_linear reads the module's
    `pairs_config` at each call)."""
    from gemmaserve.quantization import int4_pairs as P

    chosen = {tuple(int(v) for v in key.split(",")): P.PairsConfig(**fields) for key, fields in table.items()}
    default = P.pairs_config

    def pairs_config(n: int, k: int, sms: int) -> P.PairsConfig:
        return chosen.get((n, k)) or default(n, k, sms)

    P.pairs_config = pairs_config
    print(f"pairs configurations from the table for {sorted(chosen)}", flush=True)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shapes", nargs="*", default=["gemma4-e4b", "gemma4-31b"])
    ap.add_argument("--schemes", default=",".join(SCHEMES))
    ap.add_argument("--batch64", action="store_true", help="also batch-64 throughput (1K in, 128 out)")
    ap.add_argument("--pairs-table", type=Path, help="an experiment: the int4 pairs kernel takes the configurations "
                    "of this JSON ({'N,K': {PairsConfig field: value}}, what gpu_quant pairs_candidates writes) for its "
                    "shapes, int4_pairs.pairs_config's elsewhere")
    args = ap.parse_args(argv)
    if args.pairs_table:
        _use_pairs_table(json.loads(args.pairs_table.read_text()))
    schemes = args.schemes.split(",")
    if unknown := [s for s in schemes if s not in SCHEMES]:
        ap.error(f"unknown schemes {unknown}; known: {', '.join(SCHEMES)}")
    out = Path(os.environ.get("OUT", "."))
    hbm = copy_bandwidth()
    res: dict = {"benchmark": "gpu_quant_model", "device": torch.cuda.get_device_name(), "hbm_copy_GBps": round(hbm),
                 "torch": torch.__version__, "rows": []}
    print(f"HBM copy {hbm:.0f} GB/s on {res['device']}", flush=True)
    for shape in args.shapes:
        base = None
        for scheme in schemes:
            try:
                row = _row(shape, scheme, hbm, args.batch64)
            except Exception as exc:   # keep the other rows
                import traceback

                traceback.print_exc()
                row = {"shape": shape, "scheme": scheme, "error": repr(exc)}
            gc.collect()
            release_device_memory()
            if scheme == "bf16" and "error" not in row:
                base = row
            elif base is not None and "error" not in row:
                row["batch1_vs_bf16"] = round(row["batch1_tok_s"] / base["batch1_tok_s"], 2)
                if "batch64_tok_s" in row:
                    row["batch64_vs_bf16"] = round(row["batch64_tok_s"] / base["batch64_tok_s"], 2)
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
            (out / "gpu_quant_model.json").write_text(json.dumps(res, indent=1))
    print(f"{'shape':12} {'scheme':6} {'GB':>6} {'roof ms':>8} {'graph ms':>9} {'step ms':>8} {'x roof':>6} "
          f"{'tok/s':>7} {'vs bf16':>7} {'b64 tok/s':>9}")
    for r in res["rows"]:
        if "error" in r:
            print(f"{r['shape']:12} {r['scheme']:6} ERROR {r['error'][:80]}")
            continue
        print(f"{r['shape']:12} {r['scheme']:6} {r['weight_GB']:6.2f} {r['roofline_ms']:8.3f} {r['graph_ms']:9.3f} "
              f"{r['engine_step_ms']:8.3f} {r['graph_over_roofline']:6.2f} {r['batch1_tok_s']:7.1f} "
              f"{r.get('batch1_vs_bf16', 1.0):7.2f} {r.get('batch64_tok_s', 0):9.1f}")
    return 1 if any("error" in r for r in res["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
