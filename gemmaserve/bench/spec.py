"""`gemmaserve bench spec`: speculative decoding with prompt lookup on an input-grounded workload
(spec_texts.py), against our own decoding without it and against llama.cpp's prompt-lookup decoding
(llama-cpp-python's `LlamaPromptLookupDecoding`) on the same GGUF file, in the same run.

Each task: one greedy completion of `--new-tokens` tokens at batch 1, timed from submission to the
last token (prompt processing included, the same on every side), median of `--repeats` runs after a
warm-up, the four engines alternating so that the machine's drift falls on all alike. Ours must give the
same tokens with and without speculation (checked; the run fails otherwise). Batch rows run the first B
prompts of two workloads together, the tasks and free text (ours only: llama-cpp-python's prompt lookup is
single-sequence), without drafts, with the default `disable_by_batch_size` rule and with drafts at any batch
size: the largest batch where drafting still pays on both is what the rule's default is chosen from.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import torch

from ..config.options import from_namespace, positive_int
from .decode import _llama_reference, _machine, _parse_batch_sizes
from .spec_texts import FREE_TEXT, PROMPTS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-speculative-tokens", type=positive_int, default=4, help="drafted tokens per step")
    parser.add_argument("--lookup-max", type=positive_int, default=4, help="longest n-gram looked up")
    parser.add_argument("--lookup-min", type=positive_int, default=2, help="shortest n-gram looked up")
    parser.add_argument("--new-tokens", type=positive_int, default=128, help="tokens generated per task")
    parser.add_argument("--repeats", type=positive_int, default=3, help="timed runs per figure (median)")
    parser.add_argument("--batch-sizes", default="1,2,3,4,8",
                        help="ours at these batch sizes, the first B prompts of each workload together "
                             "(default: 1,2,3,4,8)")
    parser.add_argument("--no-llama-cpp", action="store_true", help="skip llama.cpp")
    parser.add_argument("--tasks", default="all", help="comma-separated task names of spec_texts.py, or all "
                        "(none: only the batch rows)")
    parser.add_argument("--out", default="bench-out/spec.json", help="JSON output path")


def _timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def _ours(llm, prompts: list[str], new_tokens: int):
    from ..engine.sampling_params import SamplingParams

    outs = llm.generate(prompts, SamplingParams(max_tokens=new_tokens, temperature=0.0))
    return [o.outputs[0].token_ids for o in outs]


def _llama(model, prompt: str, new_tokens: int) -> int:
    model.reset()
    out = model.create_completion(prompt, max_tokens=new_tokens, temperature=0.0, top_k=1)
    return out["usage"]["completion_tokens"]


def _tasks(text: str) -> dict[str, str]:
    from ..errors import UserInputError

    if text == "all":
        return dict(PROMPTS)
    names = [t for t in text.split(",") if t.strip() and t != "none"]
    unknown = [t for t in names if t not in PROMPTS]
    if unknown:
        raise UserInputError(f"--tasks: unknown {', '.join(unknown)} (known: {', '.join(PROMPTS)})")
    return {t: PROMPTS[t] for t in names}


def run(args: argparse.Namespace) -> int:
    from ..config.engine import EngineConfig
    from ..config.speculative import SpeculativeConfig
    from ..engine.llm import LLM

    sizes = _parse_batch_sizes(args.batch_sizes)
    spec_config = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
                                           "prompt_lookup_max": args.lookup_max,
                                           "prompt_lookup_min": args.lookup_min})
    config = from_namespace(EngineConfig, args).steady_state()
    plain = LLM.from_config(config.replace(speculative_config=None))
    spec = LLM.from_config(config.replace(speculative_config=spec_config), plain)
    engine = plain.engine
    result: dict = {
        "benchmark": "spec", "date": date.today().isoformat(), "machine": _machine(engine.info.device),
        "model": config.model, "weights": engine.info.weights, "cpu_compile": engine.info.cpu_compile,
        "speculative": spec.engine.info.speculative, "new_tokens": args.new_tokens, "repeats": args.repeats,
        "torch_threads": torch.get_num_threads(), "tasks": [], "batches": [],
    }
    llama = lookup = None
    if not args.no_llama_cpp and torch.device(engine.info.device).type == "cpu":
        ref = _llama_reference(engine, result)
        if ref is not None:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            n_ctx = 4096
            llama = ref._model(n_ctx)
            lookup = ref._lib.Llama(model_path=str(ref.path), n_ctx=n_ctx, n_batch=512, n_threads=ref.threads,
                                    n_threads_batch=ref.threads, verbose=False,
                                    draft_model=LlamaPromptLookupDecoding(max_ngram_size=args.lookup_max,
                                                                          num_pred_tokens=args.num_speculative_tokens))
    failed = []
    for name, prompt in _tasks(args.tasks).items():
        fns = {"ours": lambda: _ours(plain, [prompt], args.new_tokens),
               "ours_spec": lambda: _ours(spec, [prompt], args.new_tokens)}
        if llama is not None:
            fns["llama_cpp"] = lambda: _llama(llama, prompt, args.new_tokens)
            fns["llama_cpp_lookup"] = lambda: _llama(lookup, prompt, args.new_tokens)
        outs = {k: fn() for k, fn in fns.items()}   # warm-up (and the outputs compared)
        stats = spec.engine.snapshot().spec
        drafted, accepted, steps = stats.drafted, stats.accepted, stats.steps
        times: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(args.repeats):
            for k, fn in fns.items():
                times[k].append(_timed(fn)[0])
        tokens = {k: (len(v[0]) if k.startswith("ours") else v) for k, v in outs.items()}
        row = {"task": name, "same_tokens": outs["ours"] == outs["ours_spec"]}
        if not row["same_tokens"]:
            failed.append(name)
        for k in fns:
            row[f"{k}_tokens"] = tokens[k]
            row[f"{k}_tok_s"] = round(tokens[k] / statistics.median(times[k]), 2)
        st = spec.engine.snapshot().spec
        row["acceptance_rate"] = round((st.accepted - accepted) / max(1, st.drafted - drafted), 3)
        row["mean_accepted_length"] = round(1 + (st.accepted - accepted) / max(1, st.steps - steps), 2)
        row["spec_over_ours"] = round(row["ours_spec_tok_s"] / row["ours_tok_s"], 3)
        if llama is not None:
            row["spec_over_llama_cpp"] = round(row["ours_spec_tok_s"] / row["llama_cpp_tok_s"], 3)
            row["spec_over_llama_cpp_lookup"] = round(row["ours_spec_tok_s"] / row["llama_cpp_lookup_tok_s"], 3)
        result["tasks"].append(row)
        print(json.dumps(row), flush=True)
    for key in ("spec_over_ours", "spec_over_llama_cpp", "spec_over_llama_cpp_lookup"):
        ratios = [r[key] for r in result["tasks"] if key in r]
        if ratios:   # the geometric mean over tasks
            result[f"{key}_geomean"] = round(float(torch.tensor(ratios).log().mean().exp()), 3)
    # Batches: without speculation, with the default rule (disable_by_batch_size), and with drafts at any
    # batch size (what the rule is chosen from: the largest batch where drafting still pays).
    forced = LLM.from_config(config.replace(speculative_config=dataclasses.replace(spec_config,
                                                                                    disable_by_batch_size=1 << 20)),
                             plain)
    for workload, names, b in [(w, n, b) for w, n in (("grounded", list(PROMPTS.values())), ("free", FREE_TEXT))
                               for b in sizes]:
        batch = [names[i % len(names)] for i in range(b)]
        fns = {"ours": lambda: _ours(plain, batch, args.new_tokens),
               "ours_spec": lambda: _ours(spec, batch, args.new_tokens),
               "ours_spec_forced": lambda: _ours(forced, batch, args.new_tokens)}
        outs = {k: fn() for k, fn in fns.items()}
        times: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(args.repeats):
            for k, fn in fns.items():
                times[k].append(_timed(fn)[0])
        n = sum(map(len, outs["ours"]))
        row = {"workload": workload, "batch": b,
               "same_tokens": outs["ours"] == outs["ours_spec"] == outs["ours_spec_forced"]}
        for k in fns:
            row[f"{k}_tok_s"] = round(n / statistics.median(times[k]), 2)
        row["spec_over_ours"] = round(row["ours_spec_tok_s"] / row["ours_tok_s"], 3)
        row["forced_over_ours"] = round(row["ours_spec_forced_tok_s"] / row["ours_tok_s"], 3)
        if not row["same_tokens"]:
            failed.append(f"{workload} batch {b}")
        result["batches"].append(row)
        print(json.dumps(row), flush=True)
    for workload in ("grounded", "free"):   # the largest batch up to which drafting paid at every size
        rows = [r for r in result["batches"] if r["workload"] == workload]
        losing = [r["batch"] for r in rows if r["forced_over_ours"] <= 1.0]
        result[f"drafting_pays_up_to_batch_{workload}"] = max(
            [r["batch"] for r in rows if r["batch"] < min(losing, default=1 << 30)], default=0)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result["failed"] = failed
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}; speculative over ours (geomean): {result.get('spec_over_ours_geomean')}, over llama.cpp: "
          f"{result.get('spec_over_llama_cpp_geomean')}, over llama.cpp prompt lookup: "
          f"{result.get('spec_over_llama_cpp_lookup_geomean')}", file=sys.stderr)
    if failed:
        print(f"speculation changed the tokens of: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0

