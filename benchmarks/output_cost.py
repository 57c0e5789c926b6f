"""What the output processor costs the engine thread per step
(`python -m benchmarks.output_cost [--batches 1,16,64]`).

The engine commits token ids in the scheduler and turns them into text, stop-string matches and
logprob records in the output processor (engine/output_processor.py), on the engine thread. Moving that
work off the thread pays only where the thread is what a step waits for: on CUDA with asynchronous
scheduling the processing of step N already runs while the device computes step N + 1, so it matters
only once the host's share of a step exceeds the device's. This measures the processor's own time per
step (detokenising, stop strings over the new text, `logprobs` alternatives) on this machine, for a batch
of B streams, next to the whole step, with the embedded tokenizer's real vocabulary. Writes
$OUT/output_cost.json (or bench-out/).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path


def main(argv: list[str]) -> int:
    from gemmaserve.bench.throughput import workload
    from gemmaserve.engine.llm import LLM
    from gemmaserve.engine.sampling_params import SamplingParams

    ap = argparse.ArgumentParser(prog="output_cost")
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--logprobs", type=int, default=5)
    args = ap.parse_args(argv)
    out = Path(os.environ.get("OUT", "bench-out")) / "output_cost.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    llm = LLM(model=args.model, cpu_compile="off", max_num_seqs=max(int(b) for b in args.batches.split(",")))
    engine = llm.engine
    outputs = engine.internals().outputs
    spent = [0.0]
    for name in ("process", "output"):
        method = getattr(outputs, name)

        def timed(*a, method=method, **k):
            start = time.perf_counter()
            try:
                return method(*a, **k)
            finally:
                spent[0] += time.perf_counter() - start
        setattr(outputs, name, timed)
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True, logprobs=args.logprobs,
                                stop=["never appears 1", "never appears 2"])
        for prompt in workload(batch, 20, 60, seed=batch):
            engine.add_request(prompt, params)
        steps, processor, tokens = [], [], 0
        while engine.has_unfinished_requests():
            spent[0] = 0.0
            start = time.perf_counter()
            outs = engine.step()
            steps.append(time.perf_counter() - start)
            processor.append(spent[0])
            tokens += sum(len(o.outputs[0].delta_token_ids) for o in outs)
        decode = [(s, p) for s, p in zip(steps, processor) if p > 0][1:]   # decode steps (the prefill's left out)
        row = {"batch": batch, "steps": len(decode),
               "step_ms": round(1e3 * statistics.median(s for s, _ in decode), 3),
               "processor_ms": round(1e3 * statistics.median(p for _, p in decode), 3),
               "processor_us_per_token": round(1e6 * sum(processor) / max(tokens, 1), 1)}
        row["processor_share"] = round(row["processor_ms"] / row["step_ms"], 4)
        rows.append(row)
        print(json.dumps(row), flush=True)
    out.write_text(json.dumps({"model": args.model, "logprobs": args.logprobs, "new_tokens": args.new_tokens,
                               "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
