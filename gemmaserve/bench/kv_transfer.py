"""`gemmaserve bench kv-transfer`: what disaggregated serving moves, and what it costs end to end.

1. Bytes per request (no weights, no processes): for each model shape and prompt length, the KV a
   prefill engine sends its decode engine, from the same code path the engine uses (the KV
   manager's layer groups -> transfer/plan.py), V2 (sliding layers send their window tail) against
   V1 (every layer sends every token), with the V2 bytes split into full and sliding layers.
2. End to end (`--e2e`, CPU): a prefill engine, a decode engine and the router as separate
   processes on loopback, against one engine (`serve`, role both), same model and requests,
   streamed: time to first token and to the last one, per request, medians.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from datetime import date
from pathlib import Path

import torch

from ..config.options import format_bytes, positive_int
from ..kv import KVCacheManagerV1, KVCacheManagerV2
from ..models.embedded import DEFAULT_MODEL
from ..testing.shapes import SHAPES, parse_shapes_and_lengths
from ..transfer.plan import plan_transfer

DEFAULT_SHAPES = "gemma3-27b,gemma4-31b"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help=f"model shapes (known: {', '.join(SHAPES)})")
    parser.add_argument("--lengths", default="8192,32768,131072", help="prompt lengths in tokens")
    parser.add_argument("--e2e", action="store_true", help="also time disaggregated requests against one engine")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="model of the end-to-end run")
    parser.add_argument("--prompt-tokens", type=positive_int, default=512, help="end to end: prompt length (about)")
    parser.add_argument("--max-tokens", type=positive_int, default=16, help="end to end: tokens generated")
    parser.add_argument("--requests", type=positive_int, default=5, help="end to end: requests (one at a time)")
    parser.add_argument("--runtime", choices=["auto", "nixl", "torch"], default="auto", help="KV transfer runtime")
    parser.add_argument("--out", default="bench-out/kv_transfer.json", help="JSON output")


def transfer_bytes(shape: str, length: int, page_size: int = 16) -> dict:
    specs = SHAPES[shape].layer_specs(torch.bfloat16)
    v2 = plan_transfer(KVCacheManagerV2(specs, page_size, 4096, enable_prefix_caching=False).groups, length)
    v1 = plan_transfer(KVCacheManagerV1(specs, page_size, 64).groups, length)
    full = sum(b for s, b in zip(v2.spans, v2.span_bytes(specs)) if specs[s.layer].window is None)
    v2_bytes, v1_bytes = v2.nbytes(specs), v1.nbytes(specs)
    return {"shape": shape, "tokens": length, "v1_bytes": v1_bytes, "v2_bytes": v2_bytes, "v2_full_layers": full,
            "v2_sliding_layers": v2_bytes - full, "saved": round(1 - v2_bytes / v1_bytes, 4),
            "kv_layers": len(v2.spans), "kv_shared_layers": len(specs) - len(v2.spans)}


# -- end to end --------------------------------------------------------------------------------------
def _start(args: list[str], logs: Path) -> tuple[subprocess.Popen, int]:
    """`gemmaserve ARGS --port 0`, its stderr in a file under `logs` (a pipe nobody drains would block it)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    role = args[args.index("--role") + 1] if "--role" in args else args[0]
    log = logs / f"{role}-{time.monotonic_ns()}.log"
    proc = subprocess.Popen([sys.executable, "-m", "gemmaserve", *args, "--port", "0"], stderr=log.open("w"),
                            stdout=subprocess.DEVNULL, env=env)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        m = re.search(r"Uvicorn running on http://[\d.]+:(\d+)", log.read_text())
        if m:
            return proc, int(m.group(1))
        if proc.poll() is not None:
            raise RuntimeError(f"`gemmaserve {' '.join(args)}` exited; see {log}")
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"server did not start; see {log}")


def _ready(port: int) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"server on port {port} not ready")


def _timed(port: int, prompt: str, max_tokens: int) -> tuple[float, float, str]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    start = time.perf_counter()
    first, text = None, []
    try:
        resp = urllib.request.urlopen(req, timeout=600)
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"HTTP {exc.code} from port {port}: {exc.read().decode()[:500]}") from None
    with resp:
        for line in resp:
            if not line.startswith(b"data: {"):
                continue
            choices = json.loads(line[6:])["choices"]
            if choices and choices[0]["text"]:
                first = first or time.perf_counter() - start
                text.append(choices[0]["text"])
    return first or float("nan"), time.perf_counter() - start, "".join(text)


def end_to_end(args: argparse.Namespace) -> dict:
    engine = ["--model", args.model, "--max-num-seqs", "4"]
    prompt = " ".join(f"word{i % 97}" for i in range(args.prompt_tokens // 2))
    procs = []
    logs = Path(tempfile.mkdtemp(prefix="gemmaserve-kv-transfer-"))   # the servers' stderr, for a failed run
    print(f"server logs: {logs}", flush=True)
    try:
        single, sport = _start(["serve", *engine], logs)
        procs.append(single)
        _ready(sport)
        transfer = ["--kv-transfer-runtime", args.runtime]
        pre, pport = _start(["serve", "--role", "prefill", *engine, *transfer], logs)
        dec, dport = _start(["serve", "--role", "decode", *engine, *transfer], logs)
        procs += [pre, dec]
        _ready(pport)
        _ready(dport)
        router, rport = _start(["router", "--prefill", f"http://127.0.0.1:{pport}", "--decode",
                                f"http://127.0.0.1:{dport}"], logs)
        procs.append(router)
        _ready(rport)
        with urllib.request.urlopen(f"http://127.0.0.1:{dport}/disagg/info") as r:
            info = json.loads(r.read())
        rows = {"single": [], "disaggregated": []}
        texts = {}
        for i in range(args.requests + 1):   # the first of each is a warm-up
            for name, port in (("single", sport), ("disaggregated", rport)):
                ttft, total, text = _timed(port, f"{i} {prompt}", args.max_tokens)
                texts.setdefault(i, {})[name] = text
                if i:
                    rows[name].append((ttft, total))
        with urllib.request.urlopen(f"http://127.0.0.1:{dport}/disagg/info") as r:
            stats = json.loads(r.read())["stats"]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    out = {"model": args.model, "prompt_chars": len(prompt), "max_tokens": args.max_tokens,
           "requests": args.requests, "runtime": info["runtime"], "kv_manager": info["kv_manager"],
           "same_text": all(t["single"] == t["disaggregated"] for t in texts.values()),
           "transfers": stats["transfers"], "bytes_per_request": stats["bytes"] // max(1, stats["transfers"]),
           "transfer_ms_per_request": round(1000 * stats["seconds"] / max(1, stats["transfers"]), 2)}
    for name, vals in rows.items():
        out[f"{name}_ttft_ms"] = round(1000 * statistics.median(v[0] for v in vals), 1)
        out[f"{name}_total_ms"] = round(1000 * statistics.median(v[1] for v in vals), 1)
    return out


def run(args: argparse.Namespace) -> int:
    shapes, lengths = parse_shapes_and_lengths(args.shapes, args.lengths)
    result = {"benchmark": "kv-transfer", "date": date.today().isoformat(),
              "bytes": [transfer_bytes(s, n) for s in shapes for n in lengths]}
    print(f"{'shape':<12}{'tokens':>8}{'V1 sends':>12}{'V2 sends':>12}{'(full':>12}{'+ sliding)':>12}{'saved':>8}")
    for r in result["bytes"]:
        print(f"{r['shape']:<12}{r['tokens']:>8}{format_bytes(r['v1_bytes']):>12}{format_bytes(r['v2_bytes']):>12}"
              f"{format_bytes(r['v2_full_layers']):>12}{format_bytes(r['v2_sliding_layers']):>12}{r['saved']:>8.1%}")
    if args.e2e:
        e2e = end_to_end(args)
        result["end_to_end"] = e2e
        print(json.dumps(e2e, indent=2))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0
