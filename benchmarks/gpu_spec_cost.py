"""What verification costs against k, and the speedup it buys at a given acceptance rate
(`python -m benchmarks.gpu_spec_cost [--shapes gemma4-31b:1,8 gemma4-e4b:1,8,64]`).

Random weights accept nothing a real drafter would, so acceptance is not measured but set: per shape and
batch, the engine decodes with k = 0 (plain steps: CUDA graphs) and with k = 1..4 drafts per sequence that
a fixed proposer supplies (every step verifies k + 1 rows per sequence, as a real drafter's steps would),
and times its steps (median after warm-up, asynchronous scheduling off on both sides: a drafting request
waits for its token either way). At acceptance a (each draft accepted with probability a, in a row), a step
emits E = 1 + a + ... + a^k tokens, so decoding runs E x t(0) / t(k) as fast as without drafts; the best k
per a is reported, and t(0) against the roofline (weights + KV bytes per step over the HBM bandwidth
measured in the same run). Writes $OUT/gpu_spec_cost.json (or bench-out/).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ACCEPTANCE = (0.5, 0.7, 0.9, 1.0)


@dataclass
class FixedDrafts:
    """k guesses per step that nothing accepts (random ids): every step verifies k + 1 rows."""

    num_speculative_tokens: int
    vocab_size: int
    drafts_after_step = False

    def propose(self, req, limit: int) -> list[int]:
        rng = random.Random(len(req.all_token_ids))
        return [rng.randrange(3, self.vocab_size) for _ in range(min(self.num_speculative_tokens, limit))]


def _step_times(engine, prompts: list[list[int]], k: int, steps: int, warmup: int) -> list[float]:
    from gemmaserve.engine.sampling_params import SamplingParams

    parts = engine.internals()
    sched, cuda = parts.scheduler, parts.device.type == "cuda"
    sched.proposer = FixedDrafts(k, engine.info.vocab_size) if k else None
    sched.spec_max_batch = 1 << 30
    sched.misses_before_pause = 1 << 30   # every step drafts, though nothing is accepted
    drafted = engine.snapshot().spec.drafted
    params = SamplingParams(max_tokens=steps + warmup + 8, ignore_eos=True, temperature=0.0)
    ids = [engine.add_request("", params, prompt_ids=p) for p in prompts]
    while any(not r.prompt_computed for r in sched.running) or sched.waiting:   # prefill first
        engine.step()
    times = []
    for i in range(steps + warmup):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        engine.step()
        if cuda:
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    drafted = engine.snapshot().spec.drafted - drafted
    if k and drafted < k * len(prompts) * steps:
        raise RuntimeError(f"k = {k}: only {drafted} drafts in {steps} steps")
    for i in ids:
        engine.abort_request(i)
    while engine.has_unfinished_requests():
        engine.step()
    return times


def _weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def main(argv: list[str]) -> int:
    from gemmaserve.bench.gpu_check import copy_bandwidth
    from gemmaserve.config.engine import EngineConfig
    from gemmaserve.engine.llm import LLM
    from gemmaserve.testing.synthetic import random_model

    ap = argparse.ArgumentParser(prog="gpu_spec_cost")
    ap.add_argument("--shapes", nargs="+", default=["gemma4-31b:1,8", "gemma4-e4b:1,8,64"],
                    help="shape:batch,batch,... (synthetic.py's real shapes)")
    ap.add_argument("--context", type=int, default=1024, help="prompt tokens per sequence")
    ap.add_argument("--max-k", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out = Path(os.environ.get("OUT", "bench-out")) / "gpu_spec_cost.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
              "context": args.context, "rows": []}
    bandwidth = copy_bandwidth() if device.type == "cuda" else None
    result["hbm_copy_GB_s"] = bandwidth
    for spec in args.shapes:
        name, _, batches = spec.partition(":")
        loaded = random_model(name, dtype, device)
        vocab = loaded.model.config.vocab_size
        for batch in [int(b) for b in batches.split(",")]:
            config = EngineConfig(model=name, device=args.device, dtype="bfloat16" if device.type == "cuda" else "float32",
                                  max_num_seqs=max(batch, 1), max_num_batched_tokens=max(2048, batch * (args.max_k + 1)),
                                  async_scheduling="off", enable_prefix_caching=False,
                                  # sizes the graphs for k + 1 rows per sequence (the proposer is swapped below)
                                  speculative_config={"method": "ngram", "num_speculative_tokens": args.max_k,
                                                      "disable_by_batch_size": batch},
                                  kv_cache_memory=int(1.3 * batch * (args.context + args.steps * (args.max_k + 2) + 64)
                                                      * _kv_bytes_per_token(loaded.model)) + (256 << 20))
            engine = LLM.from_config(config, loaded).engine
            rng = random.Random(batch)
            prompts = [[2] + [rng.randrange(3, vocab) for _ in range(args.context - 1)] for _ in range(batch)]
            t = {}
            for k in range(args.max_k + 1):
                t[k] = statistics.median(_step_times(engine, prompts, k, args.steps, args.warmup))
            row = {"shape": name, "batch": batch, "step_ms": {k: round(1e3 * v, 3) for k, v in t.items()},
                   "step_over_k0": {k: round(v / t[0], 3) for k, v in t.items()}}
            if bandwidth:
                roof = (_weight_bytes(loaded.model) + batch * args.context * _kv_bytes_per_token(loaded.model)) \
                    / (bandwidth * 1e9)
                row["k0_over_roofline"] = round(t[0] / roof, 3)
            best = {}
            for a in ACCEPTANCE:
                gains = {k: sum(a ** i for i in range(k + 1)) * t[0] / t[k] for k in t}
                kb = max(gains, key=gains.get)
                best[str(a)] = {"k": kb, "speedup": round(gains[kb], 3),
                                "k3": round(gains.get(3, float("nan")), 3)}
            row["speedup_at_acceptance"] = best
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
            out.write_text(json.dumps(result, indent=1))
            del engine
            if device.type == "cuda":
                torch.cuda.empty_cache()
        del loaded
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return 0


def _kv_bytes_per_token(model) -> int:
    specs = model.kv_layer_specs(next(model.parameters()).dtype)
    return sum(2 * s.num_kv_heads * s.head_dim * s.dtype.itemsize for s in specs if s.kv_source is None)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
