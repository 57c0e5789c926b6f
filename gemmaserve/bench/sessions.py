"""`gemmaserve bench sessions`: multi-turn sessions that come back after the device pool evicted their prefix,
with the host KV tier (`--kv-offload-memory`) against recomputation, in one run.

Workload: `--sessions` sessions, each a long random prefix (`--prefixes` tokens) followed by turns of
`--turn-tokens` new tokens; turn t of every session runs before turn t + 1 of any, and each turn's prompt is the
session so far (earlier prompts and answers) plus its new tokens, so a returning turn can reuse everything
before its new tokens. Requests run one at a time. The device pool holds about `--pool-sessions` sessions'
KV, so by the time a session returns, the others have evicted its prefix from the device.

Configurations, same weights, same prompts:
  recompute   prefix caching on, no tier: a returning turn recomputes what the device evicted
  tier        the same plus a host tier large enough for every session
and, for "no regression without returns", the same two on prompts that never share a prefix.

Per configuration: time to first token of first and returning turns (median), total time, prefix hit rate, and
the tier's blocks saved and loaded and bytes held, against the bytes a tier storing every layer of the same
tokens would hold (the sliding-window saving). Writes $OUT/sessions.json (or bench-out/).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--shape", default=None,
                    help="a random-weight model shape (e.g. gemma4-tiny) instead of --model (testing/synthetic.py)")
    ap.add_argument("--sessions", type=int, default=4, help="sessions, interleaved turn by turn")
    ap.add_argument("--turns", type=int, default=3, help="turns per session (all but the first return)")
    ap.add_argument("--prefixes", default="1024,4096", help="prefix lengths to run, tokens (comma separated)")
    ap.add_argument("--turn-tokens", type=int, default=32, help="new prompt tokens per turn")
    ap.add_argument("--answer-tokens", type=int, default=8, help="tokens each turn generates")
    ap.add_argument("--pool-sessions", type=float, default=1.5,
                    help="device KV pool size, in sessions' worth of KV (below --sessions: returns miss the device)")
    ap.add_argument("--workloads", default="returns,fresh",
                    help="returns: sessions come back; fresh: every turn a new prefix (the no-regression check)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="runs of each configuration, alternating recompute and tier (medians reported)")


def _session_prompts(sessions: int, turns: int, prefix: int, turn_tokens: int, vocab: int, seed: int
                     ) -> list[list[list[int]]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(sessions):
        head = [2] + torch.randint(3, vocab, (prefix - 1,), generator=gen).tolist()
        out.append([head] + [torch.randint(3, vocab, (turn_tokens,), generator=gen).tolist() for _ in range(turns)])
    return out


def _one(engine, prompt: list[int], params) -> tuple[float, float, int, list[int]]:
    """(time to first token, total time, prompt tokens served from cache, answer) of one request alone."""
    start = time.perf_counter()
    rid = engine.add_request("", params, prompt_ids=prompt)
    first = None
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id != rid:
                continue
            if first is None and o.outputs[0].token_ids:
                first = time.perf_counter() - start
            out = o
    return first, time.perf_counter() - start, out.num_cached_tokens, list(out.outputs[0].token_ids)


def _run_sessions(llm, sessions: list[list[list[int]]], params, returns: bool) -> dict:
    """Turn by turn over the sessions. `returns=False`: every turn a fresh session (nothing to come back to)."""
    engine = llm.engine
    history = [list(s[0]) for s in sessions]
    first_ttft, return_ttft, answers, cached, prompt_tokens = [], [], [], 0, 0
    start = time.perf_counter()
    for t in range(1, len(sessions[0])):
        for i, s in enumerate(sessions):
            if returns:
                prompt = history[i] + s[t]
            else:   # a first turn's length, with a prefix no earlier request had
                prompt = [history[i][0] + 0] + [(x + 7919 * t) % (engine.info.vocab_size - 3) + 3
                                                for x in history[i][1:]] + s[t]
            ttft, _, hit, answer = _one(engine, prompt, params)
            (first_ttft if t == 1 else return_ttft).append(ttft)
            cached += hit
            prompt_tokens += len(prompt)
            answers.append(answer)
            if returns:
                history[i] = prompt + answer
    total = time.perf_counter() - start
    engine.check_integrity()
    snap = engine.snapshot()
    row = {"total_s": round(total, 3), "first_ttft_ms": round(1e3 * statistics.median(first_ttft), 1),
           "return_ttft_ms": round(1e3 * statistics.median(return_ttft), 1) if return_ttft else None,
           "cached_tokens": cached, "prompt_tokens": prompt_tokens,
           "prefix_hit_rate": round(snap.prefix_hit_rate, 3)}
    if snap.tier is not None:
        st = snap.tier
        row.update(saved_blocks=st.saved_blocks, loaded_blocks=st.loaded_blocks, evicted_blocks=st.evicted_blocks,
                   tier_bytes=st.bytes_used, every_layer_bytes=_every_layer_bytes(engine.internals().kv))
    row["answers"] = answers
    return row


def _median_row(rows: list[dict]) -> dict:
    """The run with the median total time, with every run's total beside it."""
    rows = sorted(rows, key=lambda r: r["total_s"])
    return {**rows[len(rows) // 2], "runs_total_s": [r["total_s"] for r in rows]}


def _every_layer_bytes(kv) -> int:
    """Bytes a tier holding every KV-owning layer of the tokens this tier covers would take: the tokens are
    those of the full-attention blocks it holds (every stored prefix keeps all of them)."""
    counts = kv.tier.block_counts()
    full = [g for g in kv.groups if not g.sliding]
    if not full:
        return 0
    g = full[0]
    tokens = counts.get(g.index, 0) * g.tokens_per_page
    return tokens * sum(s.bytes_per_token() for s in kv.specs if s.owns_kv)


def run(args: argparse.Namespace) -> int:
    from ..config.engine import EngineConfig
    from ..config.options import from_namespace
    from ..engine.llm import LLM
    from ..engine.sampling_params import SamplingParams
    from ..hostmem import available_host_memory

    # compiled decode steps built (or loaded) before any timed run: a background build would compete with them
    config = from_namespace(EngineConfig, args).steady_state()
    loaded = None
    if args.shape is not None:
        from ..testing.synthetic import random_model

        loaded = random_model(args.shape, torch.float32, torch.device(config.torch_device()))
        config = config.replace(model=loaded.source.name)
    base = LLM.from_config(config.replace(kv_cache_memory=64 << 20), loaded)
    vocab = base.engine.info.vocab_size
    params = SamplingParams(max_tokens=args.answer_tokens, ignore_eos=True, temperature=0)
    results = []
    for prefix in [int(x) for x in args.prefixes.split(",")]:
        sessions = _session_prompts(args.sessions, args.turns + 1, prefix, args.turn_tokens, vocab, seed=prefix)
        longest = prefix + args.turns * (args.turn_tokens + args.answer_tokens)
        kv = base.engine.internals().kv
        pool = int(args.pool_sessions * kv.pages_at(longest) * kv.page_bytes)
        pool = max(pool, kv.peak_pages(longest, config.max_num_batched_tokens) * kv.page_bytes)
        tier_bytes = 2 * args.sessions * kv.pages_at(longest) * kv.page_bytes   # room for every session
        free = available_host_memory()
        if free is not None and tier_bytes > free // 2:
            raise SystemExit(f"a tier of {tier_bytes} bytes would take over half the host's free memory")
        for returns in [w == "returns" for w in args.workloads.split(",")]:
            runs: dict[str, list[dict]] = {"recompute": [], "tier": []}
            for _ in range(args.repeat):   # alternating, so a drift of the machine's speed hits both alike
                for name, extra in (("recompute", {}), ("tier", {"kv_offload_memory": tier_bytes})):
                    llm = LLM.from_config(config.replace(kv_cache_memory=pool, enable_prefix_caching=True, **extra),
                                          base)
                    _one(llm.engine, sessions[0][0][:64], params)   # warm-up (first-step costs)
                    llm.reset_prefix_cache()
                    runs[name].append(_run_sessions(llm, sessions, params, returns))
                    del llm
            answers = [r.pop("answers") for rs in runs.values() for r in rs]
            same = all(a == answers[0] for a in answers)
            rec, tier = (_median_row(runs[name]) for name in ("recompute", "tier"))
            row = {"prefix": prefix, "returns": returns, "pool_bytes": pool, "same_tokens": same,
                   "recompute": rec, "tier": tier,
                   "total_ratio": round(tier["total_s"] / rec["total_s"], 3)}
            if returns:
                row["return_ttft_ratio"] = round(tier["return_ttft_ms"] / rec["return_ttft_ms"], 3)
                row["tier_bytes_vs_every_layer"] = round(tier["tier_bytes"] / max(1, tier["every_layer_bytes"]), 3)
            results.append(row)
            print(json.dumps(row), flush=True)
    out = Path(os.environ.get("OUT", "bench-out")) / "sessions.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "sessions", "date": time.strftime("%Y-%m-%d"),
                               "machine": platform.processor() or platform.machine(),
                               "model": config.model, "engine": str(base.engine.info),
                               "threads": torch.get_num_threads(), "sessions": args.sessions, "turns": args.turns,
                               "turn_tokens": args.turn_tokens, "answer_tokens": args.answer_tokens,
                               "rows": results}, indent=1))
    return 0 if all(r["same_tokens"] for r in results) else 1
