"""Decode steps compiled ahead of time (engine/compile/aot_decode.py, build_job.py; engine/aot_builder.py): built by a background process
while the engine steps eagerly, switched to between two steps without changing a running request's
tokens, kept in the cache directory and loaded in well under a second by later engines; a package
gives the eager step's logits bit for bit at every batch size it takes."""

import copy
import json
import logging
import time

import pytest
import torch

from gemmaserve import LLM, SamplingParams
from gemmaserve.config.engine import EngineConfig
from gemmaserve.engine.compile import aot_decode
from gemmaserve.engine.compile.build_job import BuildJob
from gemmaserve.engine.compile.compiled_decode import unavailable

from helpers import save_checkpoint, tiny_hf_model

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))

PARAMS = SamplingParams(max_tokens=6, temperature=0, logprobs=2, ignore_eos=True)
WORDS = "the cat sat on a mat by the door again".split()


def _out(llm: LLM, prompts: list[str], params: SamplingParams = PARAMS) -> list:
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)]


def _package_runs(mp: pytest.MonkeyPatch, llm: LLM, key=lambda ids, md, graph: (len(ids), graph)) -> list:
    """From now on (until `mp` undoes it), `key` of every decode step `llm`'s packages computed: its rows, its
    metadata and the graph that took it (its static rows, None: the dynamic one). A step no package takes runs
    eagerly (`run` gives None) and is not counted, so an engine that silently stays eager counts nothing."""
    compiled = llm.engine._runner.compiled
    assert isinstance(compiled, aot_decode.AotDecode), compiled
    run, seen = compiled.run, []

    def counted(ids, pos, md):
        out = run(ids, pos, md)
        if out is not None:
            seen.append(key(ids, md, compiled._size_for(len(ids))))
        return out

    mp.setattr(compiled, "run", counted)
    return seen


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A tiny checkpoint whose packages a real background build made, the engine that switched to them
    mid-request, and what that request generated (against an eager engine's)."""
    root = tmp_path_factory.mktemp("aot")
    # 3 layers (a sliding and a full kind): a smaller graph to compile, ~3x faster than the usual 7
    hf = tiny_hf_model(7, vocab_size=320, sliding_window=6, num_hidden_layers=3,
                       layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    path = save_checkpoint(hf, root / "tiny")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GEMMASERVE_CACHE_DIR", str(root / "cache"))
        mp.setenv("GEMMASERVE_BACKGROUND_COMPILE", "1")
        # the requests below keep both cores busy until the switch: an idle-time builder would barely move
        mp.setenv("GEMMASERVE_BUILDER_PRIORITY", "normal")
        # auto compiles quantised weights only (a GGUF file's): here the tiny fp32 model stands in
        mp.setattr(EngineConfig, "cpu_compile_mode", lambda self, device, quantized: "background")
        llm = LLM(model=str(path), max_num_seqs=16)
        eager = LLM.from_config(llm.engine.config.replace(cpu_compile="off"), llm)
        engine = llm.engine
        assert engine.info.cpu_compile == "building" and engine._compiled_steps.build.process is not None
        ran, after = [], 0   # the packages' steps after the switch; engine steps after it
        long = SamplingParams(max_tokens=300, temperature=0, logprobs=1, ignore_eos=True)
        deadline = time.monotonic() + 900
        spanning = None
        while spanning is None:   # requests one after another until one is running when the switch comes
            assert time.monotonic() < deadline, "the background build did not finish"
            rid = engine.add_request("the river valley is long " * 3, long)
            outputs, before = [], engine.info.cpu_compile
            while engine.has_unfinished_requests():
                outputs += engine.step()
                after += spanning is not None
                if before == "building" and engine.info.cpu_compile == "ready" and spanning is None:
                    spanning = rid
                    ran = _package_runs(mp, llm)
            assert engine.info.cpu_compile in ("building", "ready"), engine.info.cpu_compile
        final = [o for o in outputs if o.finished][-1].outputs[0]
        want = eager.generate(["the river valley is long " * 3], long)[0].outputs[0]
        store = engine._compiled_steps.store()
    # (the patches end here: no other engine of this module starts a build)
    return dict(path=path, root=root, hf=hf, llm=llm, eager=eager, ran=ran, after=after, store=store,
                spanning=(final.token_ids, final.logprobs), want=(want.token_ids, want.logprobs))


def test_a_background_build_switches_between_steps_without_changing_tokens(built):
    """The request running when the engine switched got the eager engine's tokens and logprobs, bit for
    bit, and its steps after the switch ran the packages."""
    assert built["spanning"] == built["want"]
    assert built["after"] > 0 and built["ran"] == [(1, 1)] * built["after"]   # every step after it: the 1-row graph
    manifest = json.loads((built["store"] / "manifest.json").read_text())
    assert set(manifest["graphs"]) == {"rows1", "rows8", "dynamic"}
    shims = bool(aot_decode.shim_configs())   # the ops' C shims where this torch takes them: no proxy-executor call
    assert all(g["shims"] == shims and (g["proxy_calls"] == 0) == shims for g in manifest["graphs"].values()), manifest
    assert not built["store"].with_name(built["store"].name + ".lock").exists()   # the builder cleaned up


@pytest.mark.parametrize("n", [1, 3, 8, 9, 20])
def test_packages_give_the_eager_steps_bits(built, n, monkeypatch):
    """The static graph of 1 row, the 8-row one and the dynamic one (every other batch), for every decode step
    (20 prompts: 16 at a time, max_num_seqs)."""
    prompts = [f"{w} " * (2 + i) for i, w in enumerate((WORDS * 2)[:n])]
    runs = _package_runs(monkeypatch, built["llm"])
    assert _out(built["llm"], prompts) == _out(built["eager"], prompts)
    assert sum(rows for rows, _ in runs) == (PARAMS.max_tokens - 1) * n, runs
    assert {graph for _, graph in runs} == ({n} if n in (1, 8) else {None}), runs


def test_a_later_engine_loads_the_packages_at_once(built, monkeypatch, caplog):
    """A later start finds the packages under its key: loaded before its first step, no build."""
    caplog.set_level(logging.INFO)
    monkeypatch.setenv("GEMMASERVE_CACHE_DIR", str(built["root"] / "cache"))
    monkeypatch.setattr(aot_decode, "build", lambda *a: pytest.fail("built again"))
    monkeypatch.setattr(BuildJob, "start", lambda *a: pytest.fail("a background build started"))
    start = time.perf_counter()
    llm = LLM.from_config(built["llm"].engine.config.replace(cpu_compile="on"), built["llm"])
    assert llm.engine.info.cpu_compile == "ready" and llm.engine._runner.compiled.load_seconds < 5
    assert time.perf_counter() - start < 30
    assert "loaded from" in caplog.text
    runs = _package_runs(monkeypatch, llm)
    assert _out(llm, ["hello world"]) == _out(built["eager"], ["hello world"])
    assert runs == [(1, 1)] * (PARAMS.max_tokens - 1)


def test_verification_steps_run_the_packages_and_keep_every_token(built, monkeypatch):
    """A speculating engine loads the same packages (speculation is not in their key) and runs its
    verification steps through them as one decode row per token: tokens and logprobs are the eager
    non-speculative engine's, with drafts accepted and rejected."""
    from gemmaserve.testing.replay_drafts import ReplayDrafts

    monkeypatch.setenv("GEMMASERVE_CACHE_DIR", str(built["root"] / "cache"))
    monkeypatch.setattr(BuildJob, "start", lambda *a: pytest.fail("a background build started"))
    spec = {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 8}
    llm = LLM.from_config(built["llm"].engine.config.replace(cpu_compile="on", speculative_config=spec), built["llm"])
    assert llm.engine.info.cpu_compile == "ready"
    rows = _package_runs(monkeypatch, llm, lambda ids, md, graph: (len(ids), max(md.new_before or [0])))
    prompts = [f"{w} " * (3 + i) for i, w in enumerate(WORDS[:5])]
    params = SamplingParams(max_tokens=20, temperature=0, logprobs=2, ignore_eos=True)
    want = built["eager"].generate(prompts, params)
    sched = llm.engine._scheduler
    sched.proposer = ReplayDrafts(4, {tuple(o.prompt_token_ids): o.outputs[0].token_ids for o in want}, 0.6,
                                  llm.engine._model.vocab_size)
    sched.misses_before_pause = 1 << 30
    assert _out(llm, prompts, params) == [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in want]
    st = sched.spec_stats
    assert 0 < st.accepted < st.drafted and st.accepted_at[3] > 0, st
    assert (25, 4) in rows   # 5 sequences of 5 rows: the dynamic graph


def test_adapter_rows_run_eagerly_beside_compiled_base_steps(built, monkeypatch, tmp_path):
    """cpu_compile auto with the packages in the cache and a LoRA adapter (the packages hold the base model only):
    requests with the adapter get PEFT's greedy tokens, not the base's, alone and in one batch with base requests;
    base requests get the eager engine's tokens and logprobs; a step with adapter rows runs eagerly, and every
    decode step of base rows alone runs the packages."""
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model

    monkeypatch.setenv("GEMMASERVE_CACHE_DIR", str(built["root"] / "cache"))
    monkeypatch.setattr(EngineConfig, "cpu_compile_mode", lambda self, device, quantized: "background")
    monkeypatch.setattr(BuildJob, "start", lambda *a: pytest.fail("a background build started"))
    hf = built["hf"]
    torch.manual_seed(11)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft_model = get_peft_model(copy.deepcopy(hf), LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                                              init_lora_weights=False)).eval()
    peft_model.save_pretrained(tmp_path / "a")
    config = built["llm"].engine.config
    assert config.cpu_compile == "auto"
    llm = LLM.from_config(config.replace(lora_modules={"a": str(tmp_path / "a")}), built["llm"])
    runner = llm.engine._runner
    assert llm.engine.info.cpu_compile == "ready"
    steps: list[tuple[bool, bool, bool]] = []   # per forward: adapter rows?, decode only?, ran the packages?
    packaged = _package_runs(monkeypatch, llm)   # the decode steps the packages computed
    run_model = runner.run_model

    def watched(seqs, *args, **kwargs):
        before = len(packaged)
        out = run_model(seqs, *args, **kwargs)
        steps.append((any(s.lora_slot >= 0 for s in seqs), all(s.num_new_tokens == 1 for s in seqs),
                      len(packaged) > before))
        return out

    runner.run_model = watched
    prompts = [f"{w} " * (3 + i) for i, w in enumerate(WORDS[:4])]
    names = ["a", None, "a", None]
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=2, ignore_eos=True)

    def out(o):
        return o.outputs[0].token_ids, o.outputs[0].logprobs

    alone = [out(llm.generate([p], params, lora=n)[0]) for p, n in zip(prompts, names)]
    mixed = [out(o) for o in llm.generate(prompts, params, lora=names)]
    assert mixed == alone
    base = [out(o) for o in built["eager"].generate(prompts, params)]
    for p, n, (tokens, logprobs), want in zip(prompts, names, alone, base):
        if n is None:
            assert (tokens, logprobs) == want
            continue
        ids = llm.tokenizer.encode(p)
        with torch.no_grad():
            peft_tokens = peft_model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, pad_token_id=0,
                                              eos_token_id=[])[0, len(ids):].tolist()
        assert tokens == peft_tokens and tokens != want[0], (p, tokens, want[0])
    assert not any(ran for lora, _, ran in steps if lora), steps
    base_decode = [ran for lora, decode, ran in steps if decode and not lora]
    assert base_decode and all(base_decode), steps
    assert any(lora and decode for lora, decode, _ in steps)   # adapter decode steps were there to run eagerly


def test_other_options_have_other_packages(built, monkeypatch):
    """The key covers the KV layout: another page size is another store (built anew, never misread)."""
    monkeypatch.setenv("GEMMASERVE_CACHE_DIR", str(built["root"] / "cache"))
    other = LLM.from_config(built["llm"].engine.config.replace(cpu_compile="off", page_size=8), built["llm"])
    assert other.engine._compiled_steps.store() != built["store"]
    same = LLM.from_config(built["llm"].engine.config.replace(cpu_compile="off", max_num_seqs=3), built["llm"])
    assert same.engine._compiled_steps.store() == built["store"]   # the batch limit is not in the graphs


def test_damaged_packages_are_dropped_and_said(built, monkeypatch, caplog, tmp_path):
    """A store whose constants no longer name model tensors (stale code, a damaged file): not loaded,
    removed, logged; the engine steps eagerly (and would build anew)."""
    import shutil

    monkeypatch.setenv("GEMMASERVE_CACHE_DIR", str(tmp_path))
    copy = tmp_path / "decode-graphs" / built["store"].name
    shutil.copytree(built["store"], copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    graph = next(iter(manifest["graphs"].values()))
    graph["constants"][next(iter(graph["constants"]))] = "model.no.such.tensor"
    (copy / "manifest.json").write_text(json.dumps(manifest))
    monkeypatch.setattr(EngineConfig, "cpu_compile_mode", lambda self, device, quantized: "background")
    llm = LLM.from_config(built["llm"].engine.config, built["llm"])   # (GEMMASERVE_BACKGROUND_COMPILE=0: no build)
    assert llm.engine._compiled_steps.store() == copy
    assert "do not load" in caplog.text and not copy.exists()
    assert llm.engine._runner.compiled is None   # eager
    assert _out(llm, ["hello world"]) == _out(built["eager"], ["hello world"])


def test_a_failed_build_is_reported_and_a_second_engine_follows_the_first(tmp_path):
    """The builder's failure reaches the engine with its log; a second engine of the same key does not
    start a second builder while the first runs."""
    directory = tmp_path / "decode-graphs" / "k"
    first = BuildJob.start({"model": str(tmp_path / "missing")}, directory)
    second = BuildJob.start({"model": str(tmp_path / "missing")}, directory)
    assert first.process is not None and second.process is None
    deadline = time.monotonic() + 120
    while (outcome := first.poll()) is None:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert "exited with 1" in outcome and str(first.log_path) in outcome
    assert "neither a known alias" in first.log_path.read_text()
    assert second.poll() and not directory.exists()


def test_the_builder_runs_on_idle_time_even_in_a_session_of_its_own():
    """The builder leads a session of its own; with Linux's autogroups that session is scheduled as a peer of
    the engine's (half the CPU each, whatever the nice inside): a 270M decode step took 20x longer beside it.
    It must lower its group and take the idle policy, before importing torch."""
    import subprocess
    import sys

    probe = ("import os, sys; from gemmaserve.engine.aot_builder import idle_priority; idle_priority(); "
             "group = open('/proc/self/autogroup').read().split()[-1] if os.path.exists('/proc/self/autogroup') "
             "else '19'; print(os.sched_getscheduler(0) == os.SCHED_IDLE, os.nice(0), group, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, start_new_session=True,
                         check=True).stdout.split()
    assert out == ["True", "19", "19", "False"], out


def test_an_interrupted_build_keeps_its_finished_graphs(built, tmp_path, monkeypatch):
    """A builder stopped after its first graph (killed, the machine shut down) leaves that package and a record
    of it; the next build of the same key compiles only the others; a record of another key, or a damaged one,
    keeps nothing. (The compiler is a stand-in here: the exports are real.)"""
    engine = built["llm"].engine
    layout, key = engine._compiled_steps.layout_and_key()
    compiled = []

    def compile_(ep, package, shims):
        compiled.append(package.stem)
        if len(compiled) == 2:
            raise KeyboardInterrupt   # stopped while compiling the second graph
        package.write_bytes(b"a package")
        return True

    monkeypatch.setattr(aot_decode, "_compile", compile_)
    monkeypatch.setattr(aot_decode, "_proxy_calls", lambda package: 0)
    monkeypatch.setattr(aot_decode, "_constant_paths", lambda ep, package, step: {})
    out = tmp_path / "store"
    with pytest.raises(KeyboardInterrupt):
        aot_decode.build(engine._model, layout, key, out)
    assert compiled == ["rows1", "rows8"] and not out.exists()
    aot_decode.build(engine._model, layout, key, out)
    assert compiled == ["rows1", "rows8", "rows8", "dynamic"]
    assert set(json.loads((out / "manifest.json").read_text())["graphs"]) == {"rows1", "rows8", "dynamic"}
    assert sorted(p.name for p in out.iterdir()) == ["dynamic.pt2", "manifest.json", "rows1.pt2", "rows8.pt2"]
    assert not out.with_name(out.name + ".tmp").exists()

    # a record of another key (other code, torch or weights) keeps nothing; a damaged one neither
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "rows1.pt2").write_bytes(b"a package")
    (partial / aot_decode.PARTIAL).write_text(json.dumps({"key": key, "graphs": {"rows1": {"rows": 1}}}))
    assert set(aot_decode._finished_graphs(partial, key)) == {"rows1"}
    assert aot_decode._finished_graphs(partial, key | {"torch": "another"}) == {}
    (partial / aot_decode.PARTIAL).write_text('{"key": ')
    assert aot_decode._finished_graphs(partial, key) == {}
