"""`gemmaserve bench decode`: decode tokens/s of our engine against Hugging Face `generate`, same
weights, same prompts, same run.

Decode speed = (tokens generated after the first) / (time after the first token), so prefill is left
out on both sides: for HF it is the time of generate(N) minus generate(1) on the same input.
Each figure is the median of `--repeats` runs after one warm-up.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import time
from datetime import date
from pathlib import Path

import torch

from ..config.options import from_namespace, positive_int

PROMPT = ("The old lighthouse keeper climbed the stairs every evening to light the lamp, and on the night "
          "of the storm he saw")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-sizes", default="1,8", help="comma-separated batch sizes (default: 1,8)")
    parser.add_argument("--new-tokens", type=positive_int, default=64, help="tokens generated per sequence")
    parser.add_argument("--repeats", type=positive_int, default=3, help="timed runs per figure (median)")
    parser.add_argument("--no-hf", action="store_true", help="skip the Hugging Face reference")
    parser.add_argument("--no-llama-cpp", action="store_true",
                        help="skip the llama.cpp reference (taken when llama-cpp-python is installed and the "
                             "model is a GGUF file: same file, same thread count, runs alternating with ours)")
    parser.add_argument("--prefill-tokens", type=positive_int, default=512,
                        help="prompt length of the prompt-processing row")
    parser.add_argument("--hf-gguf-load", action="store_true",
                        help="also time transformers' own GGUF loader on the same file")
    parser.add_argument("--out", default="bench-out/decode.json", help="JSON output path")


def _parse_batch_sizes(text: str) -> list[int]:
    from ..errors import UserInputError

    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserInputError(f"--batch-sizes must be comma-separated integers, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise UserInputError(f"--batch-sizes must be positive integers, got {text!r}")
    return sizes


def _ours_decode(llm, prompt_ids: list[int], batch: int, new_tokens: int) -> float:
    from ..engine.sampling_params import SamplingParams

    engine = llm.engine
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    ids = [engine.add_request("", params, prompt_ids=prompt_ids) for _ in range(batch)]
    # Prefill until every sequence has its first token, then time the rest.
    _step_to_first_tokens(engine, ids)
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return batch * (new_tokens - 1) / (time.perf_counter() - start)


def _step_to_first_tokens(engine, ids: list[str]) -> None:
    """Step `engine` until each request of `ids` (n = 1 each) has sampled its first token (or finished), as its
    outputs say."""
    left = set(ids)
    while left:
        left -= {out.request_id for out in engine.step() if out.outputs[0].delta_token_ids or out.finished}


def matmul_ms(llm, prompt_ids: list[int], batch: int, repeats: int = 10) -> float:
    """The time a decode step's matrix products take alone: the inputs every projection (and the
    output head) saw in one real decode step at `batch`, replayed through the same modules back to
    back, median of `repeats`. The step time over this is the per-step overhead (issue 13's 1.3x)."""
    from ..engine.sampling_params import SamplingParams
    from ..models.layers import Linear
    from ..models.quant import QuantLinear

    engine = llm.engine
    parts = engine.internals()
    model, runner = parts.model, parts.runner
    # Hooks see the modules' inputs only in an eager step: the compiled graph is set aside for it.
    compiled = getattr(runner, "compiled", None)
    if compiled is not None:
        runner.compiled = None
    seen: list = []
    hooks = [m.register_forward_pre_hook(lambda mod, args: seen.append((mod, args[0].clone())))
             for m in model.modules() if isinstance(m, (Linear, QuantLinear))]
    heads: list = []
    compute_logits = model.compute_logits
    model.compute_logits = lambda h: heads.append(h.clone()) or compute_logits(h)
    try:
        ids = [engine.add_request("", SamplingParams(max_tokens=3, ignore_eos=True), prompt_ids=prompt_ids)
               for _ in range(batch)]
        _step_to_first_tokens(engine, ids)
        seen.clear(), heads.clear()
        engine.step()   # one decode step: every row is one token
        calls, head_in = list(seen), heads[-1]
    finally:
        for h in hooks:
            h.remove()
        del model.compute_logits
        while engine.has_unfinished_requests():
            engine.step()
        if compiled is not None:
            runner.compiled = compiled
    times = []
    with torch.inference_mode():
        for _ in range(repeats + 1):
            start = time.perf_counter()
            for mod, x in calls:
                mod(x)
            compute_logits(head_in)
            times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) * 1e3


def _hf_decode(hf, prompt_ids: list[int], batch: int, new_tokens: int) -> float:
    inputs = torch.tensor([prompt_ids] * batch, device=hf.device)
    mask = torch.ones_like(inputs)

    def timed(n: int) -> float:
        start = time.perf_counter()
        with torch.no_grad():
            hf.generate(inputs, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                        pad_token_id=0)
        if inputs.is_cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start

    return batch * (new_tokens - 1) / max(timed(new_tokens) - timed(1), 1e-9)


def _median_of(fn, repeats: int) -> float:
    fn()  # warm-up
    return statistics.median(fn() for _ in range(repeats))


def _alternating(fns: dict, repeats: int) -> dict[str, float]:
    """Median of each after one warm-up each, the runs interleaved (a, b, a, b, ...) so that the
    machine's drift falls on both alike."""
    for fn in fns.values():
        fn()
    runs: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            runs[k].append(fn())
    return {k: statistics.median(v) for k, v in runs.items()}


def _ours_prefill(llm, prompt_ids: list[int]) -> float:
    """Prompt tokens/s of one prompt (chunked as the engine's budget says), up to its first token."""
    from ..engine.sampling_params import SamplingParams

    engine = llm.engine
    start = time.perf_counter()
    engine.add_request("", SamplingParams(max_tokens=1), prompt_ids=prompt_ids)
    while engine.has_unfinished_requests():
        engine.step()
    return len(prompt_ids) / (time.perf_counter() - start)


def run(args: argparse.Namespace) -> int:
    from ..config.engine import EngineConfig
    from ..engine.llm import LLM

    sizes = _parse_batch_sizes(args.batch_sizes)
    config = from_namespace(EngineConfig, args)
    # The steady state: compiled decode steps where auto would build them (loaded from the cache, or built
    # before the first step rather than in the background)
    start = time.perf_counter()
    llm = LLM.from_config(config.steady_state())
    engine = llm.engine
    compile_seconds = time.perf_counter() - start - engine.info.load_seconds if engine.info.cpu_compile == "ready" else 0.0
    prompt_ids = llm.tokenizer.encode(PROMPT)
    result: dict = {
        "benchmark": "decode", "date": date.today().isoformat(), "machine": _machine(engine.info.device),
        "model": config.model, "dtype": engine.info.dtype, "weights": engine.info.weights,
        "kv_cache_dtype": engine.info.kv_cache_dtype,
        "prompt_tokens": len(prompt_ids),
        "new_tokens": args.new_tokens, "repeats": args.repeats, "load_seconds": round(engine.info.load_seconds, 2),
        "cpu_compile": engine.info.cpu_compile,
        "compile_seconds": round(compile_seconds, 1),
        "torch_threads": torch.get_num_threads(), "tensor_parallel_size": config.tensor_parallel_size, "rows": [],
    }
    result["peak_rss_mb_before_references"] = _peak_rss_mb()
    hf = None
    if not args.no_hf:
        from ..testing.hf_reference import build_hf_model

        parts = engine.internals()
        hf = build_hf_model(_float_model(engine), dtype=parts.dtype, device=parts.device)
    llama = None
    if not args.no_llama_cpp and torch.device(engine.info.device).type == "cpu":
        llama = _llama_reference(engine, result)
    for b in sizes:
        fns = {"ours": lambda: _ours_decode(llm, prompt_ids, b, args.new_tokens)}
        if llama is not None:
            ctx = llama.batch_context((len(prompt_ids) + args.new_tokens) * b + 16, b)
            fns["llama_cpp"] = lambda: llama.decode_tok_s(prompt_ids, b, args.new_tokens, ctx)
        med = _alternating(fns, args.repeats)
        step_ms = b / med["ours"] * 1e3
        # The replay runs this process's modules alone: under tensor parallelism their collectives have no peers.
        mm = matmul_ms(llm, prompt_ids, b) if config.tensor_parallel_size == 1 else float("nan")
        row = {"batch": b, "ours_tok_s": round(med["ours"], 2), "step_ms": round(step_ms, 2),
               "matmuls_alone_ms": round(mm, 2), "step_over_matmuls": round(step_ms / mm, 3)}
        if llama is not None:
            row.update(llama_cpp_tok_s=round(med["llama_cpp"], 2), ratio_vs_llama_cpp=round(med["ours"] / med["llama_cpp"], 3))
        if hf is not None:
            ref = _median_of(lambda: _hf_decode(hf, prompt_ids, b, args.new_tokens), args.repeats)
            row.update(hf_tok_s=round(ref, 2), ratio_vs_hf_same_batch=round(med["ours"] / ref, 2))
        result["rows"].append(row)
    long_prompt = (prompt_ids * (args.prefill_tokens // len(prompt_ids) + 1))[:args.prefill_tokens]
    calls = itertools.count(1)

    def rotated() -> list[int]:   # a different first block every call: no prefix-cache hit
        i = next(calls) % (len(long_prompt) - 1)
        return long_prompt[:1] + long_prompt[1 + i:] + long_prompt[1:1 + i]

    fns = {"ours": lambda: _ours_prefill(llm, rotated())}
    if llama is not None:
        fns["llama_cpp"] = lambda: llama.prefill_tok_s(long_prompt, 1)
    med = _alternating(fns, args.repeats)
    result["prefill"] = {"prompt_tokens": len(long_prompt), "ours_tok_s": round(med["ours"], 1)}
    if llama is not None:
        result["prefill"].update(llama_cpp_tok_s=round(med["llama_cpp"], 1),
                                 ratio_vs_llama_cpp=round(med["ours"] / med["llama_cpp"], 3))
    if hf is not None:
        hf1 = next((r["hf_tok_s"] for r in result["rows"] if r["batch"] == 1), None)
        for row in result["rows"]:
            if hf1:
                row["ratio_vs_hf_batch1"] = round(row["ours_tok_s"] / hf1, 2)
    if args.hf_gguf_load:
        try:
            result["hf_gguf_load_seconds"] = round(_hf_gguf_load_seconds(engine), 2)
        except (ImportError, ValueError) as exc:  # e.g. accelerate missing; keep the other figures
            result["hf_gguf_load_error"] = str(exc)
    _report(result, Path(args.out))
    return 0


def _peak_rss_mb() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024


def _float_model(engine):
    """Our model with fp32 weights for building the HF reference: the engine's own, or the same file
    loaded again without quantisation when the engine keeps it quantised."""
    parts = engine.internals()
    if parts.loaded.weight_formats is None:
        return parts.model
    from ..models.loader import load_model

    return load_model(engine.config.model, torch.float32, parts.device).model


def _llama_reference(engine, result: dict):
    from ..models.loader import SourceKind, resolve_model
    from .llama_cpp_ref import LlamaCppReference

    source = resolve_model(engine.config.model)
    if source.kind is not SourceKind.GGUF:
        result["llama_cpp"] = "skipped: the model is not a GGUF file"
        return None
    ref = LlamaCppReference.open(source.path, torch.get_num_threads())
    result["llama_cpp"] = ref.version if ref else "skipped: llama-cpp-python is not installed (pip install 'gemmaserve[bench]')"
    return ref


def _hf_gguf_load_seconds(engine) -> float:
    from transformers import AutoModelForCausalLM

    from ..models.loader import resolve_model

    path = resolve_model(engine.config.model).path
    start = time.perf_counter()
    AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return time.perf_counter() - start


def _machine(device: str | torch.device) -> str:
    """The processor `device` (an engine's `info.device`, or a torch.device) names, for a report."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import os

    return f"{platform.processor() or platform.machine()} CPU, {os.cpu_count()} cores"


def _report(result: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    result["peak_rss_mb"] = _peak_rss_mb()
    out.write_text(json.dumps(result, indent=2) + "\n")
    nan = float("nan")
    print(f"decode tokens/s, {result['model']} ({result['dtype']}, weights {result['weights']}) on "
          f"{result['machine']}, {result['torch_threads']} threads"
          f"{' x %d tensor-parallel ranks' % result['tensor_parallel_size'] if result['tensor_parallel_size'] > 1 else ''}"
          f", prompt {result['prompt_tokens']} tokens, "
          f"{result['new_tokens']} new tokens, median of {result['repeats']}; llama.cpp: {result.get('llama_cpp', '-')}")
    print(f"{'batch':>5} {'ours':>10} {'llama.cpp':>10} {'ours/llama':>10} {'HF generate':>12} {'ours/HF':>8} "
          f"{'step ms':>8} {'matmuls ms':>10} {'step/mm':>8}")
    for r in result["rows"]:
        print(f"{r['batch']:>5} {r['ours_tok_s']:>10.1f} {r.get('llama_cpp_tok_s', nan):>10.1f} "
              f"{r.get('ratio_vs_llama_cpp', nan):>10.2f} {r.get('hf_tok_s', nan):>12.1f} "
              f"{r.get('ratio_vs_hf_same_batch', nan):>8.2f} {r['step_ms']:>8.2f} {r['matmuls_alone_ms']:>10.2f} "
              f"{r['step_over_matmuls']:>8.2f}")
    pf = result["prefill"]
    print(f"prompt processing ({pf['prompt_tokens']} tokens): ours {pf['ours_tok_s']:.1f} tok/s, llama.cpp "
          f"{pf.get('llama_cpp_tok_s', nan):.1f} tok/s, ratio {pf.get('ratio_vs_llama_cpp', nan):.2f}")
    print(f"load: ours {result['load_seconds']} s" +
          (f", transformers GGUF {result['hf_gguf_load_seconds']} s" if "hf_gguf_load_seconds" in result else "") +
          f"; peak RSS {result['peak_rss_mb_before_references']} MB before the references were loaded; CPU decode "
          f"steps compiled: {result['cpu_compile']}" +
          (f" ({result['compile_seconds']} s)" if result["compile_seconds"] else ""))
    print(f"wrote {out}")
