"""Speculative decoding end to end at set acceptance rates
(`python -m benchmarks.gpu_spec_replay [--shapes gemma4-31b:1,8,64] [--k 3] [--quant bf16|w4a16|fp8]`).

Random weights accept nothing a real drafter would, so the drafts come from a replay proposer
(testing/replay_drafts.py): per shape and batch, the engine first decodes greedily without drafts (the
reference, timed), then again with k drafts per step taken from that reference continuation, each right
with probability a. Every step then runs the engine's whole speculative path (scheduling, the verification
step in CUDA graphs, rollback) and emits what the target emits. Reported per a: decode tokens per second
against the reference (prefill excluded on both sides: timing starts once every prompt is in the cache),
tokens per step and the acceptance rate (accepted / drafted, as /metrics has it: a draft after a miss
counts, so it reads below a), and whether the tokens equal the reference (bf16 CUDA steps round a k + 1-row
verification batch in another order than a one-row step, so random weights can drift, and fewer drafts
then match). The drafter's own cost is not included (an MTP
drafter adds its k small forwards per step). Writes $OUT/gpu_spec_replay.json (or bench-out/).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
from pathlib import Path

import torch

ACCEPTANCE = (0.5, 0.7, 0.9, 1.0)


def _decode(engine, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], float, int, float]:
    """(each prompt's greedy continuation, decode seconds after prefill, forwards, seconds in the runner's
    launch: the forward and, for a verification step, the readback of each position's choice)."""
    from gemmaserve.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True, temperature=0.0)
    ids = [engine.add_request("", params, prompt_ids=p) for p in prompts]
    parts = engine.internals()
    sched, cuda = parts.scheduler, parts.device.type == "cuda"
    done: dict[str, list[int]] = {}

    def step():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids

    while any(not r.prompt_computed for r in sched.running) or sched.waiting:   # prefill first
        step()
    if cuda:
        torch.cuda.synchronize()
    runner, launched = parts.runner, [0, 0.0]
    launch = runner.launch

    def timed(plan, only=None):
        t = time.perf_counter()
        try:
            return launch(plan, only)
        finally:
            launched[0] += bool(plan.seqs)
            launched[1] += time.perf_counter() - t

    runner.launch = timed
    start = time.perf_counter()
    try:
        while engine.has_unfinished_requests():
            step()
        if cuda:
            torch.cuda.synchronize()
    finally:
        runner.launch = launch
    return [done[i] for i in ids], time.perf_counter() - start, launched[0], launched[1]


def main(argv: list[str]) -> int:
    from benchmarks.gpu_quant_model import _quantize
    from benchmarks.gpu_spec_cost import _kv_bytes_per_token
    from gemmaserve.bench.sections import release_device_memory
    from gemmaserve.config.engine import EngineConfig
    from gemmaserve.engine.llm import LLM
    from gemmaserve.testing.replay_drafts import ReplayDrafts
    from gemmaserve.testing.synthetic import random_model

    ap = argparse.ArgumentParser(prog="gpu_spec_replay")
    ap.add_argument("--shapes", nargs="+", default=["gemma4-31b:1,8,64"],
                    help="shape:batch,batch,... (synthetic.py's real shapes)")
    ap.add_argument("--k", type=int, default=3, help="drafts per step")
    ap.add_argument("--acceptance", default=",".join(map(str, ACCEPTANCE)))
    ap.add_argument("--context", type=int, default=1024, help="prompt tokens per sequence")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--async-scheduling", default="auto", choices=["auto", "on", "off"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quant", default="bf16", choices=["bf16", "w4a16", "fp8"],
                    help="projections quantised in place after the random build (gpu_quant_model's schemes)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rates = [float(a) for a in args.acceptance.split(",")]
    out = Path(os.environ.get("OUT", "bench-out")) / "gpu_spec_replay.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
              "quant": args.quant, "context": args.context, "new_tokens": args.new_tokens, "k": args.k, "rows": []}
    for spec in args.shapes:
        name, _, batches = spec.partition(":")
        loaded = random_model(name, dtype, device)
        _quantize(loaded, args.quant)
        release_device_memory()
        vocab = loaded.model.config.vocab_size
        for batch in [int(b) for b in batches.split(",")]:
            tokens = batch * (args.context + args.new_tokens + args.k + 64)
            config = EngineConfig(model=name, device=args.device, dtype="bfloat16" if device.type == "cuda" else "float32",
                                  max_num_seqs=batch, max_num_batched_tokens=max(2048, batch * (args.k + 1)),
                                  enable_prefix_caching=False, async_scheduling=args.async_scheduling,
                                  # sizes the graphs for k + 1 rows per sequence (the proposer is swapped below)
                                  speculative_config={"method": "ngram", "num_speculative_tokens": args.k,
                                                      "disable_by_batch_size": batch},
                                  kv_cache_memory=int(1.3 * tokens * _kv_bytes_per_token(loaded.model)) + (256 << 20))
            engine = LLM.from_config(config, loaded).engine
            sched = engine.internals().scheduler
            sched.misses_before_pause = 1 << 30   # the set rate, however often it misses
            rng = random.Random(batch)
            prompts = [[2] + [rng.randrange(3, vocab) for _ in range(args.context - 1)] for _ in range(batch)]
            sched.proposer = None
            _decode(engine, prompts[:1], 8)   # warm-up
            want, base_s, base_steps, _ = _decode(engine, prompts, args.new_tokens)
            base = batch * args.new_tokens / base_s
            row = {"shape": name, "batch": batch, "async": engine.info.async_scheduling, "base_tok_s": round(base, 1),
                   "base_step_ms": round(1e3 * base_s / base_steps, 3), "by_acceptance": {}}
            for a in rates:
                sched.proposer = ReplayDrafts(args.k, {tuple(p): w for p, w in zip(prompts, want)}, a, vocab)
                before = engine.snapshot().spec
                got, spec_s, steps, in_launch = _decode(engine, prompts, args.new_tokens)
                after = engine.snapshot().spec
                drafted, accepted = after.drafted - before.drafted, after.accepted - before.accepted
                row["by_acceptance"][str(a)] = {
                    "tok_s": round(batch * args.new_tokens / spec_s, 1),
                    "speedup": round(base_s / spec_s, 3),
                    # accepted / drafted, as /metrics has it: drafts after a miss count, so below a
                    "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
                    "tokens_per_step": round(args.new_tokens / steps, 3),   # per sequence and forward
                    "step_ms": round(1e3 * spec_s / steps, 3),              # per forward, host work included
                    "launch_ms": round(1e3 * in_launch / steps, 3),          # of which the runner's launch
                    "same_tokens": got == want}
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
            out.write_text(json.dumps(result, indent=1))
            del engine
            gc.collect()   # the engine's KV cache sits in reference cycles: free it before the next one
            if device.type == "cuda":
                torch.cuda.empty_cache()
        del loaded
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
