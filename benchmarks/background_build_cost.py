"""What the background build of compiled decode steps costs the engine's own decoding while both run
(`python -m benchmarks.background_build_cost [--windows 6] [--batch-sizes 1,8]`).

An engine on an empty packages store starts the builder process (engine/aot_builder.py) and decodes eagerly
meanwhile. This times that eager decoding in windows, the builder paused (SIGSTOP: as if it were not there)
and running (SIGCONT) in turn, so both see the same machine at nearly the same time, and stops when the
build ends (the engine then switches to the packages). The quantised weights come from the user's cache
(copied links); the packages store is a fresh one. Writes $OUT/background_build_cost.json (or bench-out/).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="background_build_cost")
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--windows", type=int, default=6, help="pairs of windows (paused, running)")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args(argv)

    from gemmaserve.models.embedded import cache_dir

    user_cache = cache_dir()
    fresh = Path(tempfile.mkdtemp(prefix="gemmaserve-build-cost-"))
    for part in ("models", "quantized", "tokenizers"):   # everything but the packages
        if (user_cache / part).is_dir():
            (fresh / part).symlink_to(user_cache / part)
    os.environ["GEMMASERVE_CACHE_DIR"] = str(fresh)

    from gemmaserve.config.engine import EngineConfig
    from gemmaserve.engine.llm import LLM
    from gemmaserve.engine.sampling_params import SamplingParams

    llm = LLM.from_config(EngineConfig(model=args.model, cpu_compile="auto"))
    build = llm.engine.info.cpu_compile_build
    if build is None or build.pid is None:
        print("no background build was started (packages already there?)", file=sys.stderr)
        return 2
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    prompts = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "The boiling point of water",
               "In 1492, Columbus", "The theory of relativity", "A recipe for bread:", "My favourite city is"]
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    llm.generate(prompts[:1], params, use_tqdm=False)   # warm-up
    rows: dict[str, list[float]] = {}
    finished_early = False
    try:
        for _ in range(args.windows):
            for state, sig in (("paused", signal.SIGSTOP), ("running", signal.SIGCONT)):
                os.kill(build.pid, sig)
                for b in sizes:
                    t = time.perf_counter()
                    llm.generate(prompts[:b], params, use_tqdm=False)
                    rows.setdefault(f"b{b}_{state}", []).append(b * args.new_tokens / (time.perf_counter() - t))
                if llm.engine.info.cpu_compile != "building":
                    finished_early = True
                    break
            if finished_early:
                break
    finally:
        try:
            os.kill(build.pid, signal.SIGCONT)
            os.kill(build.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    windows = min(len(v) for v in rows.values())
    result = {"model": args.model, "new_tokens": args.new_tokens, "windows": windows,
              "build_finished_during_run": finished_early, "date": time.strftime("%Y-%m-%d %H:%M"),
              "tok_s": {k: [round(x, 1) for x in v[:windows]] for k, v in rows.items()}}
    for b in sizes:
        paused = statistics.median(rows[f"b{b}_paused"][:windows])
        running = statistics.median(rows[f"b{b}_running"][:windows])
        result[f"b{b}"] = {"paused_tok_s": round(paused, 1), "running_tok_s": round(running, 1),
                           "cost": round(1 - running / paused, 3)}
        print(f"batch {b}: {paused:.1f} tok/s with the builder paused, {running:.1f} with it running: "
              f"{100 * (1 - running / paused):.1f}% slower", flush=True)
    out = Path(os.environ.get("OUT", "bench-out")) / "background_build_cost.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
