"""Compiled CPU decode steps of 5-8 rows: the 8-row static graph (the batch padded up) against the dynamic one
(`python -m benchmarks.compiled_rows [--rows 5,6,7,8]`).

A batch of b rows may run the graph compiled for exactly 8 rows, padded, or the graph whose batch dimension
is dynamic. On the embedded 270M this times each way on real decode batches (greedy, the input-grounded
prompts of bench/spec_texts.py), median over a generation's steps, the two alternating. It also times the
1-row graph as the plain step's reference. A speculative verification step with k = 4 drafts is 5 rows.
Writes $OUT/compiled_rows.json (or bench-out/).
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
    from gemmaserve.bench.spec_texts import PROMPTS
    from gemmaserve.config.engine import EngineConfig
    from gemmaserve.engine.llm import LLM
    from gemmaserve.engine.sampling_params import SamplingParams

    ap = argparse.ArgumentParser(prog="compiled_rows")
    ap.add_argument("--rows", default="5,6,7,8")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)
    out = Path(os.environ.get("OUT", "bench-out")) / "compiled_rows.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    llm = LLM.from_config(EngineConfig(model="gemma3-270m").steady_state())   # the packages, loaded or built
    compiled = llm.engine.internals().runner.compiled
    if compiled is None:
        print(f"no compiled decode steps here ({llm.engine.info.cpu_compile})", file=sys.stderr)
        return 1
    run, exact = compiled.run, type(compiled)._size_for
    times: list[tuple[int, float]] = []

    def timed(ids, pos, md):
        start = time.perf_counter()
        result = run(ids, pos, md)
        times.append((len(ids), time.perf_counter() - start))
        return result

    compiled.run = timed
    prompts = list(dict(PROMPTS).values())
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:1], params)   # warm-up
    rows = {}
    for b in [int(r) for r in args.rows.split(",")]:
        ms = {"padded to 8": [], "dynamic": []}
        for _ in range(args.repeats):
            for way in ms:
                compiled._size_for = ((lambda n: 8 if n <= 8 and n * 2 > 8 else exact(compiled, n))
                                      if way == "padded to 8" else (lambda n, b=b: None if n == b else exact(compiled, n)))
                times.clear()
                llm.generate([prompts[i % len(prompts)] for i in range(b)], params)
                ms[way] += [1e3 * t for n, t in times if n == b]
        rows[b] = {way: round(statistics.median(v), 2) for way, v in ms.items()}
        print(json.dumps({"rows": b, **rows[b]}), flush=True)
    compiled._size_for = lambda n: exact(compiled, n)
    times.clear()
    llm.generate(prompts[:1], params)
    one = round(statistics.median(1e3 * t for n, t in times if n == 1), 2)
    print(json.dumps({"rows": 1, "static": one}), flush=True)
    out.write_text(json.dumps({"model": "gemma3-270m", "one_row_ms": one, "rows_ms": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
