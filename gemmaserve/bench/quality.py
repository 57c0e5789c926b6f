"""`gemmaserve bench quality`: what keeping a GGUF's weights quantised costs in accuracy, on the CPU.

Three models over the same file: ours with every weight expanded to fp32 (the reference), ours with the
quantised weights (`--dtype auto`), and llama.cpp on the same file when `llama-cpp-python` is installed.
Ours decodes the greedy prompts as one batch, and (compiled) one at a time as llama.cpp does.
Figures: perplexity over a fixed text (teacher-forced; ours through the real paged path, `scoring.py`;
the quantised model both in prefill chunks and one token at a time, since the two run different
kernels), the KL divergence of each from our fp32 path's next-token distribution there, and greedy
agreement with the fp32 reference over fixed completion prompts: tokens until the first divergence,
and the reference's top-2 logit margin at that step (a divergence where the reference itself barely
decided is rounding, one at a clear margin is a defect).
"""

from __future__ import annotations

import argparse
import json
from datetime import date
from pathlib import Path

import torch

from ..config.options import positive_int

# Our own text (written for this benchmark, so no model has seen it verbatim).
TEXT = """\
The harbour town woke before the sun. Fishermen carried nets down the stone steps, and the baker on the
corner pulled the first loaves from an oven that had burned since midnight. Nobody hurried; the tide
would wait for no one, but it would also not come in any sooner for being watched.

Mara had lived above the chandlery for eleven years. From her window she could see the breakwater, the
red light at its end, and beyond it the grey line where the sea met the sky. Every morning she wrote
down three things in a small notebook: the wind, the colour of the water, and the number of boats that
went out. Her neighbours thought it was a strange habit. She thought it was the only way to notice that
the world was changing, slowly, in ways that a single day would never show.

In the spring the notebook showed something odd. The boats went out as before, but fewer of them came
back before noon, and the ones that did came back light. The older fishermen blamed the weather. The
younger ones blamed the new trawlers that worked the deep water to the north. Mara did not blame anyone.
She took her notebook to the harbour master, a patient man with ink on his cuffs, and asked him to read
it.

He read it twice. Then he opened a drawer and took out a ledger of his own, with columns of dates and
weights going back thirty years. Together they laid the two books side by side on his desk and compared
them, page by page, until the light outside turned orange. When they had finished, neither of them
spoke for a while. The numbers agreed with each other, and what they said was not good news.

That evening the harbour master called a meeting in the church hall. He did not make a speech. He
simply read out the figures, one year after another, and let the room listen. When he sat down, an old
woman at the back stood up and said that her father had kept a notebook too, and that she still had it.
By the end of the week there were nine notebooks on the table, and a plan.
"""

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea,",
    "The three primary colours are",
    "To make a cup of tea, first",
    "import numpy as np\n\n# Compute the mean of each row of a matrix\n",
    # Added 2026-12-04: six prompts decide greedy agreement by one or two near-ties; 24 give a count.
    "The water cycle describes how water moves between",
    "Here is a short list of fruits that are high in vitamin C:\n1.",
    "SELECT name, COUNT(*) FROM orders\n",
    "My grandmother always said that the secret to a good soup is",
    "The main difference between a virus and a bacterium is",
    "class Stack:\n    def __init__(self):\n",
    "Dear hiring manager,\n\nI am writing to apply for",
    "The first person to walk on the Moon was",
    "In mathematics, a prime number is",
    "Q: What is the boiling point of water at sea level?\nA:",
    "The train left the station at dawn, and",
    "for i in range(10):\n",
    "Photosynthesis is the process by which plants",
    "The recipe calls for two cups of flour, one egg and",
    "A good night's sleep helps the brain",
    "<html>\n<head>\n<title>",
    "The history of the printing press begins",
    "When the storm finally passed, the villagers",
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="gemma3-270m", help="GGUF file or alias (default: the embedded 270M)")
    parser.add_argument("--new-tokens", type=positive_int, default=64, help="greedy tokens per prompt")
    parser.add_argument("--threads", type=positive_int, default=None, help="llama.cpp threads (default: torch's)")
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


def run(args: argparse.Namespace) -> int:
    from ..config.engine import EngineConfig
    from ..engine.compiled_decode import unavailable
    from ..engine.llm import LLM
    from ..models.loader import load_model, resolve_model
    from .llama_cpp_ref import LlamaCppReference
    from .scoring import first_divergence, greedy_totals, score

    from ..errors import UserInputError
    from ..models.loader import SourceKind

    if resolve_model(args.model).kind is not SourceKind.GGUF:
        raise UserInputError(f"bench quality measures a GGUF file's quantised weights; {args.model!r} is not one")
    cpu = torch.device("cpu")
    ref = load_model(args.model, torch.float32, cpu)
    quant = load_model(args.model, torch.float32, cpu, quantized=True)
    tok = ref.tokenizer
    text_ids = tok.encode(TEXT)
    result: dict = {"benchmark": "quality", "date": date.today().isoformat(), "model": args.model,
                    "weights": quant.weight_formats, "text_tokens": len(text_ids), "new_tokens": args.new_tokens}
    s_ref = score(ref.model, text_ids, keep_logprobs=True)
    # Prefill kernels (256-row chunks), decode kernels (one row at a time, as batch-1 decode runs) and
    # decode batches' kernels (8 rows at a time)
    engines = {"ours_fp32": s_ref, "ours_quantized": score(quant.model, text_ids, reference=s_ref),
               "ours_quantized_decode": score(quant.model, text_ids, chunk=1, reference=s_ref),
               "ours_quantized_8_rows": score(quant.model, text_ids, chunk=8, reference=s_ref)}
    if unavailable() is None:   # the compiled decode step (what the engine runs once it is compiled)
        engines["ours_quantized_decode_compiled"] = score(quant.model, text_ids, chunk=1, reference=s_ref,
                                                          compiled=True, kv_manager="v2")
    llama = LlamaCppReference.open(resolve_model(args.model).path, args.threads or torch.get_num_threads())
    result["llama_cpp"] = llama.version if llama else "not installed (pip install llama-cpp-python)"
    if llama:
        engines["llama_cpp"] = llama.score(text_ids, reference=s_ref)
    result["perplexity"] = {k: round(v.perplexity, 4) for k, v in engines.items()}
    result["kl_from_fp32"] = {k: round(v.mean_kl, 5) for k, v in engines.items() if v.mean_kl is not None}
    result["text_argmax_agreement_vs_fp32"] = {k: round(float((v.argmax == s_ref.argmax).float().mean()), 4)
                                               for k, v in engines.items() if k != "ours_fp32"}
    prompts = [tok.encode(p) for p in PROMPTS]
    gold = _greedy(LLM.from_config(EngineConfig(model=args.model, dtype="float32"), ref), prompts, args.new_tokens)
    others = {"ours_quantized": _greedy(LLM.from_config(EngineConfig(model=args.model, dtype="auto",
                                                                     cpu_compile="off"), quant),
                                        prompts, args.new_tokens)}
    if unavailable() is None:
        compiled = LLM.from_config(EngineConfig(model=args.model, dtype="auto", cpu_compile="on"), quant)
        others["ours_quantized_compiled"] = _greedy(compiled, prompts, args.new_tokens)
        # one prompt at a time, as llama.cpp's run: the batch-1 kernels (the batch above runs the batched ones)
        others["ours_quantized_compiled_one_at_a_time"] = [_greedy(compiled, [p], args.new_tokens)[0]
                                                           for p in prompts]
    if llama:
        others["llama_cpp"] = [llama.greedy(p, args.new_tokens) for p in prompts]
    rows = []
    for i, (text, p, g) in enumerate(zip(PROMPTS, prompts, gold)):
        margins = score(ref.model, p + g).margin[len(p) - 1:]
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
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("weights", "perplexity", "kl_from_fp32", "text_argmax_agreement_vs_fp32",
                                             "greedy_totals", "llama_cpp")}))
    print(f"wrote {out}")
    return 0
