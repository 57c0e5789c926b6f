"""`gemmaserve bench startup`: what a user waits for, from an empty cache and from a warm one.

Every start is a new process with its own cache directory (`GEMMASERVE_CACHE_DIR`) and, for the cold
ones, its own empty inductor cache (`TORCHINDUCTOR_CACHE_DIR`), as on a fresh machine:

    serve, cold   process start -> first `/health` 200 (the weights quantised and cached on the way),
                  and -> the log line saying the compiled decode steps are ready (built in the background)
    serve, warm   the same with both caches filled by the cold run: -> 200, and whether its steps are
                  compiled from the first request
    generate      `LLM()` from the warm caches -> ready (seconds), then its batch-1 decode tokens/s
                  against llama.cpp on the same GGUF file, alternating in the same process
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import date
from pathlib import Path

PROMPT = "The history of the river valley is long. Farmers settled on its banks, built mills and traded grain"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="gemma3-270m", help="model alias or GGUF file (default: the embedded 270M)")
    parser.add_argument("--new-tokens", type=int, default=128, help="decode tokens per generate run")
    parser.add_argument("--repeats", type=int, default=3, help="generate runs (alternating with llama.cpp)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds to wait for a server's build")
    parser.add_argument("--out", default="bench-out/startup.json", help="JSON output path")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(model: str, env: dict, timeout: float, wait_for_compiled: bool) -> dict:
    """Start `gemmaserve serve`, time its first /health 200 and (optionally) its compiled steps."""
    port = _free_port()
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "gemmaserve", "serve", "--model", model, "--port", str(port)],
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    out: dict = {}
    try:
        while "health_200_s" not in out:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited: {Path(log.name).read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        out["health_200_s"] = round(time.perf_counter() - start, 2)
            except OSError:
                time.sleep(0.2)
        deadline = start + timeout
        while True:
            text = Path(log.name).read_text()
            if "compiled CPU decode steps: loaded from" in text or "compiled CPU decode steps ready" in text:
                out["compiled_ready_s"] = round(time.perf_counter() - start, 2)
                break
            if not wait_for_compiled or "the build failed" in text or time.perf_counter() > deadline:
                break
            time.sleep(1)
        found = re.search(r"compiled CPU decode steps: loaded from \S+ in ([0-9.]+) s", text)
        out["compiled_at_start"] = found is not None and "building in the background" not in text
        out["log_lines"] = [line for line in text.splitlines() if "gemmaserve" in line and "compiled" in line][:6]
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return out


def _generate(model: str, env: dict, new_tokens: int, repeats: int) -> dict:
    """A fresh process: LLM() from the warm caches, then batch-1 decode against llama.cpp (alternating)."""
    code = f"""
import json, time, torch
start = time.perf_counter()
from gemmaserve import LLM, SamplingParams
from gemmaserve.bench.decode import _llama_reference, _ours_decode
llm = LLM(model={model!r})
ready = time.perf_counter() - start
out = {{"ready_s": round(ready, 2), "cpu_compile": llm.engine.info.cpu_compile}}
ids = llm.tokenizer.encode({PROMPT!r})
llama = _llama_reference(llm.engine, out)
ours, ref = [], []
for _ in range({repeats}):
    ours.append(_ours_decode(llm, ids, 1, {new_tokens}))
    if llama is not None:
        ctx = llama.batch_context(len(ids) + {new_tokens} + 16, 1)
        ref.append(llama.decode_tok_s(ids, 1, {new_tokens}, ctx))
ours.sort(); ref.sort()
out["ours_tok_s"] = round(ours[len(ours) // 2], 1)
if ref:
    out["llama_cpp_tok_s"] = round(ref[len(ref) // 2], 1)
    out["ratio"] = round(out["ours_tok_s"] / out["llama_cpp_tok_s"], 3)
print("RESULT " + json.dumps(out))
"""
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=3600)
    line = next((x for x in res.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"the generate run failed: {res.stderr[-2000:]}")
    return json.loads(line[len("RESULT "):])


def run(args: argparse.Namespace) -> int:
    root = Path(tempfile.mkdtemp(prefix="gemmaserve-startup-"))
    env = dict(os.environ, GEMMASERVE_CACHE_DIR=str(root / "cache"), TORCHINDUCTOR_CACHE_DIR=str(root / "inductor"),
               GEMMASERVE_BACKGROUND_COMPILE="1")
    result: dict = {"benchmark": "startup", "date": date.today().isoformat(), "model": args.model,
                    "cpus": os.cpu_count(), "cache": str(root)}
    result["serve_cold"] = _serve(args.model, env, args.timeout, wait_for_compiled=True)
    print("serve, cold:", json.dumps(result["serve_cold"]), flush=True)
    result["serve_warm"] = _serve(args.model, env, args.timeout, wait_for_compiled=True)
    print("serve, warm:", json.dumps(result["serve_warm"]), flush=True)
    result["generate_warm"] = _generate(args.model, env, args.new_tokens, args.repeats)
    print("generate, warm:", json.dumps(result["generate_warm"]), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0
