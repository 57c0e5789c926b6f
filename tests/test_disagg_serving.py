"""Disaggregated serving end to end: a prefill and a decode engine as separate processes on loopback,
behind `gemmaserve router` (server/disagg.py has the handshake).

A tiny Gemma 3 with a window of 8 tokens and prompts of 5-7 windows: the prefill engine runs V2 with
scratch reuse (the whole prompt is one chunk, so every out-of-window block is a scratch page), and
only the window tail of its sliding layers may travel."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from helpers import fresh_seed, save_checkpoint, serve_process, tiny_hf_model

WINDOW = 8
ENGINE_ARGS = ("--page-size", "4", "--max-num-batched-tokens", "64", "--kv-cache-memory", "2MiB", "--max-num-seqs", "4")
PROMPTS = [" ".join(f"w{(7 * i + k) % 50}" for i in range(n)) for k, n in ((1, 20), (2, 27))]


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def _post(url: str, body: dict) -> tuple[int, bytes]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _wait_ready(port: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if _get(f"http://127.0.0.1:{port}/health").get("status") == "ok":
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"server on port {port} never became ready")


def _router(prefill: list[int], decode: list[int]):
    import re

    args = [sys.executable, "-m", "gemmaserve", "router", "--port", "0",
            "--prefill", *[f"http://127.0.0.1:{p}" for p in prefill], "--decode", *[f"http://127.0.0.1:{p}" for p in decode]]
    proc = subprocess.Popen(args, stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        m = re.search(r"Uvicorn running on http://127\.0\.0\.1:(\d+)", proc.stderr.readline())
        if m:
            return proc, int(m.group(1))
    proc.kill()
    raise AssertionError("router did not start")


def _stop(*procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
        p.wait(10)
        if p.stderr:
            p.stderr.close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The base checkpoint, and beside it (`adapter/`) a random LoRA adapter saved by PEFT."""
    from peft import LoraConfig, get_peft_model

    seed = fresh_seed()
    hf = tiny_hf_model(seed, sliding_window=WINDOW)
    path = save_checkpoint(hf, tmp_path_factory.mktemp("m"))
    torch.manual_seed(seed + 1)
    get_peft_model(hf, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                  init_lora_weights=False)).save_pretrained(path.parent / "adapter")
    return str(path)


def _adapter(model_dir: str) -> str:
    return str(Path(model_dir).parent / "adapter")


@contextlib.contextmanager
def _start_cluster(*common: str):
    """A prefill engine, a decode engine (both `serve` with `common`) and the router, all ready."""
    prefill, pport = serve_process("--role", "prefill", *common)
    decode, dport = serve_process("--role", "decode", *common)
    router = None
    try:
        _wait_ready(pport)
        _wait_ready(dport)
        router, rport = _router([pport], [dport])
        _wait_ready(rport)
        yield {"prefill": pport, "decode": dport, "router": rport, "procs": (prefill, decode, router)}
    finally:
        _stop(*(p for p in (router, decode, prefill) if p is not None))


@pytest.fixture(scope="module")
def cluster(model_dir):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # 10 s: long enough for a decode engine that compiles a grammar first on a loaded 2-core CI machine
    # (3 s expired a staged transfer once), short enough for the kill test's 20 s wait for cleanup.
    with _start_cluster("--model", model_dir, *ENGINE_ARGS, "--kv-transfer-runtime", "torch",
                        "--kv-transfer-timeout", "10", "--lora-modules", f"ad={_adapter(model_dir)}") as c:
        yield c


@pytest.fixture(scope="module")
def single(model_dir):
    from gemmaserve.config.engine import EngineConfig
    from gemmaserve.engine.llm import LLM

    torch.set_num_threads(1)
    return LLM.from_config(EngineConfig(model=model_dir, page_size=4, max_num_batched_tokens=64,
                                        kv_cache_memory=2 << 20, max_num_seqs=4,
                                        lora_modules={"ad": _adapter(model_dir)}))


def _completion(port: int, prompt: str, stream: bool, max_tokens: int = 12, model: str | None = None) -> str:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if model is not None:
        body["model"] = model
    status, raw = _post(f"http://127.0.0.1:{port}/v1/completions", body)
    assert status == 200, raw
    if not stream:
        return json.loads(raw)["choices"][0]["text"]
    events = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    return "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1] if json.loads(e)["choices"])


def test_greedy_output_equals_a_single_engine(cluster, single):
    from gemmaserve.engine.sampling_params import SamplingParams

    info = _get(f"http://127.0.0.1:{cluster['prefill']}/disagg/info")
    assert (info["kv_manager"], info["swa_scratch_reuse"], info["runtime"]) == ("v2", True, "torch")
    expected = [o.outputs[0].text for o in single.generate(PROMPTS, SamplingParams(max_tokens=12), use_tqdm=False)]
    for prompt, want in zip(PROMPTS, expected):
        assert len(single.engine.inputs.tokenize(prompt)) > 5 * WINDOW
        assert _completion(cluster["router"], prompt, stream=False) == want
        assert _completion(cluster["router"], prompt, stream=True) == want
    # Usage as one engine counts it: the prompt once, every generated token (the prefill engine's first one too).
    ids = single.engine.inputs.tokenize(PROMPTS[1])
    for stream in (False, True):
        body = {"prompt": PROMPTS[1], "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": stream,
                "stream_options": {"include_usage": True} if stream else None}
        status, raw = _post(f"http://127.0.0.1:{cluster['router']}/v1/completions", body)
        assert status == 200, raw
        if stream:
            events = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]
            raw = [e for e in events[:-1] if json.loads(e).get("usage")][-1]
        usage = json.loads(raw)["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(ids), 12), usage
    status, raw = _post(f"http://127.0.0.1:{cluster['router']}/v1/chat/completions",
                        {"messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 4})
    assert status == 200 and json.loads(raw)["choices"][0]["message"]["content"], raw
    assert _get(f"http://127.0.0.1:{cluster['router']}/v1/models")["data"][0]["id"]


def test_an_adapter_runs_on_both_roles_and_its_kv_stays_its_own(cluster, single):
    """A request for a LoRA adapter through the router: the prefill engine computes the prompt under it, the
    decode engine checks it serves the same adapter (name and weights' digest) and decodes under it: the single
    engine's tokens for that adapter, which differ from the base's. The base's tokens for the same prompt
    right after are the base's (no KV crossed adapters on either side)."""
    from gemmaserve.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=12)
    want = single.generate([PROMPTS[0]], params, use_tqdm=False, lora="ad")[0].outputs[0].text
    base = single.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0].text
    assert want != base
    assert _completion(cluster["router"], PROMPTS[0], stream=False, model="ad") == want
    assert _completion(cluster["router"], PROMPTS[0], stream=True, model="ad") == want
    assert _completion(cluster["router"], PROMPTS[0], stream=False) == base


def test_grammars_penalties_and_seeds_continue_on_the_decode_engine(cluster, single):
    """The decode engine's grammar, penalty counts and seeded generator start after the token the prefill
    engine sampled."""
    pytest.importorskip("xgrammar")
    from gemmaserve.engine.sampling_params import SamplingParams
    from gemmaserve.engine.structured.structured_output import StructuredOutput

    schema = {"type": "object", "properties": {"w": {"enum": ["w1", "w22"]}, "n": {"type": "integer"}},
              "required": ["w", "n"], "additionalProperties": False}
    for extra, params in (
            ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}},
             SamplingParams(max_tokens=16, structured_output=StructuredOutput.json_schema(schema))),
            ({"presence_penalty": 1.5, "frequency_penalty": 1.0},
             SamplingParams(max_tokens=16, presence_penalty=1.5, frequency_penalty=1.0)),
            ({"temperature": 1.0, "top_k": 20, "seed": 77},   # the decode engine's generator skips the first draw
             SamplingParams(max_tokens=16, temperature=1.0, top_k=20, seed=77))):
        want = single.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0].text
        status, raw = _post(f"http://127.0.0.1:{cluster['router']}/v1/completions",
                            {"prompt": PROMPTS[0], "max_tokens": 16, "temperature": 0, **extra})
        assert status == 200, raw
        assert json.loads(raw)["choices"][0]["text"] == want


def test_bytes_per_request_follow_the_window(cluster, single):
    """Full layers send every prompt token, sliding layers the W - 1 tokens the first decode step reads."""
    specs = single.engine._model.kv_layer_specs(torch.float32)
    n = len(single.engine.inputs.tokenize(PROMPTS[1]))
    expected = sum((n if s.window is None else min(n, s.window - 1)) * s.bytes_per_token() for s in specs if s.owns_kv)
    assert expected < n * sum(s.bytes_per_token() for s in specs) / 3   # what V1 would send
    before = _get(f"http://127.0.0.1:{cluster['decode']}/disagg/info")["stats"]
    _completion(cluster["router"], PROMPTS[1], stream=False, max_tokens=2)
    after = _get(f"http://127.0.0.1:{cluster['decode']}/disagg/info")["stats"]
    assert (after["transfers"] - before["transfers"], after["bytes"] - before["bytes"]) == (1, expected)


def test_errors_come_back_in_openai_format(cluster):
    status, raw = _post(f"http://127.0.0.1:{cluster['router']}/v1/completions", {"prompt": "", "max_tokens": 2})
    assert status == 400 and json.loads(raw)["error"]["message"]
    # An engine with a role refuses requests that do not come through the router.
    status, raw = _post(f"http://127.0.0.1:{cluster['decode']}/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert status == 400 and "router" in json.loads(raw)["error"]["message"]


def _kv_clean(port: int, timeout: float = 20) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        info = _get(f"http://127.0.0.1:{port}/disagg/info")
        kv = info["kv"]
        if not kv["running"] and kv["pages_used"] == 0 and info.get("staged", 0) == 0:
            assert kv["integrity"] and kv["pages_free"] + kv["pages_cached"] == kv["num_pages"]
            return info
        assert time.monotonic() < deadline, info
        time.sleep(0.1)


def test_transfer_from_a_dead_prefill_engine_fails_alone(cluster):
    """A decode engine told to fetch from an engine that is gone answers 502 and keeps no page."""
    body = {"prompt": PROMPTS[0], "max_tokens": 4,
            "kv_transfer_params": {"transfer_id": "gone", "prefill_url": "http://127.0.0.1:9"}}
    status, raw = _post(f"http://127.0.0.1:{cluster['decode']}/v1/completions", body)
    assert status == 502 and json.loads(raw)["error"]["code"] == "kv_transfer_failed"
    _kv_clean(cluster["decode"])


def test_the_router_passes_over_engines_that_are_down(cluster):
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = sock.getsockname()[1]   # nothing listens there once closed
    router, rport = _router([dead, cluster["prefill"]], [dead, cluster["decode"]])
    try:
        _wait_ready(rport)   # /health: one engine of each role is enough
        for _ in range(2):   # round robin: each request meets the dead engines first once
            _completion(rport, PROMPTS[0], stream=False, max_tokens=2)
        health = _get(f"http://127.0.0.1:{rport}/health")
        assert health["prefill"][f"http://127.0.0.1:{dead}"] == "unreachable"
    finally:
        _stop(router)


def test_killing_the_decode_engine_mid_request_fails_only_that_request(cluster, model_dir):
    """The router answers an OpenAI error; the prefill engine keeps no page, and what it staged is
    freed within the transfer timeout; the other decode engine goes on serving."""
    common = ("--model", model_dir, *ENGINE_ARGS, "--kv-transfer-runtime", "torch", "--kv-transfer-timeout", "3")
    doomed, port = serve_process("--role", "decode", *common)
    router = None
    try:
        _wait_ready(port)
        router, rport = _router([cluster["prefill"]], [port])
        _wait_ready(rport)
        req = urllib.request.Request(f"http://127.0.0.1:{rport}/v1/completions",
                                     json.dumps({"prompt": PROMPTS[0], "max_tokens": 3000, "stream": True,
                                                 "ignore_eos": True}).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            first = resp.readline()
            assert first.startswith(b"data: "), first
            doomed.send_signal(signal.SIGKILL)
            rest = resp.read().decode()
        events = [json.loads(line[6:]) for line in rest.splitlines() if line.startswith("data: {")]
        assert events and events[-1]["error"]["code"] == "engine_failed"
        _kv_clean(cluster["prefill"])
        _completion(cluster["router"], PROMPTS[0], stream=False, max_tokens=2)   # the rest still serves (200)
    finally:
        _stop(*(p for p in (router, doomed) if p is not None))


def test_nixl_runtime_moves_the_same_bytes(model_dir, single):
    """The NIXL (UCX) runtime on host memory: same output, same bytes as torch.distributed."""
    from gemmaserve.engine.sampling_params import SamplingParams
    from gemmaserve.transfer.runtime import import_nixl

    try:
        import_nixl()
    except ImportError as exc:
        pytest.skip(str(exc))
    # auto: Gemma prefers nixl
    with _start_cluster("--model", model_dir, *ENGINE_ARGS, "--kv-transfer-timeout", "10") as c:
        pport, dport, rport = c["prefill"], c["decode"], c["router"]
        assert _get(f"http://127.0.0.1:{dport}/disagg/info")["runtime"] == "nixl"
        wants = [o.outputs[0].text for o in single.generate(PROMPTS, SamplingParams(max_tokens=12), use_tqdm=False)]
        for prompt, want in zip(PROMPTS, wants):   # a second transfer reads a region registered after the first
            assert _completion(rport, prompt, stream=True) == want
        specs = single.engine._model.kv_layer_specs(torch.float32)
        expected = 0
        for prompt in PROMPTS:
            n = len(single.engine.inputs.tokenize(prompt))
            expected += sum((n if s.window is None else min(n, s.window - 1)) * s.bytes_per_token() for s in specs)
        assert _get(f"http://127.0.0.1:{dport}/disagg/info")["stats"]["bytes"] == expected
        _kv_clean(pport)
