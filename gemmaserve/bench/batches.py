"""`gemmaserve bench batches`: does a prompt give the same bits alone and in any batch, on every CPU step path?

The embedded 270M on its default path (quantised GGUF weights), 16 prompts of different lengths, each with
its own token budget (a batch's requests finish at different steps), prefills chunked beside other requests'
decode rows. Each prompt is run alone on eager steps (the reference), then batches of 1, 5, 7, 8, 13 and 16
run on every path a user can get, and each prompt's tokens and logprobs (with the top alternatives) must be
the reference's to the last bit:

    eager          --cpu-compile off
    enforce-eager  --enforce-eager (with --cpu-compile on: eager wins)
    switch         --cpu-compile auto with no packages in the cache: a background build, batches running
                   meanwhile until one of them spans the switch from eager to compiled steps
    compiled       --cpu-compile on (the packages the switch built, loaded)
    process        a fresh process per path (eager, compiled): other threads, allocations, library loads

Exit status 1 if any prompt differs anywhere. tests/test_embedded_batches.py runs the eager paths in CI; the
compiled ones need the packages built (minutes on 2 cores), so their CI check is on a small model
(tests/test_aot_decode.py) and this command runs them on the real one. Writes $OUT/batches.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

PROMPTS = (
    "Once upon a time",
    "The capital of France is",
    "def fibonacci(n):",
    "In 1492, Columbus",
    "The quick brown fox",
    "Water boils at",
    "My favourite food is",
    "Q: What is 2+2?\nA:",
    "The history of the river valley begins with the first farmers who settled on its banks, " * 4,
    "import numpy as np\nimport torch\n\nclass Model:",
    "Dear Sir or Madam,",
    "The mitochondria is",
    "1, 2, 3, 4, 5,",
    "Roses are red, violets are blue,",
    "Translate to French: good morning ->",
    "The results of the experiment, which ran for three weeks in the laboratory, showed that " * 2,
)
# tokens per prompt: the requests of one batch finish at different steps
MAX_TOKENS = tuple(4 + (7 * i) % 17 for i in range(len(PROMPTS)))
# batch size -> which prompts, in which order
BATCHES = {1: (11,), 5: (3, 8, 0, 15, 6), 7: (15, 14, 13, 12, 11, 10, 9), 8: (8, 1, 9, 2, 10, 3, 11, 4),
           13: (12, 0, 5, 8, 1, 15, 3, 7, 10, 2, 14, 6, 4), 16: tuple(range(15, -1, -1))}
CHUNK = 64   # prefill tokens per step: long prompts prefill in chunks beside decode rows

Bits = list   # [token ids, [[token id, logprob hex, [[alternative, logprob hex], ...]], ...]] (JSON-ready)


def params(i: int):
    from ..engine.sampling_params import SamplingParams

    return SamplingParams(max_tokens=MAX_TOKENS[i], temperature=0, logprobs=2, ignore_eos=True)


def bits(completion) -> Bits:
    """A completion's tokens and logprobs, floats as exact hex."""
    return [list(completion.token_ids),
            [[lp.token_id, float(lp.logprob).hex(), [[t, float(v).hex()] for t, v in lp.top]]
             for lp in completion.logprobs]]


def run_batch(llm, indices) -> list[Bits]:
    """The prompts `indices` in one batch: each one's bits, in order (the KV cache checked after)."""
    outs = llm.generate([PROMPTS[i] for i in indices], [params(i) for i in indices], use_tqdm=False)
    llm.engine.check_integrity()
    return [bits(o.outputs[0]) for o in outs]


def alone(llm) -> list[Bits]:
    return [run_batch(llm, [i])[0] for i in range(len(PROMPTS))]


def differing(reference: list[Bits], llm, sizes=tuple(BATCHES)) -> dict[str, list[int]]:
    """Batch size -> the prompts whose bits differ from `reference` in that batch."""
    out = {}
    for n in sizes:
        got = run_batch(llm, BATCHES[n])
        out[str(n)] = [i for i, g in zip(BATCHES[n], got) if g != reference[i]]
    return out


def _switch(llm, reference: list[Bits], deadline_s: float) -> dict:
    """Batches on an engine building its packages in the background, until one spans the switch."""
    engine = llm.engine
    rounds, spanning = [], None
    start = time.monotonic()
    sizes = list(BATCHES)
    while spanning is None and engine.info.cpu_compile == "building":
        if time.monotonic() - start > deadline_s:
            return {"error": f"no switch within {deadline_s:.0f} s", "rounds": rounds}
        n = sizes[len(rounds) % len(sizes)]
        ids = [engine.add_request(PROMPTS[i], params(i)) for i in BATCHES[n]]
        before, outs = engine.info.cpu_compile, {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    outs[o.request_id] = bits(o.outputs[0])
        if before == "building" and engine.info.cpu_compile == "ready":
            spanning = n
        rounds.append({"batch": n, "spanned_switch": spanning == n,
                       "differ": [i for rid, i in zip(ids, BATCHES[n]) if outs[rid] != reference[i]]})
    return {"rounds": rounds, "switched_in_batch": spanning, "state": engine.info.cpu_compile}


_CHILD = """
import json, sys
from gemmaserve import LLM
from gemmaserve.bench import batches
llm = LLM(max_num_seqs=16, max_num_batched_tokens=batches.CHUNK, cpu_compile={mode!r})
reference = json.loads(sys.stdin.read())
differ = batches.differing(reference, llm, {sizes!r})
print(json.dumps({{"cpu_compile": llm.engine.info.cpu_compile, "differ": differ}}))
"""


def in_process(mode: str, reference: list[Bits], sizes=tuple(BATCHES)) -> dict:
    """A fresh Python process's batches (of `sizes`) on `--cpu-compile mode`."""
    script = _CHILD.format(mode=mode, sizes=tuple(sizes))
    done = subprocess.run([sys.executable, "-c", script], input=json.dumps(reference), capture_output=True, text=True,
                          timeout=1800)
    if done.returncode:
        return {"error": done.stderr[-2000:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--paths", default="eager,enforce-eager,switch,compiled,process",
                        help="which step paths to check (default: all)")
    parser.add_argument("--switch-deadline", type=float, default=1800,
                        help="seconds to wait for the background build of the switch path")
    parser.add_argument("--out", default=None, help="JSON output path (default: $OUT/batches.json)")


def run(args: argparse.Namespace) -> int:
    import torch

    from ..engine.llm import LLM

    paths = [p for p in args.paths.split(",") if p]
    started = time.time()
    base = LLM(max_num_seqs=16, max_num_batched_tokens=CHUNK, cpu_compile="off")
    reference = alone(base)
    result: dict = {"benchmark": "batches", "date": time.strftime("%Y-%m-%d"),
                    "machine": platform.processor() or platform.machine(), "cpu_flags": _flags(),
                    "torch": torch.__version__, "weights": base.engine.info.weights, "paths": {}}
    config = base.engine.config
    if "eager" in paths:
        result["paths"]["eager"] = {"differ": differing(reference, base)}
    if "enforce-eager" in paths:
        forced = LLM.from_config(config.replace(enforce_eager=True, cpu_compile="on"), base)
        result["paths"]["enforce-eager"] = {"cpu_compile": forced.engine.info.cpu_compile,
                                            "differ": differing(reference, forced)}
        del forced
    if "switch" in paths:
        store = base.engine.internals().compiled_steps.store()   # (the same KV layout: the same packages)
        if store is not None:   # no packages: the engine builds them in the background
            shutil.rmtree(store, ignore_errors=True)
        switching = LLM.from_config(config.replace(cpu_compile="auto"), base)
        result["paths"]["switch"] = _switch(switching, reference, args.switch_deadline)
        if switching.engine.info.cpu_compile == "ready":
            result["paths"]["switch"]["after"] = differing(reference, switching)
        del switching
    if "compiled" in paths:
        compiled = LLM.from_config(config.replace(cpu_compile="on"), base)
        result["paths"]["compiled"] = {"cpu_compile": compiled.engine.info.cpu_compile,
                                       "differ": differing(reference, compiled)}
        del compiled
    if "process" in paths:
        result["paths"]["process"] = {mode: in_process(mode, reference) for mode in ("off", "on")}
    result["seconds"] = round(time.time() - started)
    bad = _failures(result["paths"])
    result["ok"] = not bad
    out = Path(args.out) if args.out else Path(os.environ.get("OUT", "bench-out")) / "batches.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    for line in bad:
        print("DIFFERS", line)
    print(json.dumps({k: v for k, v in result.items() if k != "paths"}))
    print("every prompt gave its bits alone in every batch and path" if not bad else f"{len(bad)} failure(s)")
    return 0 if not bad else 1


# the state each path's steps must be in (a path that silently stayed eager proves nothing)
EXPECTED_STATE = {"eager": None, "enforce-eager": "off", "compiled": "ready", "off": None, "on": "ready"}


def _failures(paths: dict, prefix: str = "") -> list[str]:
    """Every path, batch and prompt that differed, and every path that did not run as it should."""
    bad = []
    for name, node in paths.items():
        where = f"{prefix}{name}"
        if name == "process":
            bad += _failures(node, "process ")
            continue
        if "error" in node:
            bad.append(f"{where}: {node['error'][-300:]}")
        for key in ("differ", "after"):
            bad += [f"{where} batch {n}: prompts {p}" for n, p in node.get(key, {}).items() if p]
        bad += [f"{where} batch {r['batch']}: prompts {r['differ']}" for r in node.get("rounds", []) if r["differ"]]
        want = EXPECTED_STATE.get(name)
        if want is not None and node.get("cpu_compile") != want:
            bad.append(f"{where}: steps were {node.get('cpu_compile')}, expected {want}")
        if name == "switch" and "error" not in node and node.get("switched_in_batch") is None:
            bad.append(f"{where}: no batch spanned the switch")
    return bad


def _flags() -> list[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return sorted(f for f in line.split() if f in ("avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16",
                                                    "amx_tile", "amx_int8", "amx_bf16"))
