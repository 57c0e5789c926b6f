"""`gemmaserve bench spec-drafters`: what a drafting step costs with a draft model and with a Gemma 4 MTP
drafter, against a plain decode step of the same target, on tiny random checkpoints written at start
(transformers' save_pretrained; the engine loads them through its own loading path).

Random weights accept (almost) nothing, so a drafter's cost shows alone: per case, batch-1 greedy
decoding of `--new-tokens` tokens after a short prompt, speculation off and on (k drafts per step),
median of `--repeats` runs; each row gives the time per engine step, tokens per step, the share of
steps that drafted (a request whose drafts keep missing pauses drafting: scheduler.py), the cost of a
drafting step against a plain one (the overhead a drafter must win back by acceptance: the run's time
less its steps without drafts at the plain step's price, over its drafting steps) and the end-to-end
ratio. The draft model also runs as the target's own draft (every draft accepted): the upper end, k + 1
tokens per step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import torch

from ..config.options import positive_int
from .decode import _machine


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-speculative-tokens", type=positive_int, default=4, help="drafted tokens per step")
    parser.add_argument("--new-tokens", type=positive_int, default=64, help="tokens generated per run")
    parser.add_argument("--repeats", type=positive_int, default=5, help="timed runs per figure (median)")
    parser.add_argument("--out", default="bench-out/spec_drafters.json", help="JSON output path")


VOCAB = 4096
GEMMA3 = dict(vocab_size=VOCAB, hidden_size=512, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=4,
              num_key_value_heads=1, head_dim=128, sliding_window=64, query_pre_attn_scalar=128,
              max_position_embeddings=4096, bos_token_id=2, eos_token_id=1, pad_token_id=0)
GEMMA4 = dict(vocab_size=VOCAB, hidden_size=512, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=8,
              num_key_value_heads=2, num_global_key_value_heads=1, head_dim=64, global_head_dim=128,
              attention_k_eq_v=True, sliding_window=64, final_logit_softcapping=30.0, hidden_size_per_layer_input=0,
              max_position_embeddings=4096, bos_token_id=2, eos_token_id=1, pad_token_id=0,
              layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(12)])


def _save(model, path: Path) -> str:
    from ..testing.synthetic import synthetic_tokenizer

    model.save_pretrained(path, safe_serialization=True)
    synthetic_tokenizer(VOCAB).backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>", "eos_token": "<eos>",
                                                            "pad_token": "<pad>"}))
    return str(path)


def _checkpoints(root: Path) -> dict[str, str]:
    """target and drafters: a Gemma 3 target and a 4-layer, half-width Gemma 3 draft model; a Gemma 4
    (31B-like: K = V) target and a 4-layer MTP drafter made for it."""
    import transformers

    torch.manual_seed(0)
    paths = {"gemma3": _save(transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**GEMMA3)), root / "g3")}
    small = {**GEMMA3, "hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 4}
    paths["gemma3_draft"] = _save(transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**small)), root / "g3d")
    paths["gemma4"] = _save(transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(**GEMMA4)), root / "g4")
    text = {**GEMMA4, "hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_kv_shared_layers": 4, "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
            "vocab_size_per_layer_input": 0}
    cfg = transformers.Gemma4AssistantConfig(text_config=text, backbone_hidden_size=GEMMA4["hidden_size"],
                                             use_ordered_embeddings=True, num_centroids=64,
                                             centroid_intermediate_top_k=8)
    drafter = transformers.Gemma4AssistantForCausalLM(cfg)
    drafter.masked_embedding.token_ordering.copy_(torch.randperm(VOCAB))
    paths["mtp"] = _save(drafter, root / "mtp")
    return paths


def _decode(llm, prompt: list[int], new_tokens: int) -> tuple[float, int, list[int]]:
    """(seconds, engine steps, tokens) of one greedy completion at batch 1."""
    from ..engine.sampling_params import SamplingParams

    engine = llm.engine
    start = time.perf_counter()
    req = engine.add_request("", SamplingParams(max_tokens=new_tokens, ignore_eos=True, temperature=0.0),
                             prompt_ids=prompt)
    steps, tokens = 0, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished and out.request_id == req:
                tokens = out.outputs[0].token_ids
        steps += 1
    return time.perf_counter() - start, steps, tokens


def run(args: argparse.Namespace) -> int:
    from ..engine.llm import LLM

    k = args.num_speculative_tokens
    rows, ok = [], True
    with tempfile.TemporaryDirectory() as tmp:
        paths = _checkpoints(Path(tmp))
        cases = [("gemma3", "draft_model", paths["gemma3_draft"]), ("gemma3", "draft_model (itself)", paths["gemma3"]),
                 ("gemma4", "mtp", paths["mtp"])]
        prompt = [2] + [3 + (i * 37) % (VOCAB - 3) for i in range(31)]
        for target, method, drafter in cases:
            base = LLM(model=paths[target], dtype="float32")
            spec_config = {"method": method.split()[0], "model": drafter, "num_speculative_tokens": k}
            spec = LLM.from_config(base.engine.config.replace(speculative_config=spec_config), base)
            times = {"off": [], "on": []}
            for r in range(args.repeats + 1):   # the first of each is a warm-up
                for name, llm in (("off", base), ("on", spec)):
                    drafting = spec.engine.snapshot().spec.steps
                    seconds, steps, tokens = _decode(llm, prompt, args.new_tokens)
                    if r:
                        times[name].append((seconds, steps, spec.engine.snapshot().spec.steps - drafting))
                    if name == "off":
                        want = tokens
                    elif tokens != want:
                        ok = False
                        print(f"{target}/{method}: tokens differ with speculation", file=sys.stderr)
            off_s, off_steps = statistics.median(t[0] for t in times["off"]), times["off"][0][1]
            on_s, on_steps, drafted = statistics.median(t[0] for t in times["on"]), times["on"][0][1], times["on"][0][2]
            plain = off_s / off_steps
            drafting_step = (on_s - (on_steps - drafted) * plain) / drafted if drafted else float("nan")
            row = {"target": target, "method": method, "k": k, "new_tokens": args.new_tokens,
                   "plain_step_ms": round(1e3 * plain, 3), "drafting_step_ms": round(1e3 * drafting_step, 3),
                   "step_ratio": round(drafting_step / plain, 3), "drafting_steps": drafted,
                   "spec_steps": on_steps, "plain_steps": off_steps,
                   "tokens_per_step": round(args.new_tokens / on_steps, 3),
                   "acceptance_rate": round(spec.engine.snapshot().spec.acceptance_rate, 3), "speedup": round(off_s / on_s, 3)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": date.today().isoformat(), "machine": _machine(torch.device("cpu")), "torch": torch.__version__,
                               "command": "gemmaserve bench spec-drafters " + " ".join(sys.argv[3:]),
                               "rows": rows, "same_tokens": ok}, indent=1))
    print(f"{'target':8} {'method':22} {'plain ms':>8} {'drafting ms':>11} {'ratio':>6} {'drafting':>9} "
          f"{'tok/step':>8} {'accept':>6} {'speedup':>7}")
    for r in rows:
        print(f"{r['target']:8} {r['method']:22} {r['plain_step_ms']:8.2f} {r['drafting_step_ms']:11.2f} "
              f"{r['step_ratio']:6.2f} {r['drafting_steps']:4d}/{r['spec_steps']:<4d} {r['tokens_per_step']:8.2f} "
              f"{r['acceptance_rate']:6.2f} {r['speedup']:7.2f}")
    return 0 if ok else 1
