"""`gemmaserve bench decode`: decode tokens/s of our engine against Hugging Face `generate`, same
weights, same prompts, same run.

Decode speed = (tokens generated after the first) / (time after the first token), so prefill is left
out on both sides: for HF it is the time of generate(N) minus generate(1) on the same input.
Each figure is the median of `--repeats` runs after one warm-up.
"""

from __future__ import annotations

import argparse
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
    while any(not engine.request(i).output_token_ids for i in ids):
        engine.step()
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return batch * (new_tokens - 1) / (time.perf_counter() - start)


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


def run(args: argparse.Namespace) -> int:
    from ..config.engine import EngineConfig
    from ..engine.llm import LLM

    sizes = _parse_batch_sizes(args.batch_sizes)
    config = from_namespace(EngineConfig, args)
    llm = LLM.from_config(config)
    engine = llm.engine
    prompt_ids = llm.tokenizer.encode(PROMPT)
    result: dict = {
        "benchmark": "decode", "date": date.today().isoformat(), "machine": _machine(engine.device),
        "model": config.model, "dtype": engine.info.dtype, "kv_cache_dtype": engine.info.kv_cache_dtype,
        "prompt_tokens": len(prompt_ids),
        "new_tokens": args.new_tokens, "repeats": args.repeats, "load_seconds": round(engine.info.load_seconds, 2),
        "torch_threads": torch.get_num_threads(), "rows": [],
    }
    hf = None
    if not args.no_hf:
        from .hf_reference import build_hf_model

        hf = build_hf_model(engine.model, dtype=engine.dtype, device=engine.device)
    for b in sizes:
        ours = _median_of(lambda: _ours_decode(llm, prompt_ids, b, args.new_tokens), args.repeats)
        row = {"batch": b, "ours_tok_s": round(ours, 2)}
        if hf is not None:
            ref = _median_of(lambda: _hf_decode(hf, prompt_ids, b, args.new_tokens), args.repeats)
            row.update(hf_tok_s=round(ref, 2), ratio_vs_hf_same_batch=round(ours / ref, 2))
        result["rows"].append(row)
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


def _hf_gguf_load_seconds(engine) -> float:
    from transformers import AutoModelForCausalLM

    from ..models.loader import resolve_model

    path = resolve_model(engine.config.model).path
    start = time.perf_counter()
    AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return time.perf_counter() - start


def _machine(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import os

    return f"{platform.processor() or platform.machine()} CPU, {os.cpu_count()} cores"


def _report(result: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"decode tokens/s, {result['model']} ({result['dtype']}) on {result['machine']}, "
          f"prompt {result['prompt_tokens']} tokens, {result['new_tokens']} new tokens, median of {result['repeats']}")
    print(f"{'batch':>5} {'ours':>10} {'HF generate':>12} {'ours/HF':>8} {'ours/HF@1':>10}")
    for r in result["rows"]:
        print(f"{r['batch']:>5} {r['ours_tok_s']:>10.1f} {r.get('hf_tok_s', float('nan')):>12.1f} "
              f"{r.get('ratio_vs_hf_same_batch', float('nan')):>8.2f} {r.get('ratio_vs_hf_batch1', float('nan')):>10.2f}")
    print(f"load: ours {result['load_seconds']} s" +
          (f", transformers GGUF {result['hf_gguf_load_seconds']} s" if "hf_gguf_load_seconds" in result else ""))
    print(f"wrote {out}")
