"""`gemmaserve bench quality`: what keeping a GGUF's weights quantised costs in accuracy, on the CPU.

Three models over the same file: ours with every weight expanded to fp32 (the reference), ours with the
quantised weights (`--dtype auto`), and llama.cpp on the same file when `llama-cpp-python` is installed; with
`--gpu-formats`, also the fp32 model's projections in the GPU's weight formats, W4A16 (int4 groups of 32 and 128,
rounded to nearest) and FP8 (per channel, activations per token), scored on the same passages.
Ours decodes the greedy prompts as one batch, and (compiled) one at a time as llama.cpp does.
Figures: perplexity over fixed passages (`quality_texts.py`; teacher-forced, each passage from its
start; ours through the real paged path, `testing/scoring.py`; the quantised model in prefill chunks, one
token at a time and in 8-row chunks, since each runs different kernels), the KL divergence of each from our
fp32 path's next-token distribution there, the per-token difference of our negative log-likelihood from
llama.cpp's with its standard error (whether a perplexity gap is more than the text's noise), and greedy
agreement with the fp32 reference over fixed completion prompts: tokens until the first divergence,
and the reference's top-2 logit margin at that step (a divergence where the reference itself barely
decided is rounding, one at a clear margin is a defect).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from datetime import date
from pathlib import Path

import torch

from ..config.options import positive_int

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="gemma3-270m", help="GGUF file or alias (default: the embedded 270M)")
    parser.add_argument("--new-tokens", type=positive_int, default=64, help="greedy tokens per prompt")
    parser.add_argument("--threads", type=positive_int, default=None, help="llama.cpp threads (default: torch's)")
    parser.add_argument("--gpu-formats", choices=("on", "off", "only"), default="off",
                        help="also score the fp32 model with its projections in the GPU's formats (W4A16 groups of "
                             "32 and 128, FP8 per channel, through their CPU references: slow, so off by default); "
                             "only = those and the fp32 reference alone (minutes)")
    parser.add_argument("--out", default="bench-out/quality.json", help="JSON output path")


def _greedy(llm, prompts: list[list[int]], n: int) -> list[list[int]]:
    from ..engine.sampling_params import SamplingParams

    eng = llm.engine
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    ids = [eng.add_request("", params, prompt_ids=p) for p in prompts]
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    return [done[i] for i in ids]


def _gpu_schemes(model: str) -> dict[str, torch.nn.Module]:
    """The fp32 model with its attention and MLP projections in the GPU's weight formats (quantization/schemes.py),
    run through their CPU references: W4A16 int4 groups of 32 and of 128 rounded to nearest (no calibration: an
    upper bound on what a GPTQ/AWQ/QAT checkpoint loses), and FP8 per channel with per-token activations, as
    `--quantization fp8` makes it."""
    from ..models.loader import load_model
    from ..models.quantized import quantize_projections
    from ..quantization.compressed_tensors import ModuleQuant
    from ..quantization.schemes import Scheme, quantize_fp8_per_channel, quantize_int4_groups

    schemes = {"w4a16_g32_rtn": (ModuleQuant(Scheme.W4A16, group=32), lambda _, w: quantize_int4_groups(w, 32)),
               "w4a16_g128_rtn": (ModuleQuant(Scheme.W4A16, group=128), lambda _, w: quantize_int4_groups(w, 128)),
               "fp8_channel": (ModuleQuant(Scheme.FP8), lambda _, w: quantize_fp8_per_channel(w))}
    out = {}
    for name, (quant, quantize) in schemes.items():
        loaded = load_model(model, torch.float32, torch.device("cpu"))
        quantize_projections(loaded.model, quant, quantize)
        out[name] = loaded.model
    return out


def run(args: argparse.Namespace) -> int:
    from ..config.engine import EngineConfig
    from ..engine.compile.compiled_decode import unavailable
    from ..engine.llm import LLM
    from ..models.loader import load_model, resolve_model
    from ..testing.scoring import Scorer, Scores, first_divergence, greedy_totals, paired_nll_difference
    from .llama_cpp_ref import LlamaCppReference
    from .quality_texts import load as load_texts

    from ..errors import UserInputError
    from ..models.loader import SourceKind

    if resolve_model(args.model).kind is not SourceKind.GGUF:
        raise UserInputError(f"bench quality measures a GGUF file's quantised weights; {args.model!r} is not one")
    cpu = torch.device("cpu")
    ref = load_model(args.model, torch.float32, cpu)
    quant = load_model(args.model, torch.float32, cpu, quantized=True)
    tok = ref.tokenizer
    fixed = load_texts()
    texts = [tok.encode(t) for t in fixed.passages]
    longest = max(len(t) for t in texts)
    result: dict = {"benchmark": "quality", "date": date.today().isoformat(), "model": args.model,
                    "weights": quant.weight_formats, "passages": len(texts),
                    "text_tokens": [len(t) for t in texts], "new_tokens": args.new_tokens}
    # Prefill kernels (256-row chunks), decode kernels (one row at a time, as batch-1 decode runs) and
    # decode batches' kernels (8 rows at a time); each scorer (and the compiled step) serves every passage
    reference = Scorer(ref.model, longest)
    only = args.gpu_formats == "only"
    scorers = {} if only else {"ours_quantized": Scorer(quant.model, longest),
                               "ours_quantized_decode": Scorer(quant.model, longest, chunk=1),
                               "ours_quantized_8_rows": Scorer(quant.model, longest, chunk=8)}
    if args.gpu_formats != "off":   # what the GPU's formats cost, on the same text
        for name, model in _gpu_schemes(args.model).items():
            scorers[name] = Scorer(model, longest)
    if unavailable() is None and not only:   # the compiled decode step (what the engine runs once compiled)
        scorers["ours_quantized_decode_compiled"] = Scorer(quant.model, longest, chunk=1, compiled=True,
                                                           kv_manager="v2")
    llama = None if only else LlamaCppReference.open(resolve_model(args.model).path,
                                                      args.threads or torch.get_num_threads())
    result["llama_cpp"] = llama.version if llama else "not installed (pip install llama-cpp-python)"
    parts: dict[str, list] = {"ours_fp32": [], **{k: [] for k in scorers}, **({"llama_cpp": []} if llama else {})}
    for ids in texts:   # one passage's full fp32 distributions at a time (~0.6 GB each)
        s_ref = reference.score(ids, keep_logprobs=True)
        parts["ours_fp32"].append(dataclasses.replace(s_ref, full_logprobs=None))
        for name, scorer in scorers.items():
            parts[name].append(scorer.score(ids, reference=s_ref))
        if llama:
            parts["llama_cpp"].append(llama.score(ids, reference=s_ref))
    engines = {k: Scores.cat(v) for k, v in parts.items()}
    s_ref = engines["ours_fp32"]
    result["perplexity"] = {k: round(v.perplexity, 4) for k, v in engines.items()}
    result["kl_from_fp32"] = {k: round(v.mean_kl, 5) for k, v in engines.items() if v.mean_kl is not None}
    result["text_argmax_agreement_vs_fp32"] = {k: round(float((v.argmax == s_ref.argmax).float().mean()), 4)
                                               for k, v in engines.items() if k != "ours_fp32"}
    result["perplexity_by_passage"] = {k: [round(p.perplexity, 3) for p in v] for k, v in parts.items()}
    result["kl_by_passage"] = {k: [round(p.mean_kl, 5) for p in v] for k, v in parts.items()
                               if v[0].kl is not None}
    if llama:
        # Per token, ours minus llama.cpp's negative log-likelihood: mean = log of the perplexities' ratio
        result["nll_difference_vs_llama_cpp"] = {
            k: dict(zip(("mean", "standard_error"), (round(x, 5) for x in paired_nll_difference(v, engines["llama_cpp"]))))
            for k, v in engines.items() if k != "llama_cpp"}
    if only:
        return _write(result, args.out)
    prompts = [tok.encode(p) for p in fixed.prompts]
    gold = _greedy(LLM.from_config(EngineConfig(model=args.model, dtype="float32"), ref), prompts, args.new_tokens)
    others = {"ours_quantized": _greedy(LLM.from_config(EngineConfig(model=args.model, dtype="auto",
                                                                     cpu_compile="off"), quant),
                                        prompts, args.new_tokens)}
    if unavailable() is None:
        # Prefix caching off: the one-at-a-time runs would otherwise start from the KV the batch computed
        compiled = LLM.from_config(EngineConfig(model=args.model, dtype="auto", cpu_compile="on",
                                                enable_prefix_caching=False), quant)
        others["ours_quantized_compiled"] = _greedy(compiled, prompts, args.new_tokens)
        # one prompt at a time, as llama.cpp's run: the batch-1 kernels (the batch above runs the batched ones)
        others["ours_quantized_compiled_one_at_a_time"] = [_greedy(compiled, [p], args.new_tokens)[0]
                                                           for p in prompts]
    if llama:
        others["llama_cpp"] = [llama.greedy(p, args.new_tokens) for p in prompts]
    rows = []
    margin_scorer = Scorer(ref.model, max(len(p) for p in prompts) + args.new_tokens)
    for i, (text, p, g) in enumerate(zip(fixed.prompts, prompts, gold)):
        margins = margin_scorer.score(p + g).margin[len(p) - 1:]
        row = {"prompt": text[:40]}
        for name, toks in others.items():
            d = first_divergence(g, toks[i])
            row[name] = {"tokens_until_divergence": d,
                         "ref_margin_there": None if d >= len(g) else round(float(margins[d]), 3)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    result["greedy"] = rows
    # Totals: tokens kept before the first divergence, and the largest fp32 margin a divergence overrode
    result["greedy_totals"] = greedy_totals(rows, others, args.new_tokens)
    return _write(result, args.out)


def _write(result: dict, path: str) -> int:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("weights", "perplexity", "kl_from_fp32", "text_argmax_agreement_vs_fp32",
                                             "nll_difference_vs_llama_cpp", "greedy_totals", "llama_cpp")
                      if k in result}))
    print(f"wrote {out}")
    return 0
