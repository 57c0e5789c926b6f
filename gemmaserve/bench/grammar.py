"""`gemmaserve bench grammar`: what structured output costs per step, xgrammar against llguidance.

1. Masks alone, each library on the model's own tokenizer: `--batch` requests walk through valid
   JSON documents for one schema, token by token; each step fills every row's mask (both libraries'
   batched, threaded fills), applies it to [batch, vocab] logits, and accepts the tokens. Per step:
   fill, apply and accept times (median), and the share of a decode step they would add.
2. End to end, our engine with xgrammar: `--batch` concurrent requests, constrained by the schema
   against unconstrained, same prompts and token counts (`--new-tokens`): decode tokens/s of both
   and their ratio.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from datetime import date
from pathlib import Path

from ..config.options import from_namespace, positive_int

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string"},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "scores": {"type": "array", "items": {"type": "number"}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "email", "role", "scores", "address"],
    "additionalProperties": False,
}
WORDS = ("amber", "river", "stone", "maple", "north", "quiet", "harbor", "lumen", "cedar", "falcon")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=positive_int, default=64, help="concurrent constrained requests")
    parser.add_argument("--new-tokens", type=positive_int, default=48, help="tokens per request (end to end)")
    parser.add_argument("--no-engine", action="store_true", help="masks only: skip the end-to-end comparison")
    parser.add_argument("--out", default="bench-out/grammar.json", help="JSON output path")


def _document(rng: random.Random) -> str:
    name = " ".join(rng.choice(WORDS).title() for _ in range(2))
    doc = {"name": name, "age": rng.randint(18, 90), "email": f"{rng.choice(WORDS)}@{rng.choice(WORDS)}.org",
           "role": rng.choice(SCHEMA["properties"]["role"]["enum"]),
           "scores": [round(rng.uniform(0, 100), 2) for _ in range(rng.randint(1, 4))],
           "address": {"city": rng.choice(WORDS).title(), "zip": str(rng.randint(10000, 99999))}}
    return json.dumps(doc)


def _walk(name: str, rows: list[list[int]], fill, apply, accept) -> dict:
    """Step every row through its tokens: fill masks of the live rows, apply, accept. Median ms."""
    fills, applies, accepts = [], [], []
    for step in range(max(len(r) for r in rows)):
        live = [i for i, r in enumerate(rows) if step < len(r)]
        if len(live) < len(rows) // 2:   # time full batches only
            break
        t0 = time.perf_counter()
        fill(live)
        t1 = time.perf_counter()
        apply(live)
        t2 = time.perf_counter()
        accept(live, [rows[i][step] for i in live])
        t3 = time.perf_counter()
        fills.append(t1 - t0)
        applies.append(t2 - t1)
        accepts.append(t3 - t2)

    def ms(xs: list[float]) -> float:
        return round(1000 * statistics.median(xs), 3)

    out = {"library": name, "steps": len(fills), "fill_ms": ms(fills), "apply_ms": ms(applies),
           "accept_ms": ms(accepts)}
    out["step_ms"] = round(out["fill_ms"] + out["apply_ms"] + out["accept_ms"], 3)
    return out


def _xgrammar(tokenizer, vocab: int, rows: list[list[int]]) -> list[dict]:
    """xgrammar with its own apply kernel, and the engine's path (Grammars: llguidance's kernel on the CPU)."""
    import torch
    import xgrammar as xgr

    from ..engine.structured.structured_output import Grammars, StructuredOutput

    grammars = Grammars(tokenizer, vocab)
    grammars.warm_up(cpu_kernel=True)   # the engine path's CPU kernel is built before anything is timed
    grammars.wait_for_kernel()
    so = StructuredOutput.json_schema(SCHEMA)
    bitmask = grammars.bitmask(len(rows))
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(0))
    out = []
    for name, engine_path in (("xgrammar", False), ("xgrammar, engine path (Grammars.apply)", True)):
        states = [grammars.matcher(so) for _ in rows]

        def fill(live):
            grammars.fill([states[i] for i in live], bitmask, live)

        def apply(live):
            if engine_path:
                grammars.apply(logits, bitmask, live)
            else:
                xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=live)

        def accept(live, tokens):
            ok = xgr.BatchGrammarMatcher.batch_accept_token([states[i].matcher for i in live], tokens)
            assert all(ok), "a valid document was rejected"

        out.append(_walk(name, rows, fill, apply, accept))
    return out


def _llguidance(tokenizer, vocab: int, rows: list[list[int]]) -> dict | None:
    try:
        import llguidance
        import llguidance.torch as llt
    except ImportError:
        return None
    import torch

    lltok = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab,
                                   eos_token=sorted(tokenizer.stop_token_ids))
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    matchers = [llguidance.LLMatcher(lltok, grammar) for _ in rows]
    executor = llguidance.LLExecutor(num_threads=2)
    bitmask = llt.allocate_token_bitmask(len(rows), vocab)
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(0))

    def fill(live):
        llt.fill_next_token_bitmask_par(executor, [(matchers[i], i) for i in live], bitmask)

    def apply(live):
        llt.apply_token_bitmask_inplace(logits, bitmask)

    def accept(live, tokens):
        for i, t in zip(live, tokens):
            assert matchers[i].consume_token(t), matchers[i].get_error()

    return _walk("llguidance", rows, fill, apply, accept)


def _engine_rows(llm, batch: int, new_tokens: int) -> dict:
    """Decode tokens/s of `batch` schema-constrained requests against the same number unconstrained."""
    from ..engine.sampling_params import SamplingParams
    from ..engine.structured.structured_output import StructuredOutput

    prompts = [f"Record {i} of the staff directory, as JSON: " for i in range(batch)]
    out = {}
    for label, params in (("unconstrained", SamplingParams(max_tokens=new_tokens, ignore_eos=True)),
                          ("json_schema", SamplingParams(max_tokens=new_tokens,
                                                         structured_output=StructuredOutput.json_schema(SCHEMA)))):
        llm.generate(prompts[:2], params.replace(max_tokens=4))   # warm-up (and the grammar's compile)
        start = time.perf_counter()
        results = llm.generate(prompts, params)
        wall = time.perf_counter() - start
        tokens = sum(len(r.outputs[0].token_ids) for r in results)
        out[label] = {"tokens": tokens, "seconds": round(wall, 3), "tokens_per_s": round(tokens / wall, 1)}
        if label == "json_schema":
            complete = [r.outputs[0].text for r in results if r.outputs[0].finish_reason == "stop"]
            out[label]["complete_documents"] = len(complete)
            out[label]["all_parse"] = all(isinstance(json.loads(t), dict) for t in complete)
    out["ratio"] = round(out["json_schema"]["tokens_per_s"] / out["unconstrained"]["tokens_per_s"], 3)
    return out


def run(args: argparse.Namespace) -> int:
    import torch

    from ..config.engine import EngineConfig
    from ..engine.llm import LLM

    # compiled decode steps built (or loaded) before any timed run: a background build would compete with them
    config = from_namespace(EngineConfig, args).steady_state()
    llm = LLM.from_config(config)
    tokenizer, vocab = llm.tokenizer, llm.engine.info.vocab_size
    rng = random.Random(0)
    rows = [tokenizer.encode(_document(rng), add_special_tokens=False) for _ in range(args.batch)]
    masks = _xgrammar(tokenizer, vocab, rows)
    ll = _llguidance(tokenizer, vocab, rows)
    if ll is not None:
        masks.append(ll)
    result = {"date": date.today().isoformat(), "machine": platform.processor() or platform.machine(),
              "threads": torch.get_num_threads(), "model": config.model, "vocab": vocab, "batch": args.batch,
              "cpu_compile": llm.engine.info.cpu_compile, "masks": masks}
    if not args.no_engine:
        result["engine"] = _engine_rows(llm, args.batch, args.new_tokens)
    print(f"{'library':<44}{'fill ms':>9}{'apply ms':>10}{'accept ms':>11}{'step ms':>9}   (batch {args.batch})")
    for m in masks:
        print(f"{m['library']:<44}{m['fill_ms']:>9}{m['apply_ms']:>10}{m['accept_ms']:>11}{m['step_ms']:>9}")
    if "engine" in result:
        e = result["engine"]
        print(f"engine, batch {args.batch}: unconstrained {e['unconstrained']['tokens_per_s']} tok/s, "
              f"json_schema {e['json_schema']['tokens_per_s']} tok/s (x{e['ratio']}); "
              f"{e['json_schema']['complete_documents']} complete documents, all parse: {e['json_schema']['all_parse']}")
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    return 0
