"""LoRA adapters in PEFT's format against transformers + PEFT on tiny random checkpoints saved with
save_pretrained: Gemma 3, and Gemma 4 31B-like (K = V), E2B-like (KV-shared layers own no k/v) and
26B-A4B-like (MoE beside a dense MLP). Logits at every prompt position equal PEFT's (fp32, 1e-4), an adapter
changes them as much as PEFT's does (so "loads and changes nothing" fails), a mixed batch of adapters and the
base gives each request its tokens alone, the prefix cache never serves KV across adapters, and at most
--max-loras adapters run in a step. Bad adapters are clear errors that leave the engine serving."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from gemmaserve import LLM, SamplingParams, UserInputError
from gemmaserve.engine.step import LoRALoad

from helpers import fresh_seed, paged_logits, save_checkpoint, tiny_gemma4_hf, tiny_hf_model

peft = pytest.importorskip("peft")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = ["abc def ghi", "xyz uvw qq rr", "hello", "the cat sat on the mat"]


def _adapter(hf, path, seed: int, **config):
    """PEFT's model over a copy of `hf` with a random adapter (B not zero), saved to `path`."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    cfg = LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": TARGETS, "init_lora_weights": False, **config})
    model = get_peft_model(copy.deepcopy(hf), cfg).eval()
    model.save_pretrained(path)
    return model


def _hf(variant: str, seed: int):
    return tiny_hf_model(seed) if variant == "gemma3" else tiny_gemma4_hf(seed, variant)


def _slot_logits(llm: LLM, name: str | None, ids: list[int], chunk: int = 8) -> torch.Tensor:
    """Our logits at every position of `ids` with adapter `name` in slot 0 (None: the base)."""
    lora = None
    if name is not None:
        ref = llm.engine._loras.get(name)
        llm.engine._runner.lora.load(LoRALoad(0, ref.name, ref.path, ref.digest))
        lora = (llm.engine._runner.lora.weights, [0])
    return paged_logits(llm.engine._model, [ids], chunk=chunk, lora=lora)[0]


@pytest.mark.parametrize("variant, config", [
    ("gemma3", {}),
    ("gemma3", {"use_rslora": True, "r": 8, "rank_pattern": {"o_proj": 2}, "alpha_pattern": {"down_proj": 3}}),
    ("gemma3", {"r": 16}),   # qkv's stacked rank 48 takes the C++ op's MKL branch, gate_up's 32 its row loop
    ("31b", {}), ("e2b", {}), ("26b_a4b", {"target_modules": ["q_proj", "v_proj", "down_proj"]}),
    ("26b_a4b", {"target_modules": ["o_proj"], "target_parameters": ["experts.gate_up_proj", "experts.down_proj"],
                 "r": 3, "lora_alpha": 5})])
def test_logits_equal_peft(tmp_path, variant, config):
    """Every prompt position, chunked, in fp32: within 1e-4 of PEFT's; the adapter moves the logits by what
    it moves PEFT's (~1, against a 1e-4 tolerance)."""
    seed = fresh_seed()
    hf = _hf(variant, seed)
    save_checkpoint(hf, tmp_path / "base")
    model = _adapter(hf, tmp_path / "adapter", seed + 1, **config)
    llm = LLM(str(tmp_path / "base"), dtype="float32", page_size=4, cpu_compile="off",
              lora_modules={"a": str(tmp_path / "adapter")})
    ids = [2] + torch.randint(3, hf.config.vocab_size, (29,), generator=torch.Generator().manual_seed(seed)).tolist()
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0]
        base = hf(torch.tensor([ids])).logits[0]
    got = _slot_logits(llm, "a", ids)
    scale = max(1.0, want.abs().max().item())
    assert (got - want).abs().max().item() < 1e-4 * scale
    assert (want - base).abs().max().item() > 0.1   # the adapter matters, so the comparison above does
    assert (_slot_logits(llm, None, ids) - base).abs().max().item() < 1e-4 * scale


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A tiny Gemma 4 E2B-like base with two adapters of other ranks, PEFT's models over them, and an engine
    serving both (V2 with prefix caching)."""
    root = tmp_path_factory.mktemp("lora")
    hf = _hf("e2b", 41)
    save_checkpoint(hf, root / "base")
    peft_models = {"a": _adapter(hf, root / "a", 42), "b": _adapter(hf, root / "b", 43, r=8, lora_alpha=4)}
    llm = LLM(str(root / "base"), dtype="float32", page_size=4, cpu_compile="off", max_num_batched_tokens=16,
              lora_modules={name: str(root / name) for name in peft_models})
    return root, hf, peft_models, llm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rank", [13, 40])
def test_the_cpu_op_keeps_every_row_independent_of_its_batch(rank, dtype):
    """gemmaserve::lora_add (the C++ kernel where it is built): a row's delta is the same bits alone as among
    other adapters' rows and whatever the threads, and within 1e-5 of the Python kernel's MKL products (rank 13:
    the row loop, its groups of 8, 4 and 1 ranks and its vectors' tails; 40: MKL), with A and B held in fp32 or
    bf16 (engine/lora.py)."""
    from gemmaserve.models import cpu_library
    from gemmaserve.models.lora import LoRABatch, LoRAWeights, SlotWeights, _lora_add

    cpu_library.load()
    gen = torch.Generator().manual_seed(fresh_seed())
    module = torch.nn.Linear(53, 96)
    weights = LoRAWeights(4)
    for slot in range(4):
        b = torch.randn(96, rank, generator=gen)
        b[:40, rank // 2:] = 0   # two parts: block-diagonal, as a fused projection's
        b[40:, :rank // 2] = 0
        w = SlotWeights(torch.randn(rank, 53, generator=gen), b).transposed()
        weights.put(slot, module, SlotWeights(w.a.to(dtype), w.b.to(dtype), w.spans))
    x, y = torch.randn(11, 53, generator=gen), torch.randn(11, 96, generator=gen)
    segments = [(0, 3, 0), (3, 4, 2), (4, 9, 1), (10, 11, 3)]
    mixed = LoRABatch.from_segments(weights, segments, torch.device("cpu"))
    got = mixed.add(module, x, y)
    assert torch.equal(got[9], y[9])   # no adapter: untouched
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(mixed.add(module, x, y), got)
    finally:
        torch.set_num_threads(threads)
    for start, end, slot in segments:
        for row in (start, end - 1):
            alone = LoRABatch.from_segments(weights, [(row, row + 1, slot)], torch.device("cpu")).add(module, x, y)
            assert torch.equal(alone[row], got[row]), (slot, row)
    held = [(idx, weights.by_module[module][s]) for s, idx in mixed.rows.items()]
    want = _lora_add(y, x, [i for i, _ in held], [w.a for _, w in held], [w.b for _, w in held])
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert not torch.equal(got[:9], y[:9])   # (the adapters' deltas were added)


def _greedy_peft(model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=[])
    return out[0, len(ids):].tolist()


def test_mixed_batches_give_each_request_its_tokens_alone(served):
    """Requests for two adapters and the base in one batch, in chunks: the tokens each gets alone, and PEFT's."""
    root, hf, peft_models, llm = served
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    names = ["a", None, "b", "a"]
    alone = [llm.generate([p], params, lora=n)[0].outputs[0].token_ids for p, n in zip(PROMPTS, names)]
    mixed = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, lora=names)]
    assert mixed == alone
    for p, n, tokens in zip(PROMPTS, names, alone):
        ids = llm.tokenizer.encode(p)
        assert tokens == _greedy_peft(peft_models[n] if n else hf, ids, 8), (p, n)
    assert len({tuple(t) for t in alone}) == len(alone)   # the adapters change the output
    llm.engine._kv.check_integrity()


def test_prefix_cache_keys_include_the_adapter(served):
    """A prompt run under one adapter leaves KV that only the same adapter reuses."""
    _, _, _, llm = served
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    prompt = "a long shared prefix of several pages " * 2
    first = llm.generate([prompt], params, lora="a")[0]
    again = llm.generate([prompt], params, lora="a")[0]
    other = llm.generate([prompt], params, lora="b")[0]
    base = llm.generate([prompt], params)[0]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == first.outputs[0].token_ids
    assert other.num_cached_tokens == 0 and base.num_cached_tokens == 0
    assert llm.generate([prompt], params, lora="b")[0].num_cached_tokens > 0


def test_at_most_max_loras_adapters_run_in_a_step(served):
    """--max-loras 1: requests for two adapters and the base run, one adapter at a time (its slot reloaded as
    they alternate), with the tokens each gets alone."""
    root, _, _, llm = served
    one = LLM.from_config(llm.engine.config.replace(max_loras=1), llm)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    names = ["a", "b", None, "b", "a"]
    prompts = PROMPTS + ["one more"]
    want = [llm.generate([p], params, lora=n)[0].outputs[0].token_ids for p, n in zip(prompts, names)]
    sched, seen = one.engine._scheduler, []
    schedule = sched.schedule

    def watch():
        plan = schedule()
        seen.append({s.lora_slot for s in plan.seqs if s.lora_slot >= 0})
        return plan

    sched.schedule = watch
    assert [o.outputs[0].token_ids for o in one.generate(prompts, params, lora=names)] == want
    assert all(len(slots) <= 1 for slots in seen) and one.engine._runner.lora.store.loads >= 2


def test_metrics_count_requests_per_adapter(served):
    """/metrics' LoRA gauges, from the engine thread's snapshot: completions per adapter waiting, then running,
    the adapters registered and --max-loras (one adapter at a time here: "b" waits while "a" runs)."""
    from gemmaserve.server.metrics import ServerMetrics

    _, _, _, llm = served
    one = LLM.from_config(llm.engine.config.replace(max_loras=1), llm)
    eng = one.engine
    ids = [eng.add_request("a river in the valley", SamplingParams(max_tokens=3, ignore_eos=True), lora=name)
           for name in ("a", "a", "b", None)]

    def text() -> str:
        return ServerMetrics().render(eng.snapshot()).decode()

    before = text()
    assert 'gemmaserve_lora_requests_waiting{adapter="a"} 2.0' in before
    assert 'gemmaserve_lora_requests_waiting{adapter="b"} 1.0' in before
    assert "gemmaserve_lora_adapters 2.0" in before and "gemmaserve_lora_max_loras 1.0" in before
    eng.step()
    running = text()
    assert 'gemmaserve_lora_requests_running{adapter="a"} 1.0' in running   # the token budget admits one
    assert 'gemmaserve_lora_requests_waiting{adapter="a"} 1.0' in running
    assert 'gemmaserve_lora_requests_waiting{adapter="b"} 1.0' in running
    eng.abort_request(ids[2])   # an aborted request leaves its adapter's gauge at once
    assert 'gemmaserve_lora_requests_waiting{adapter="b"}' not in text()
    while eng.has_unfinished_requests():
        eng.step()
    assert "gemmaserve_lora_requests_running{" not in text()


def test_two_tensor_parallel_ranks_shard_adapters_like_their_base_layers(served):
    """Each rank reads its slice of an adapter as of its base weights (B's rows of a column-parallel projection,
    A's columns of a row-parallel one, whose delta share joins the sum over ranks): a mixed batch's greedy
    tokens equal one process's."""
    root, _, _, llm = served
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    names = ["a", None, "b", "a"]
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, lora=names)]
    two = LLM(str(root / "base"), dtype="float32", page_size=4, cpu_compile="off", max_num_batched_tokens=16,
              tensor_parallel_size=2, lora_modules={"a": str(root / "a")})
    try:
        two.add_lora("b", str(root / "b"))
        assert [o.outputs[0].token_ids for o in two.generate(PROMPTS, params, lora=names)] == want
    finally:
        two.engine.shutdown()


def test_moe_expert_adapters_batch_with_others_and_shard_like_the_experts(tmp_path):
    """A 26B-A4B-like base, one adapter on the experts (PEFT's target_parameters) and the attention, another on
    the dense MLP only: a mixed batch gives each request its tokens alone and PEFT's greedy tokens, and two
    tensor-parallel ranks (each holding every expert's half of the intermediate, and that half of the adapter)
    give the same tokens."""
    seed = fresh_seed()
    hf = _hf("26b_a4b", seed)
    save_checkpoint(hf, tmp_path / "base")
    peft_models = {
        "e": _adapter(hf, tmp_path / "e", seed + 1, target_modules=["q_proj"], r=5, lora_alpha=7,
                      target_parameters=["experts.gate_up_proj", "experts.down_proj"]),
        "d": _adapter(hf, tmp_path / "d", seed + 2, target_modules=["gate_proj", "down_proj"]),
    }
    mods = {n: str(tmp_path / n) for n in peft_models}
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    names = ["e", None, "d", "e"]
    llm = LLM(str(tmp_path / "base"), dtype="float32", page_size=4, cpu_compile="off", max_num_batched_tokens=16,
              lora_modules=mods)
    alone = [llm.generate([p], params, lora=n)[0].outputs[0].token_ids for p, n in zip(PROMPTS, names)]
    mixed = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, lora=names)]
    assert mixed == alone
    for p, n, tokens in zip(PROMPTS, names, alone):
        assert tokens == _greedy_peft(peft_models[n] if n else hf, llm.tokenizer.encode(p), 6), (p, n)
    two = LLM(str(tmp_path / "base"), dtype="float32", page_size=4, cpu_compile="off", max_num_batched_tokens=16,
              tensor_parallel_size=2, lora_modules=mods)
    try:
        assert [o.outputs[0].token_ids for o in two.generate(PROMPTS, params, lora=names)] == mixed
    finally:
        two.engine.shutdown()


def test_speculation_and_preemption_keep_adapter_tokens_and_counts(served):
    """Prompt lookup verifying drafts under each request's adapter, and a pool small enough that requests with
    adapters are preempted and recomputed: the same tokens as a roomy engine without drafts, and the same
    prompt and cached-token counts (fresh engines on both sides)."""
    from gemmaserve.config.engine import EngineConfig

    root, _, _, llm = served
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    names = ["a", None, "b", "a"]
    prompts = [p * 3 for p in PROMPTS]
    base = dict(model=str(root / "base"), dtype="float32", page_size=4, cpu_compile="off", max_num_batched_tokens=16,
                lora_modules={n: str(root / n) for n in ("a", "b")})

    def run(engine_llm):
        outs = engine_llm.generate(prompts, params, lora=names)
        return [(o.prompt_token_ids, o.outputs[0].token_ids, o.num_cached_tokens) for o in outs]

    want = run(LLM.from_config(EngineConfig(**base), llm))
    spec = LLM.from_config(EngineConfig(**base, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "disable_by_batch_size": 8}), llm)
    assert run(spec) == want and spec.engine._scheduler.spec_stats.drafted > 0
    kv = llm.engine._kv
    longest = max(len(ids) for ids, _, _ in want) + params.max_tokens
    tight = LLM.from_config(EngineConfig(**base, kv_cache_memory=int(1.3 * kv.peak_pages(longest, 16)) * kv.page_bytes),
                            llm)
    assert run(tight) == want and tight.engine._scheduler.num_preemptions > 0
    tight.engine._kv.check_integrity()


def test_adapters_added_and_removed_at_run_time(served):
    """An adapter added at run time serves; removing it while unfinished requests use it is a clear error that
    leaves them to finish with its tokens, after which it is removed."""
    _, _, _, llm = served
    root = served[0]
    llm.add_lora("c", str(root / "a"))
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    prompts = ["hello", "the cat sat on the mat"]
    want = [llm.generate([p], params, lora="a")[0].outputs[0].token_ids for p in prompts]
    assert llm.generate([prompts[0]], params, lora="c")[0].outputs[0].token_ids == want[0]
    with pytest.raises(UserInputError, match="already loaded"):
        llm.add_lora("c", str(root / "b"))
    eng = llm.engine
    ids = [eng.add_request(p, params, lora="c") for p in prompts]
    outputs = eng.step()
    assert eng._scheduler.running and all(r.request_id in ids and r.lora.name == "c" for r in eng._scheduler.running)
    with pytest.raises(UserInputError, match=r"LoRA adapter 'c' is in use by 2 unfinished request\(s\)"):
        llm.remove_lora("c")
    while eng.has_unfinished_requests():
        outputs += eng.step()
    done = {o.request_id: o.outputs[0].token_ids for o in outputs if o.finished}
    assert [done[i] for i in ids] == want
    llm.remove_lora("c")
    with pytest.raises(UserInputError, match="no LoRA adapter named 'c' \\(loaded: a, b\\)"):
        llm.generate(["hello"], params, lora="c")


def test_an_adapter_that_fails_to_load_fails_only_its_requests(served, tmp_path):
    """An adapter whose file breaks after it was registered: its load into a slot fails in the runner, its
    request ends with the error, and the requests beside it in the same steps get their tokens alone."""
    import shutil

    root, _, _, llm = served
    shutil.copytree(root / "a", tmp_path / "x")
    llm.add_lora("x", str(tmp_path / "x"))
    (tmp_path / "x" / "adapter_model.safetensors").write_bytes(b"broken")
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    names = ["a", "x", None, "b"]
    try:
        alone = {n: llm.generate([p], params, lora=n)[0].outputs[0].token_ids
                 for p, n in zip(PROMPTS, names) if n != "x"}
        outs = [o.outputs[0] for o in llm.generate(PROMPTS, params, lora=names)]
        for out, n in zip(outs, names):
            if n == "x":
                assert out.finish_reason == "error" and "could not be loaded" in out.error, out
            else:
                assert out.token_ids == alone[n], n
        assert llm.generate(["hello"], params, lora="b")[0].outputs[0].finish_reason == "length"
    finally:
        llm.remove_lora("x")


def _broken(root, name: str, edit) -> str:
    """A copy of adapter a with `edit(directory)` applied."""
    import shutil

    d = root / name
    if d.exists():
        shutil.rmtree(d)
    shutil.copytree(root / "a", d)
    edit(d)
    return str(d)


def _config_edit(**changes):
    def edit(d):
        cfg = json.loads((d / "adapter_config.json").read_text())
        cfg.update(changes)
        (d / "adapter_config.json").write_text(json.dumps(cfg))
    return edit


def test_k_and_v_of_kv_shared_layers_are_skipped(served, caplog):
    """An adapter with k_proj/v_proj weights on a KV-shared layer (which projects no K/V) loads, says it skipped
    them, and gives the tokens of the same adapter without them."""
    import logging

    from safetensors.torch import load_file, save_file

    root, _, _, llm = served
    shared = [i for i, src in enumerate(llm.engine._model.config.kv_sources) if src is not None]

    def add_kv(d):
        f = d / "adapter_model.safetensors"
        tensors = load_file(f)
        for key in [k for k in tensors if f".layers.{shared[0]}.self_attn.q_proj." in k]:
            for proj in ("k_proj", "v_proj"):
                t = tensors[key]
                tensors[key.replace("q_proj", proj)] = torch.randn(t.shape[0], 4) if "lora_B" in key else t.clone()
        save_file(tensors, f)

    caplog.set_level(logging.INFO)
    llm.add_lora("kv", _broken(root, "kv", add_kv))
    try:
        assert "skipped 2 projections" in caplog.text
        params = SamplingParams(max_tokens=6, ignore_eos=True)
        assert llm.generate(["hello"], params, lora="kv")[0].outputs[0].token_ids == \
            llm.generate(["hello"], params, lora="a")[0].outputs[0].token_ids
    finally:
        llm.remove_lora("kv")


def test_bad_adapters_are_clear_errors_and_the_engine_keeps_serving(served, tmp_path):
    root, hf, _, llm = served
    from safetensors.torch import load_file, save_file

    def truncate(d):
        f = d / "adapter_model.safetensors"
        f.write_bytes(f.read_bytes()[:100])

    def rename(d, old, new):
        f = d / "adapter_model.safetensors"
        save_file({k.replace(old, new): v for k, v in load_file(f).items()}, f)

    other = tiny_hf_model(5, hidden_size=48, head_dim=12)
    save_checkpoint(other, tmp_path / "other_base")
    _adapter(other, tmp_path / "other", 6)
    cases = [
        (str(tmp_path / "missing"), "is not a directory"),
        (_broken(root, "corrupt", truncate), "could not be read as safetensors"),
        (_broken(root, "dora", _config_edit(use_dora=True)), "DoRA"),
        (_broken(root, "saved", _config_edit(modules_to_save=["lm_head"])), "modules_to_save"),
        (_broken(root, "rank", _config_edit(r=2)), "has rank 4, its config says 2"),
        (_broken(root, "embed", lambda d: rename(d, "self_attn.q_proj", "embed_tokens")), "not a LoRA weight"),
        (_broken(root, "tower", lambda d: rename(d, "model.layers.0.", "model.vision_tower.layers.0.")),
         "adapts the vision_tower"),
        (str(tmp_path / "other"), "belongs to another base model"),
        (_broken(root, "params", _config_edit(target_parameters=["mlp.gate_proj.weight"])),
         "parameters other than the MoE experts"),
        (_broken(root, "experts", lambda d: rename(d, "self_attn.q_proj", "experts")),
         r"adapts MoE experts, and layer \d+ of this model has none"),
    ]
    for path, needle in cases:
        with pytest.raises(UserInputError, match=needle):
            llm.add_lora("bad", path)
    big = LLM.from_config(llm.engine.config.replace(max_lora_rank=4, lora_modules=None), llm)
    with pytest.raises(UserInputError, match="rank 8 .* above --max-lora-rank 4"):
        big.add_lora("b", str(root / "b"))
    assert llm.engine._loras.names() == ["a", "b"]
    assert llm.generate(["hello"], SamplingParams(max_tokens=2), lora="b")[0].outputs[0].finish_reason == "length"
    with pytest.raises(UserInputError, match="lora must name one adapter"):
        llm.generate(["x", "y"], SamplingParams(max_tokens=1), lora=["a"])
    with pytest.raises(UserInputError, match="not NAME=PATH"):
        LLM.from_config(llm.engine.config.replace(lora_modules=["nopath"]), llm)


def test_server_serves_adapters_by_model_name_and_loads_them_under_lora_root(served):
    """Through the official openai client: /v1/models lists the adapters with their parent; `model` picks one
    (the response names it) and gives LLM.generate's tokens; an unknown name is a 404 model_not_found; adapters
    load and unload at run time behind the API key, only from under --lora-root; one in use is not unloaded (409)
    until its requests finish."""
    openai = pytest.importorskip("openai")
    import threading
    import time
    import urllib.error
    import urllib.request
    from concurrent.futures import ThreadPoolExecutor

    from gemmaserve.config.engine import EngineConfig
    from gemmaserve.engine.llm_engine import LLMEngine
    from gemmaserve.server.background import BackgroundServer
    from gemmaserve.server.config import ServerConfig

    root, _, _, llm = served
    engine = LLMEngine(EngineConfig(model=str(root / "base"), dtype="float32", page_size=4, cpu_compile="off",
                                    lora_modules={"a": str(root / "a")}), llm.engine._loaded)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    want = {n: llm.generate(["hello there"], params, lora=n)[0].outputs[0].text for n in ("a", "b", None)}
    with BackgroundServer(engine, ServerConfig(api_key="k", lora_root=str(root))) as srv:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="k", max_retries=0, timeout=60)
        models = {m.id: m for m in client.models.list().data}
        assert set(models) == {str(root / "base"), "a"} and models["a"].parent == str(root / "base")

        def ask(model):
            r = client.completions.create(model=model, prompt="hello there", max_tokens=6, temperature=0,
                                          extra_body={"ignore_eos": True})
            return r.model, r.choices[0].text

        assert ask("a") == ("a", want["a"]) and ask(str(root / "base"))[1] == want[None]
        with pytest.raises(openai.NotFoundError, match="model_not_found|does not exist"):
            ask("b")

        def post(path, body, key="k", errors: list | None = None) -> int:
            req = urllib.request.Request(f"{srv.base_url}/v1/{path}", json.dumps(body).encode(),
                                         {"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=60) as r:
                    return r.status
            except urllib.error.HTTPError as exc:
                if errors is not None:
                    errors.append(json.loads(exc.read())["error"])
                return exc.code

        assert post("load_lora_adapter", {"lora_name": "b", "lora_path": "b"}, key="wrong") == 401
        assert post("load_lora_adapter", {"lora_name": "b", "lora_path": "b"}) == 200
        assert ask("b") == ("b", want["b"])
        chat = client.chat.completions.create(model="b", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert chat.model == "b"
        for path, status in (("/etc", 403), ("../..", 403), ("http://example.com/x", 400), ("corrupt", 400),
                             ("no-such-dir", 400)):
            assert post("load_lora_adapter", {"lora_name": "x", "lora_path": path}) == status, path
        assert post("unload_lora_adapter", {"lora_name": "b"}) == 200
        assert post("unload_lora_adapter", {"lora_name": "b"}) == 404
        assert set(m.id for m in client.models.list().data) == {str(root / "base"), "a"}
        assert ask("a") == ("a", want["a"])

        # Unloading an adapter a running request uses: 409 (and the engine's own call raises), the request finishes
        # with the adapter's tokens, and the unload succeeds after it. The engine thread holds that request's
        # steps (commands still run between them) from its second token until the refusals were seen.
        hold, held = threading.Event(), threading.Event()
        step = engine.step

        def gated():
            if hold.is_set() and any(len(r.output_token_ids) >= 2 for r in engine._scheduler.running):
                held.set()
                time.sleep(0.005)
                return []
            return step()

        engine.step = gated
        hold.set()
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(ask, "a")
            assert held.wait(60)
            errors: list = []
            assert post("unload_lora_adapter", {"lora_name": "a"}, errors=errors) == 409
            assert errors[0]["code"] == "lora_in_use" and "in use by 1 unfinished request(s)" in errors[0]["message"]
            with pytest.raises(UserInputError, match="in use by 1 unfinished"):
                srv.server.async_engine.call_blocking(lambda e: e.adapters.remove("a"))
            hold.clear()
            assert running.result(timeout=60) == ("a", want["a"])
        assert post("unload_lora_adapter", {"lora_name": "a"}) == 200
        with pytest.raises(openai.NotFoundError):
            ask("a")


def test_cli_generate_with_an_adapter(served, capsys):
    """`generate --lora-modules a=DIR --lora a`: the adapter's tokens; an unknown name is a one-line error."""
    from gemmaserve import cli

    root, _, _, llm = served
    want = llm.generate(["hello there"], SamplingParams(max_tokens=4, ignore_eos=True), lora="a")[0]
    common = ["generate", "hello there", "--model", str(root / "base"), "--dtype", "float32", "--cpu-compile", "off",
              "--max-tokens", "4", "--ignore-eos", "--json", "--lora-modules", f"a={root / 'a'}", f"b={root / 'b'}"]
    assert cli.main(common + ["--lora", "a"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == want.outputs[0].token_ids
    assert cli.main(common + ["--lora", "zz"]) == 2
    assert "no LoRA adapter named 'zz' (loaded: a, b)" in capsys.readouterr().err


def test_270m_adapter_equals_peft_and_runs_on_the_quantised_base(llm_270m, llm_270m_q, hf_270m, tmp_path):
    """The real 270M: an adapter's greedy tokens on the fp32 path equal transformers + PEFT's; on the default
    quantised path the same adapter moves the logits as it moves fp32's (the base's quantisation error aside)."""
    model = _adapter(hf_270m, tmp_path / "a", 7, r=8, lora_alpha=4)
    prompt = "The capital of France is"
    ids = llm_270m.tokenizer.encode(prompt)
    params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=5)
    llm_270m.add_lora("t", str(tmp_path / "a"))
    llm_270m_q.add_lora("t", str(tmp_path / "a"))
    try:
        exact = llm_270m.generate([prompt], params, lora="t")[0].outputs[0]
        assert exact.token_ids == _greedy_peft(model, ids, 8)
        assert exact.token_ids != llm_270m.generate([prompt], params)[0].outputs[0].token_ids
        quant = llm_270m_q.generate([prompt], params, lora="t")[0].outputs[0]
        assert quant.token_ids[:3] == exact.token_ids[:3]
        # slots hold the adapter in fp32 over fp32 weights, in bf16 over quantised ones (engine/lora.py's slot_dtype)
        for llm, dtype in ((llm_270m, torch.float32), (llm_270m_q, torch.bfloat16)):
            held = {t.dtype for slots in llm.engine._runner.lora.weights.by_module.values() for w in slots.values()
                    for t in (w.a, w.b)}
            assert held == {dtype}, (dtype, held)
        # the adapter's move of the first token's top-5 logprobs, quantised base against fp32 base
        first = [t for t, _ in exact.logprobs[0].top]

        def moved(out_lora, llm):
            base = dict(llm.generate([prompt], SamplingParams(max_tokens=1, logprobs=20))[0].outputs[0].logprobs[0].top)
            lora = dict(out_lora.logprobs[0].top)
            return torch.tensor([lora[t] - base[t] if t in lora and t in base else float("nan") for t in first])

        exact_move, quant_move = moved(exact, llm_270m), moved(quant, llm_270m_q)
        both = exact_move.isfinite() & quant_move.isfinite()
        # (measured: moves up to 1.1, the two bases' own difference shifts them by up to 0.2)
        assert both.sum() >= 3 and exact_move[both].abs().max() > 0.5
        assert (quant_move - exact_move)[both].abs().max() < 0.3
    finally:
        llm_270m.remove_lora("t")
        llm_270m_q.remove_lora("t")


def test_bench_lora_runs_on_a_tiny_checkpoint(served, tmp_path, monkeypatch):
    """`bench lora` writes one row per adapter count and rank, each with the base's runs alternating with its
    own and the ratio of the two."""
    import argparse

    from gemmaserve.bench import lora as bench
    from gemmaserve.config.options import add_options
    from gemmaserve.config.engine import EngineConfig

    root = served[0]
    monkeypatch.setenv("OUT", str(tmp_path))
    ap = argparse.ArgumentParser()
    bench.add_arguments(ap)
    add_options(ap, EngineConfig, "engine")
    args = ap.parse_args(["--model", str(root / "base"), "--dtype", "float32", "--cpu-compile", "off", "--batch", "3",
                          "--tokens", "2", "--repeat", "1", "--adapters", "1,2", "--ranks", "4"])
    assert bench.run(args) == 0
    rows = json.loads((tmp_path / "lora.json").read_text())["rows"]
    assert [(r["adapters"], r["rank"]) for r in rows] == [(1, 4), (2, 4)]
    for r in rows:
        assert r["tok_s"] > 0 and r["base_tok_s"] > 0
        # (tok/s are rounded to 0.1: on a loaded machine a base of ~3 tok/s moves their quotient by up to ~0.05)
        assert abs(r["ratio"] - r["tok_s"] / r["base_tok_s"]) <= 0.0005 + 0.05 * (1 + r["ratio"]) / r["base_tok_s"]
