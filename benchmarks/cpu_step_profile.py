"""Where a compiled CPU decode step's time goes (`python -m benchmarks.cpu_step_profile [--rows 1,8]`).

On the embedded 270M (its compiled packages loaded or built first), greedy generation of the input-grounded
prompts of bench/spec_texts.py: the median time of a package call (one decode step's graph) and of a whole
engine step, per batch size, then torch's profiler over 16 steps at each size: the events that take the
most time of their own (a custom op called through AOTInductor's proxy executor shows as `gemmaserve::*`;
one called through its C shim does not reach the dispatcher, so its time is the package's own).
Writes $OUT/cpu_step_profile.json (or bench-out/).
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
    import torch

    from gemmaserve.bench.spec_texts import PROMPTS
    from gemmaserve.config.engine import EngineConfig
    from gemmaserve.engine.llm import LLM
    from gemmaserve.engine.sampling_params import SamplingParams

    ap = argparse.ArgumentParser(prog="cpu_step_profile")
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--new-tokens", type=int, default=48)
    args = ap.parse_args(argv)
    out = Path(os.environ.get("OUT", "bench-out")) / "cpu_step_profile.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    llm = LLM.from_config(EngineConfig(model="gemma3-270m").steady_state())   # the packages, loaded or built
    compiled = llm.engine.internals().runner.compiled
    if compiled is None:
        print(f"no compiled decode steps here ({llm.engine.info.cpu_compile})", file=sys.stderr)
        return 1
    run, times = compiled.run, []

    def timed(ids, pos, md):
        start = time.perf_counter()
        result = run(ids, pos, md)
        times.append(time.perf_counter() - start)
        return result

    compiled.run = timed
    prompts = list(dict(PROMPTS).values())
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:1], params)   # warm-up
    report: dict = {"torch": torch.__version__, "threads": torch.get_num_threads(), "rows": {}}
    for b in [int(r) for r in args.rows.split(",")]:
        batch = (prompts * b)[:b]
        times.clear()
        start = time.perf_counter()
        llm.generate(batch, params)
        whole = time.perf_counter() - start
        package_ms = statistics.median(times) * 1e3
        short = SamplingParams(max_tokens=17, temperature=0.0, ignore_eos=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            llm.generate(batch, short)
        top = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:12]
        report["rows"][b] = {
            "package_call_ms_median": round(package_ms, 3), "decode_steps": len(times),
            "generate_s": round(whole, 3), "tokens_per_s": round(b * args.new_tokens / whole, 1),
            "profile_top_self_ms": [{"name": e.key, "calls": e.count, "self_ms": round(e.self_cpu_time_total / 1e3, 2)}
                                    for e in top]}
        print(f"batch {b}: package call {package_ms:.2f} ms median over {len(times)} steps; "
              f"{b * args.new_tokens / whole:.1f} tok/s")
        for e in top:
            print(f"   {e.key[:60]:60s} {e.count:6d} calls {e.self_cpu_time_total / 1e3:9.2f} ms")
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
