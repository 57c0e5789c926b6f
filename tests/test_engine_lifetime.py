"""An engine owns its lifetime (issue 44): `del` frees it at once, without the garbage collector (no reference
cycle keeps it, its runner or its KV cache), `close()` and `with` free its memory even while the object is still
referred to, and a closed engine says so."""

from __future__ import annotations

import copy
import gc
import os
import subprocess
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from gemmaserve import LLM, SamplingParams
from gemmaserve.hostmem import release_freed_memory
from gemmaserve.config.engine import EngineConfig
from gemmaserve.config.kv_transfer import KVTransferConfig
from gemmaserve.engine.llm_engine import EngineClosedError, LLMEngine

from helpers import fresh_seed, save_checkpoint, tiny_hf_model

KV_BYTES = 128 << 20   # touched in full: a leaked cache shows in the process's RSS
RSS_SLACK = 40 << 20   # allocator noise (a leak is KV_BYTES per engine)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
REGEX = {"kind": "regex", "spec": "(ab|cd)+x"}
PROMPTS = ["abc def abc def abc", "the cat sat on the mat"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny Gemma 3 checkpoint and, where PEFT is installed, a LoRA adapter of it (`lora/`)."""
    root = tmp_path_factory.mktemp("lifetime")
    hf = tiny_hf_model(fresh_seed())
    save_checkpoint(hf, root / "base")
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        return root
    torch.manual_seed(fresh_seed())
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(copy.deepcopy(hf), cfg).eval().save_pretrained(root / "lora")
    return root


@pytest.fixture
def no_gc() -> Iterator[None]:
    """The garbage collector off: what `del` frees here, reference counting freed."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.collect()


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _held(engine: LLMEngine) -> list[weakref.ref]:
    """Weak references to the engine, its runner and every KV cache tensor."""
    return [weakref.ref(engine), weakref.ref(engine._runner)] + [weakref.ref(t) for kv in engine._runner.kv_cache
                                                                  for t in kv]


def _plain(root: Path, **options) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(root / "base"), dtype="float32", page_size=4, kv_cache_memory=KV_BYTES,
                                  cpu_compile="off", **options))


def _speculative(root: Path) -> LLMEngine:
    engine = _plain(root, enable_prefix_caching=True, speculative_config=NGRAM)
    _generate(engine, SamplingParams(max_tokens=6, temperature=0))
    return engine


def _lora(root: Path) -> LLMEngine:
    engine = _plain(root, lora_modules={"a": str(root / "lora")})
    _generate(engine, SamplingParams(max_tokens=3), lora="a")
    return engine


def _prefill_handoff(root: Path) -> LLMEngine:
    """A disaggregated prefill engine: its handoff is a KV connector and a step observer (engine -> handoff)."""
    from gemmaserve.engine.connectors.kv_handoff import PrefillHandoff
    from gemmaserve.transfer.torch_runtime import TorchSource

    engine = _plain(root, kv_transfer=KVTransferConfig(role="prefill", kv_transfer_runtime="torch"))
    PrefillHandoff(engine, TorchSource(torch.device("cpu")), timeout=30, engine_id="p")
    _generate(engine, SamplingParams(max_tokens=2))
    return engine


def _decode_handoff(root: Path) -> LLMEngine:
    from gemmaserve.engine.connectors.kv_handoff import DecodeHandoff

    engine = _plain(root, kv_transfer=KVTransferConfig(role="decode", kv_transfer_runtime="torch"))
    DecodeHandoff(engine)
    _generate(engine, SamplingParams(max_tokens=2))
    return engine


def _compiled_in_process(root: Path) -> LLMEngine:
    """In-process compiled decode steps (`--cpu-compile on` where packages cannot be built), set up as the runner
    does, without the minutes of compiling (the test stubs `CompiledDecode.compile`): Dynamo keeps every backend
    it is given for the process's life."""
    from gemmaserve.engine.compile.compiled_decode import CompiledDecode

    engine = _plain(root)
    engine._runner.compile_decode(required=True)
    assert isinstance(engine._runner.compiled, CompiledDecode)
    _generate(engine, SamplingParams(max_tokens=2))   # its graphs are not ready: steps run eagerly
    return engine


def _generate(engine: LLMEngine, params: SamplingParams, lora: str | None = None) -> None:
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(prompt, params, request_id=str(i), lora=lora)
    while engine.has_unfinished_requests():
        engine.step()


def test_dropped_engines_free_their_memory_at_once(model_dir, no_gc, monkeypatch):
    """Engines of every kind that once kept themselves alive in a reference cycle (or in Dynamo's list of
    backends) are created and dropped in a loop with the garbage collector off: each engine, its runner and
    its KV cache go at `del`, and the process's RSS comes back to where it was before the engine."""
    from gemmaserve.engine.compile.compiled_decode import CompiledDecode

    monkeypatch.setattr(CompiledDecode, "compile", lambda self: None)
    builds: list[Callable[[Path], LLMEngine]] = [_plain, _speculative, _lora, _prefill_handoff, _decode_handoff,
                                                 _compiled_in_process, _plain]
    baseline = None
    for build in builds:
        if build is _lora and not (model_dir / "lora").is_dir():
            continue   # no PEFT to write the adapter
        # Free heap pages go back to the system first: in a process that ran other tests (an xdist worker), the
        # KV cache would otherwise be carved out of memory that is already resident, and RSS would not show it.
        release_freed_memory()
        before = _rss()
        engine = build(model_dir)
        for kv in engine._runner.kv_cache:   # every page resident
            torch._foreach_zero_(list(kv))
        held, peak = _held(engine), _rss()
        del kv
        del engine
        alive = [i for i, ref in enumerate(held) if ref() is not None]
        assert not alive, f"{build.__name__}: still alive after del: " + \
            ", ".join({0: "the engine", 1: "its runner"}.get(i, "KV cache tensors") for i in alive[:3])
        release_freed_memory()
        after = _rss()
        if baseline is None:   # the first engine imports and warms up what stays for the process
            baseline = after
        assert peak - before > KV_BYTES * 9 // 10, "the KV cache did not show in RSS: this test measures nothing"
        assert after - baseline < RSS_SLACK, \
            f"{build.__name__}: RSS {(after - baseline) >> 20} MiB above the first dropped engine's"


def test_the_first_engine_of_a_process_is_freed_at_del(model_dir):
    """A fresh process, as a notebook's first `LLM(...)`: building it imports torch's compiler for the first time
    (the CPU kernels), whose import leaves frames in a reference cycle; that must not hold the engine."""
    probe = ("import gc, sys, weakref\n"
             "from gemmaserve import LLM, SamplingParams\n"
             "def main():\n"
             "    gc.disable()\n"
             "    llm = LLM(sys.argv[1], dtype='float32', page_size=4, kv_cache_memory=8 << 20)\n"
             "    llm.generate(['abc def'], SamplingParams(max_tokens=2))\n"
             "    held = [weakref.ref(llm.engine)] + [weakref.ref(t) for kv in llm.engine._runner.kv_cache for t in kv]\n"
             "    del llm\n"
             "    print('ALIVE', sum(ref() is not None for ref in held))\n"
             "    gc.enable()\n"
             "main()\n")
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, "-c", probe, str(model_dir / "base")], capture_output=True, text=True,
                         timeout=300, env=env, cwd=repo)
    assert "ALIVE 0" in res.stdout, (res.stdout + res.stderr)[-3000:]


def test_with_block_closes_the_engine(model_dir):
    """At the end of `with LLM(...) as llm:` the KV cache, the runner and the grammar threads are gone although
    `llm` still refers to the engine, and using it says it is closed."""
    before = set(threading.enumerate())
    with LLM(str(model_dir / "base"), dtype="float32", page_size=4, kv_cache_memory=8 << 20) as llm:
        out = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4, structured_output=REGEX))
        assert out[0].outputs[0].text
        held = _held(llm.engine)[1:]
        pool = [t for t in set(threading.enumerate()) - before if t.name.startswith("gemmaserve-grammar_")]
        assert pool
        grammars = llm.engine._grammars
    # Its CPU mask kernel builds on a thread that close() leaves to end by itself: not at interpreter exit.
    grammars.wait_for_kernel(timeout=300)
    assert llm.engine.closed and all(ref() is None for ref in held)
    assert not any(t.is_alive() for t in pool)
    with pytest.raises(EngineClosedError, match="engine is closed"):
        llm.generate(PROMPTS, SamplingParams(max_tokens=2))
    with pytest.raises(EngineClosedError, match="engine is closed"):
        llm.chat([{"role": "user", "content": "hi"}])
    with pytest.raises(EngineClosedError, match="engine is closed"):
        llm.engine.add_request("abc", SamplingParams(max_tokens=2))
    with pytest.raises(EngineClosedError, match="engine is closed"):
        llm.engine.step()


def test_close_is_idempotent_and_ends_what_runs(model_dir):
    """close() with a stream half read (speculation, a LoRA adapter and a grammar in use): the stream ends, and
    closing again (or shutting its workers down) changes nothing; the engine's description stays readable."""
    lora = (model_dir / "lora").is_dir()
    llm = LLM(str(model_dir / "base"), dtype="float32", page_size=4, kv_cache_memory=8 << 20,
              speculative_config=NGRAM, enable_prefix_caching=True,
              lora_modules={"a": str(model_dir / "lora")} if lora else None)
    stream = llm.stream(PROMPTS, SamplingParams(max_tokens=12, structured_output=REGEX),
                        lora="a" if lora else None)
    next(stream)
    held = _held(llm.engine)[1:]
    info = llm.engine.info
    llm.close()
    assert all(ref() is None for ref in held)
    assert len(list(stream)) < len(PROMPTS)   # what the last step returned, then the stream ends
    llm.close()
    llm.engine.close()
    llm.engine.shutdown()
    assert llm.engine.info == info and not llm.engine.has_unfinished_requests()
    assert llm.engine.abort_request("llm1-0") == []


def test_a_cuda_kv_budget_counts_what_the_allocator_caches(monkeypatch):
    """The KV cache of an engine dropped in this process goes back to PyTorch's allocator, which keeps it
    cached: the next engine's budget counts it as free (it was 'no GPU memory left for the KV cache')."""
    gib = 1 << 30
    cached = {"bytes": 70 * gib}
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: cached.update(bytes=0))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (78 * gib - cached["bytes"], 80 * gib))
    assert EngineConfig().kv_budget_bytes(torch.device("cuda")) > 60 * gib
