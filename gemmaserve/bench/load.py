"""`gemmaserve bench load`: a bounded load test of the HTTP server, against the same engine offline.

One engine serves the real server (`BackgroundServer`: uvicorn on 127.0.0.1, a free port). For each
`--concurrency` level C, a closed loop of C clients (the official `openai.AsyncOpenAI`, in this
process) sends streamed `/v1/completions` requests (greedy, `ignore_eos`, exactly `--max-tokens`
tokens each; prompts of 16-128 seeded random words, different for each level) until
`--requests-per-level` have been sent or `--time-limit` seconds have passed since the level began;
requests in flight then run to the end. Measured per request, on the client:
* TTFT: from just before the request is sent to the first chunk with non-empty text;
* ITL: the gaps between consecutive chunks with non-empty text (the server sends one chunk per
  engine step, one token each, except where the detokenizer holds back an incomplete character:
  `tokens_per_text_chunk` in the JSON says how close to one token per chunk it was);
* end-to-end latency, and output tokens from the stream's final usage chunk.
Per level: requests/s and output tokens/s = completed requests (tokens) / wall time from the
level's start to the last completion.

Reference, same run, same weights, while the server is idle: the prompts the server completed at
that level through `LLM.generate` on a second engine (no HTTP, no client) with
`max_num_seqs = min(C, --max-num-seqs)`, the batch the server could run at that level.
ratio = server output tokens/s / offline output tokens/s.

Afterwards, on the engine thread: the KV integrity check, and no pages still held by a request.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import time
from datetime import date
from pathlib import Path

import numpy as np

from ..config.options import from_namespace, number, positive_int
from .decode import _machine
from .throughput import workload

MIN_WORDS, MAX_WORDS = 16, 128


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--concurrency", type=positive_int, nargs="+", default=[1, 8, 32], metavar="C",
                        help="requests in flight, one level each (default: 1 8 32)")
    parser.add_argument("--requests-per-level", type=positive_int, default=None,
                        help="requests sent per level (default: max(4, 1.5 x concurrency))")
    parser.add_argument("--time-limit", type=number, default=60.0,
                        help="seconds per level after which no new request is sent (default: 60)")
    parser.add_argument("--max-tokens", type=positive_int, default=32, help="tokens generated per request")
    parser.add_argument("--request-timeout", type=number, default=120.0,
                        help="client timeout per request (connect, and each read of the stream), seconds")
    parser.add_argument("--out", default="bench-out/load.json", help="JSON output path")


@dataclasses.dataclass
class _Result:
    prompt: str
    start: float
    ttft: float | None = None
    itl: list[float] = dataclasses.field(default_factory=list)
    e2e: float | None = None
    tokens: int | None = None
    text_chunks: int = 0
    error: str | None = None


async def _one(client, model: str, prompt: str, max_tokens: int, timeout: float) -> _Result:
    r = _Result(prompt, time.perf_counter())
    last = None
    try:
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}, timeout=timeout)
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.choices and chunk.choices[0].text:
                r.text_chunks += 1
                if last is None:
                    r.ttft = now - r.start
                else:
                    r.itl.append(now - last)
                last = now
            if chunk.usage is not None:
                r.tokens = chunk.usage.completion_tokens
        r.e2e = time.perf_counter() - r.start
    except Exception as exc:   # counted and reported; the level goes on
        r.error = f"{type(exc).__name__}: {exc}"
    return r


async def _level(base_url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int,
                 time_limit: float, timeout: float) -> tuple[list[_Result], float, bool]:
    """A closed loop of `concurrency` clients over `prompts`; returns (results, wall seconds, cut short)."""
    import openai

    results: list[_Result] = []
    next_index = 0
    cut = False
    async with openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0) as client:
        start = time.perf_counter()
        deadline = start + time_limit

        async def worker() -> None:
            nonlocal next_index, cut
            while next_index < len(prompts):
                if time.perf_counter() >= deadline:
                    cut = True
                    return
                prompt = prompts[next_index]
                next_index += 1
                results.append(await _one(client, model, prompt, max_tokens, timeout))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return results, wall, cut


def _pct(values: list[float]) -> dict:
    """p50/p90/p99 in milliseconds (None where there is nothing to measure)."""
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    p = np.percentile(np.asarray(values) * 1000.0, [50, 90, 99])
    return {"p50": round(float(p[0]), 1), "p90": round(float(p[1]), 1), "p99": round(float(p[2]), 1)}


def _offline(loaded, config, prompts: list[str], max_num_seqs: int, max_tokens: int) -> dict:
    from ..engine.llm import LLM
    from ..engine.sampling_params import SamplingParams

    llm = LLM.from_config(config.replace(max_num_seqs=max_num_seqs), loaded)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)   # warm-up of this engine
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"requests": len(prompts), "max_num_seqs": max_num_seqs, "seconds": round(wall, 2),
            "output_tokens": tokens, "tok_s": round(tokens / wall, 2)}


def _row(c: int, sent: int, results: list[_Result], wall: float, cut: bool, max_tokens: int) -> dict:
    done = [r for r in results if r.error is None]
    failed = [r for r in results if r.error is not None]
    tokens = sum(r.tokens or 0 for r in done)
    chunks = sum(r.text_chunks for r in done)
    return {
        "concurrency": c, "requests_planned": sent, "requests_sent": len(results), "completed": len(done),
        "failed": len(failed), "errors": sorted({r.error for r in failed})[:5], "time_limit_hit": cut,
        "wall_s": round(wall, 2), "req_s": round(len(done) / wall, 3), "output_tokens": tokens,
        "out_tok_s": round(tokens / wall, 2),
        "short_or_missing_usage": sum(1 for r in done if r.tokens != max_tokens),
        "no_text": sum(1 for r in done if r.ttft is None),
        "tokens_per_text_chunk": round(tokens / chunks, 3) if chunks else None,
        "ttft_ms": _pct([r.ttft for r in done if r.ttft is not None]),
        "itl_ms": _pct([g for r in done for g in r.itl]),
        "e2e_ms": _pct([r.e2e for r in done if r.e2e is not None]),
    }


def _kv_check(srv) -> dict:
    def check(engine):
        try:
            engine.check_integrity()
            ok, why = True, None
        except AssertionError as exc:
            ok, why = False, str(exc) or "AssertionError"
        return ok, why, engine.snapshot(), engine.has_unfinished_requests()

    ok, why, snap, busy = srv.server.async_engine.call_blocking(check)
    return {"integrity_ok": ok, "integrity_error": why, "pages_used": snap.pages_used, "pages_cached": snap.pages_cached,
            "pages_free": snap.pages_free, "num_pages": snap.pages_total, "unfinished_requests": busy,
            "pages_used_is_zero": snap.pages_used == 0, "prefix_hit_rate": round(snap.prefix_hit_rate, 4),
            "preemptions": snap.preemptions}


def run(args: argparse.Namespace) -> int:
    from ..config.engine import EngineConfig
    from ..engine.llm_engine import LLMEngine
    from ..errors import UserInputError
    from ..server.background import BackgroundServer

    if not args.time_limit > 0:
        raise UserInputError("--time-limit must be > 0")
    if not args.request_timeout > 0:
        raise UserInputError("--request-timeout must be > 0")
    config = from_namespace(EngineConfig, args).replace(serving=True).steady_state()   # a server's steady state
    engine = LLMEngine(config)
    levels = list(dict.fromkeys(args.concurrency))
    result: dict = {
        "benchmark": "load", "date": date.today().isoformat(), "machine": _machine(engine.info.device),
        "model": config.model, "dtype": engine.info.dtype, "kv_cache_dtype": engine.info.kv_cache_dtype,
        "max_tokens": args.max_tokens,
        "prompt_words": [MIN_WORDS, MAX_WORDS], "time_limit_s": args.time_limit,
        "request_timeout_s": args.request_timeout, "engine": config.recorded(),
        "engine_info": dataclasses.asdict(engine.info), "levels": [],
    }
    with BackgroundServer(engine) as srv:
        model = srv.server.model_name
        warm = asyncio.run(_level(srv.base_url, model, workload(1, 8, 8, seed=12345), 1, 2, 60.0,
                                  args.request_timeout))[0][0]
        if warm.error is not None:
            raise RuntimeError(f"the warm-up request failed: {warm.error}")
        for i, c in enumerate(levels):
            n = args.requests_per_level or max(4, 3 * c // 2)
            prompts = workload(n, MIN_WORDS, MAX_WORDS, seed=1000 + i)
            results, wall, cut = asyncio.run(_level(srv.base_url, model, prompts, c, args.max_tokens,
                                                    args.time_limit, args.request_timeout))
            row = _row(c, n, results, wall, cut, args.max_tokens)
            done_prompts = [r.prompt for r in results if r.error is None]
            if done_prompts:   # the server is idle now: nothing is in flight
                off = _offline(engine.internals().loaded, config, done_prompts, min(c, config.max_num_seqs), args.max_tokens)
                row["offline"] = off
                row["ratio_server_vs_offline"] = round(row["out_tok_s"] / off["tok_s"], 3)
            result["levels"].append(row)
            print(f"concurrency {c}: {row['completed']}/{n} completed, {row['failed']} failed, "
                  f"{row['wall_s']} s{' (time limit hit)' if cut else ''}; offline "
                  f"{row.get('offline', {}).get('seconds', '-')} s", file=sys.stderr, flush=True)
        result["kv_after"] = _kv_check(srv)
    _report(result, Path(args.out))
    kv = result["kv_after"]
    failed = sum(r["failed"] for r in result["levels"])
    return 0 if kv["integrity_ok"] and kv["pages_used_is_zero"] and not failed else 1


def _report(result: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str) + "\n")

    def f(v, spec=".0f"):
        return "-" if v is None else format(v, spec)

    print(f"HTTP load, {result['model']} ({result['dtype']}) on {result['machine']}: streamed completions of "
          f"{result['max_tokens']} tokens, prompts of {result['prompt_words'][0]}-{result['prompt_words'][1]} words, "
          f"time limit {result['time_limit_s']:g} s per level; latencies in ms")
    print(f"{'conc':>4} {'done':>6} {'fail':>4} {'wall s':>7} {'req/s':>6} {'tok/s':>6} "
          f"{'TTFT p50/p90/p99':>18} {'ITL p50/p90/p99':>17} {'e2e p50':>7} {'offl tok/s':>10} {'srv/offl':>8}")
    for r in result["levels"]:
        t, i = r["ttft_ms"], r["itl_ms"]
        off = r.get("offline", {})
        print(f"{r['concurrency']:>4} {str(r['completed']) + '/' + str(r['requests_planned']):>6} {r['failed']:>4} "
              f"{r['wall_s']:>7.1f} {r['req_s']:>6.2f} {r['out_tok_s']:>6.1f} "
              f"{f(t['p50']) + '/' + f(t['p90']) + '/' + f(t['p99']):>18} "
              f"{f(i['p50']) + '/' + f(i['p90']) + '/' + f(i['p99']):>17} {f(r['e2e_ms']['p50']):>7} "
              f"{f(off.get('tok_s'), '.1f'):>10} {f(r.get('ratio_server_vs_offline'), '.2f'):>8}")
    kv = result["kv_after"]
    print(f"after the run: KV integrity {'ok' if kv['integrity_ok'] else 'FAILED: ' + str(kv['integrity_error'])}, "
          f"pages used {kv['pages_used']} (cached {kv['pages_cached']}), unfinished requests "
          f"{kv['unfinished_requests']}, preemptions {kv['preemptions']}")
    print(f"wrote {out}")
