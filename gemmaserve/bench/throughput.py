"""`gemmaserve bench throughput`: offline throughput on a batch of prompts of mixed lengths.

Runs, in one process, on the same weights and prompts (each completion exactly `--new-tokens` long):
* gemmaserve `LLM.generate` with the engine options given;
* the same with `--kv-cache-memory` capped to `--tight-fraction` of what the workload needs, so the
  scheduler has to preempt (counts reported);
* Hugging Face `generate` prompt by prompt, and padded-batched (left padding, batches of
  `--hf-batch`).
Output tokens/s = completions x new tokens / wall time (prefill included on every side).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from datetime import date
from pathlib import Path

import torch

from ..config.options import from_namespace, positive_int
from .decode import _float_model, _llama_reference, _machine

WORDS = ("river valley farmer mill grain town market bridge winter harvest storm lantern road merchant "
         "story castle forest letter journey village evening morning mountain sea ship harbour").split()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompts", type=positive_int, default=64, help="number of prompts")
    parser.add_argument("--min-words", type=positive_int, default=8, help="shortest prompt, in words")
    parser.add_argument("--max-words", type=positive_int, default=400, help="longest prompt, in words")
    parser.add_argument("--new-tokens", type=positive_int, default=32, help="tokens generated per prompt")
    parser.add_argument("--tight-fraction", type=float, default=0.25,
                        help="KV budget of the preemption run, as a fraction of the whole workload's KV")
    parser.add_argument("--hf-batch", type=positive_int, default=16, help="batch size of HF's padded run")
    parser.add_argument("--no-hf", action="store_true", help="skip the Hugging Face runs")
    parser.add_argument("--no-llama-cpp", action="store_true",
                        help="skip the llama.cpp reference (taken when llama-cpp-python is installed and the "
                             "model is a GGUF file: same file, batches of --hf-batch sequences)")
    parser.add_argument("--out", default="bench-out/throughput.json", help="JSON output path")


def workload(n: int, min_words: int, max_words: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words))) + ". Then"
            for _ in range(n)]


def _ours(llm, prompts, params) -> dict:
    pre = llm.engine.snapshot().preemptions
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"seconds": round(wall, 2), "output_tokens": tokens, "tok_s": round(tokens / wall, 2),
            "preemptions": llm.engine.snapshot().preemptions - pre}


def _hf(hf, prompt_ids: list[list[int]], new_tokens: int, batch: int) -> dict:
    start = time.perf_counter()
    tokens = 0
    for i in range(0, len(prompt_ids), batch):
        chunk = prompt_ids[i:i + batch]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk], device=hf.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=hf.device)
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              do_sample=False, pad_token_id=0)
        tokens += (out.shape[1] - width) * len(chunk)
    wall = time.perf_counter() - start
    return {"seconds": round(wall, 2), "output_tokens": tokens, "tok_s": round(tokens / wall, 2), "batch": batch}


def run(args: argparse.Namespace) -> int:
    from ..config.engine import EngineConfig
    from ..engine.llm import LLM
    from ..engine.sampling_params import SamplingParams
    from ..errors import UserInputError

    if args.min_words > args.max_words:
        raise UserInputError("--min-words must not exceed --max-words")
    if not 0 < args.tight_fraction < 1:
        raise UserInputError("--tight-fraction must be in (0, 1)")
    config = from_namespace(EngineConfig, args).replace(serving=True).steady_state()   # a server's steady state
    llm = LLM.from_config(config)
    prompts = workload(args.prompts, args.min_words, args.max_words)
    params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)
    prompt_ids = [llm.tokenizer.encode(p) for p in prompts]
    lens = [len(p) for p in prompt_ids]
    llm.generate(prompts[:2], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    result = {"benchmark": "throughput", "date": date.today().isoformat(), "machine": _machine(llm.engine.info.device),
              "model": config.model, "dtype": llm.engine.info.dtype, "weights": llm.engine.info.weights,
              "kv_cache_dtype": llm.engine.info.kv_cache_dtype, "prompts": len(prompts),
              "prompt_tokens": {"min": min(lens), "max": max(lens), "total": sum(lens)},
              "new_tokens": args.new_tokens, "engine": config.recorded(), "runs": {}}
    no_cache = config.replace(enable_prefix_caching=False) if llm.engine.info.prefix_caching else config
    cold = LLM.from_config(no_cache, llm)   # distinct prompts: caching would only help the repeats below
    result["cpu_compile"] = cold.engine.info.cpu_compile
    result["runs"]["gemmaserve"] = _ours(cold, prompts, params)
    kv = cold.engine.internals().kv
    need = sum(kv.peak_pages(n + args.new_tokens, config.max_num_batched_tokens) for n in lens) * kv.page_bytes
    tight_bytes = int(need * args.tight_fraction)
    tight = LLM.from_config(no_cache.replace(kv_cache_memory=tight_bytes), llm)
    result["runs"]["gemmaserve_tight"] = {**_ours(tight, prompts, params), "kv_cache_bytes": tight_bytes,
                                          "kv_fraction_of_need": args.tight_fraction}
    if not args.no_hf:
        from ..testing.hf_reference import build_hf_model

        parts = llm.engine.internals()
        hf = build_hf_model(_float_model(llm.engine), dtype=parts.dtype, device=parts.device)
        hf.generate(torch.tensor([prompt_ids[0]]), max_new_tokens=2, do_sample=False, pad_token_id=0)  # warm-up
        result["runs"]["hf_one_by_one"] = _hf(hf, prompt_ids, args.new_tokens, 1)
        result["runs"]["hf_padded_batch"] = _hf(hf, prompt_ids, args.new_tokens, args.hf_batch)
    llama = None if args.no_llama_cpp or torch.device(llm.engine.info.device).type != "cpu" else _llama_reference(llm.engine, result)
    if llama is not None:
        result["runs"]["llama_cpp_batched"] = llama.generate_batched(prompt_ids, args.new_tokens, args.hf_batch)
    ours = result["runs"]["gemmaserve"]["tok_s"]
    result["ratios"] = {name: round(ours / r["tok_s"], 2) for name, r in result["runs"].items()
                        if name.startswith(("hf", "llama"))}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"offline throughput, {config.model} ({result['dtype']}) on {result['machine']}: {len(prompts)} prompts of "
          f"{min(lens)}-{max(lens)} tokens, {args.new_tokens} new tokens each")
    print(f"{'run':<20} {'seconds':>8} {'out tok/s':>10} {'preemptions':>12}")
    for name, r in result["runs"].items():
        print(f"{name:<20} {r['seconds']:>8} {r['tok_s']:>10} {r.get('preemptions', ''):>12}")
    if "ratios" in result:
        print("gemmaserve / reference: " + ", ".join(f"{k} {v}x" for k, v in result["ratios"].items()))
    print(f"wrote {out}")
    return 0
