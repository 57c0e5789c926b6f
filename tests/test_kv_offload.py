"""The host-memory KV tier (`--kv-offload-memory`): what the device's prefix cache evicts is kept in host memory
and copied back on a hit, through the step description (kv/connector.py), with the same output as recomputing it.

The manager tests check what is kept (every block of full groups, only window tails of sliding groups, nothing of
KV-shared layers) and the copies each step carries. The engine tests run interleaved sessions whose prefixes do
not all fit the device pool, on tiny random Gemma 3 and Gemma 4 (KV-shared) checkpoints: tokens, logprobs and top
alternatives bit for bit with the tier on and off, more prompt tokens served from cache with it, and the KV
manager's integrity after every step; and the tier beside n-gram speculation, a LoRA adapter and an fp8 KV cache.
"""

import pytest
import torch

from gemmaserve import LLM, SamplingParams
from gemmaserve.config.engine import EngineConfig
from gemmaserve.errors import UserInputError
from gemmaserve.kv.connector import BlockCopy, Direction, KVTransfers
from gemmaserve.kv.manager_v2 import KVCacheManagerV2
from gemmaserve.kv.spec import AttentionKind, LayerSpec

from helpers import fresh_seed, save_checkpoint, tiny_gemma4_hf, tiny_hf_model

FULL = LayerSpec(AttentionKind.FULL, 1, 8, torch.float32)
SLIDING = LayerSpec(AttentionKind.SLIDING, 1, 8, torch.float32, window=8)


def _run(kv, sid, tokens, start, end, chunk):
    """Prefill tokens [start, end) of `sid` in chunks as the scheduler would, committing each."""
    pos = start
    while pos < end:
        step = min(chunk, end - pos)
        assert kv.allocate(sid, tokens, pos, pos + step, prefill=True)
        pos += step
        kv.commit(sid, tokens, pos)
        kv.check_integrity()


def _manager(num_pages=60, offload_pages=200, **kw):
    # Layers 0-2 sliding (W = 8), 3 full, 4 shares layer 3's KV (owns none); 4 tokens a page.
    specs = [SLIDING, SLIDING, SLIDING, FULL, LayerSpec(AttentionKind.FULL, 1, 8, torch.float32, kv_source=3)]
    return KVCacheManagerV2(specs, 4, num_pages, enable_prefix_caching=True, offload_pages=offload_pages, **kw)


def test_tier_keeps_full_blocks_and_window_tails_only():
    kv = _manager()
    a = list(range(100, 141))   # 41 tokens: 10 full blocks
    assert kv.lookup("a", a) == 0
    _run(kv, "a", a, 0, 41, chunk=41)
    kv.free("a")
    kv.take_transfers()
    # Other prompts take the whole pool: every cached block of "a" is evicted.
    others = 0
    while kv.allocate(f"b{others}", [9, 9, 9, 9], 0, 4, prefill=True):
        others += 1
    assert kv.stats().pages_cached == 0
    saves = [c for c in kv.take_transfers().copies if c.direction is Direction.SAVE]
    groups = {g.index: g for g in kv.groups}
    full = next(g for g in groups.values() if not g.sliding)
    sliding = next(g for g in groups.values() if g.sliding)
    saved = {g: sum(c.group == g for c in saves) for g in groups}
    assert saved[full.index] == 10                       # every block of the full group
    # The sliding group: only the tail a resumption at 40 reads (tokens 33..40: blocks 8 and 9), never the rest.
    assert saved[sliding.index] == len(kv.policies[sliding.index].hit_blocks(40)) == 2
    assert all(len(c.device_pages) == len(c.store_pages) == groups[c.group].num_layers for c in saves)
    assert full.num_layers == 1   # the KV-shared layer owns no pages: nothing of it is stored
    for i in range(others):
        kv.free(f"b{i}")
    kv.check_integrity()

    # "a" again, extended: the hit comes from the host tier, and the allocation asks for the copies back.
    a2 = a + [7, 8, 9, 10]
    assert kv.lookup("a2", a2) == 40
    assert kv.allocate("a2", a2, 40, 45, prefill=True)
    loads = [c for c in kv.take_transfers().copies if c.direction is Direction.LOAD]
    assert sum(c.group == full.index for c in loads) == 10 and sum(c.group == sliding.index for c in loads) == 2
    kv.commit("a2", a2, 45)
    kv.check_integrity()
    st = kv.tier.stats()
    assert st.loaded_blocks == 12 and st.saved_blocks == 12 and st.bytes_used == st.pages_used * kv.page_bytes


def test_tier_without_room_keeps_the_newest_and_never_fails():
    kv = _manager(offload_pages=4)   # room for 4 full blocks (1 page) or one sliding block (3 pages) at a time
    for i in range(6):
        toks = [1000 * (i + 1) + j for j in range(41)]
        _run(kv, f"s{i}", toks, 0, 41, chunk=16)
        kv.free(f"s{i}")
        kv.take_transfers()
        kv.check_integrity()
    st = kv.tier.stats()
    assert st.pages_used <= 4 and st.evicted_blocks > 0


def test_copy_runs_keep_order_and_never_write_a_page_twice():
    t = KVTransfers([BlockCopy(Direction.SAVE, 0, [7, 8], [0, 1]), BlockCopy(Direction.SAVE, 1, [9], [2]),
                     BlockCopy(Direction.LOAD, 0, [7, 8], [4, 5]), BlockCopy(Direction.LOAD, 0, [8], [6]),
                     BlockCopy(Direction.SAVE, 0, [3], [0])])
    assert t.runs() == [(Direction.SAVE, [7, 8, 9], [0, 1, 2]), (Direction.LOAD, [7, 8], [4, 5]),
                        (Direction.LOAD, [8], [6]), (Direction.SAVE, [3], [0])]
    assert KVTransfers.from_dict({"copies": [vars(c) for c in t.copies]}).runs() == t.runs()


def test_store_copies_in_runs_equal_page_by_page(monkeypatch):
    """The runner's batched copies (a gather per run of store pages) move the same bytes as a copy per page,
    with scattered device pages, broken store runs and runs cut at the staging limit."""
    from gemmaserve.engine.connectors import host_kv_store
    from gemmaserve.engine.connectors.host_kv_store import HostKVStore, _store_runs

    assert _store_runs([5, 2, 9, 4], [0, 1, 3, 4], 2) == [([5, 2], 0, 2), ([9, 4], 3, 2)]
    assert _store_runs([5, 2, 9], [0, 1, 2], 2) == [([5, 2], 0, 2), ([9], 2, 1)]
    gen = torch.Generator().manual_seed(fresh_seed())
    page_bytes = 64
    cache = torch.randint(0, 255, (40 * page_bytes,), dtype=torch.uint8, generator=gen)
    kv = [(cache.view(torch.float32), cache.view(torch.float32))]
    monkeypatch.setattr(host_kv_store, "_STAGE_BYTES", 3 * page_bytes)
    store = HostKVStore(kv, page_bytes, 24)
    store.pages.zero_()
    dev = torch.randperm(40, generator=gen)[:20].tolist()
    host = list(range(0, 8)) + list(range(10, 22))
    expect = torch.zeros(24, page_bytes, dtype=torch.uint8)
    arena = cache.view(40, page_bytes)
    for d, h in zip(dev, host):
        expect[h] = arena[d]
    store.execute(KVTransfers([BlockCopy(Direction.SAVE, 0, dev, host)]))
    assert torch.equal(store.pages, expect)
    before = arena.clone()
    back = torch.randperm(40, generator=gen)[:20].tolist()
    store.execute(KVTransfers([BlockCopy(Direction.LOAD, 0, back, host)]))
    for i in range(40):
        want = expect[host[back.index(i)]] if i in back else before[i]
        assert torch.equal(arena[i], want), i


def _sessions(turns: int, sessions: int, prefix: int, vocab: int, seed: int) -> list[list[list[int]]]:
    """Per session, its prompts turn by turn: a long random prefix, then each turn appends a few tokens."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(sessions):
        ids = torch.randint(3, vocab, (prefix,), generator=gen).tolist()
        prompts = []
        for _ in range(turns):
            ids = ids + torch.randint(3, vocab, (5,), generator=gen).tolist()
            prompts.append(list(ids))
        out.append(prompts)
    return out


# 12 tokens an answer, each with its logprob and top 3 alternatives: compared bit for bit
PARAMS = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=3)


def _interleaved(llm: LLM, sessions, params: SamplingParams = PARAMS, check_every_step: bool = False,
                 loras: list | None = None) -> tuple[list[tuple[list[int], list | None]], list[int]]:
    """Turn t of every session, then turn t + 1 of every session (each continuing from its own answer, session s
    under adapter loras[s]); returns every answer's tokens and logprobs, and the prompt tokens each was served
    from cache."""
    history = [[] for _ in sessions]
    answers, cached = [], []
    for t in range(len(sessions[0])):
        for s, prompts in enumerate(sessions):
            prompt = prompts[t] if t == 0 else history[s] + prompts[t][len(prompts[t - 1]):]
            engine = llm.engine
            rid = engine.add_request("", params, prompt_ids=prompt, lora=loras[s] if loras else None)
            out = None
            while engine.has_unfinished_requests():
                for o in engine.step():
                    out = o if o.request_id == rid and o.finished else out
                if check_every_step:
                    engine._kv.check_integrity()
            engine._kv.check_integrity()
            completion = out.outputs[0]
            assert len(completion.token_ids) == params.max_tokens
            history[s] = prompt + list(completion.token_ids)
            answers.append((list(completion.token_ids), completion.logprobs))
            cached.append(out.num_cached_tokens)
    return answers, cached


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """A tiny random Gemma 3 checkpoint (window 6), an engine over it, and three sessions of three turns."""
    seed = fresh_seed()
    hf = tiny_hf_model(seed, sliding_window=6)
    path = str(save_checkpoint(hf, tmp_path_factory.mktemp("gemma3")))
    base = LLM(model=path, kv_cache_manager="v2", page_size=4)
    return hf, path, base, _sessions(turns=3, sessions=3, prefix=120, vocab=hf.config.vocab_size, seed=seed)


def _tight(path: str, base: LLM, **extra) -> dict:
    """Engine options `extra` and a device pool that holds about one session (260 tokens' pages, in the KV dtype
    they set): the other sessions' prefixes are evicted between their turns."""
    common = dict(model=path, kv_cache_manager="v2", page_size=4, **extra)
    kv = (LLM.from_config(EngineConfig(**common), base) if "kv_cache_dtype" in extra else base).engine._kv
    per_token = kv.pages_at(200) * kv.page_bytes // 200
    return dict(common, kv_cache_memory=per_token * 260, max_num_batched_tokens=64)


@pytest.mark.parametrize("family", ["gemma3", "gemma4-e2b"])
def test_interleaved_sessions_same_tokens_with_the_tier(request, tmp_path, family):
    """Tokens, logprobs and top alternatives bit for bit with the tier on and off (and with no prefix cache), more
    prompt tokens from cache with it."""
    if family == "gemma3":
        hf, path, base, sessions = request.getfixturevalue("gemma3")
    else:
        seed = fresh_seed()
        hf = tiny_gemma4_hf(seed, "e2b")
        path = str(save_checkpoint(hf, tmp_path / family))
        base = LLM(model=path, kv_cache_manager="v2", page_size=4)
        sessions = _sessions(turns=3, sessions=3, prefix=120, vocab=hf.config.vocab_size, seed=seed)
    opts = _tight(path, base)
    plain, plain_cached = _interleaved(LLM.from_config(EngineConfig(**opts), base), sessions)
    # Gemma 4 plans ahead (asynchronous scheduling): copies must still run in plan order (a step in flight
    # holds scratch slots, so integrity is checked when idle there).
    tiered_llm = LLM.from_config(EngineConfig(**opts, kv_offload_memory=4 << 20,
                                              async_scheduling="on" if family != "gemma3" else "off"), base)
    tiered, tiered_cached = _interleaved(tiered_llm, sessions, check_every_step=family == "gemma3")
    assert tiered == plain
    st = tiered_llm.engine._kv.tier.stats()
    assert st.loaded_blocks > 0 and st.saved_blocks > 0
    assert sum(tiered_cached) > sum(plain_cached) + 2 * 100, (tiered_cached, plain_cached)
    if family == "gemma3":   # what /metrics reads: the tier's counters, as the engine thread snapshots them
        from gemmaserve.server.metrics import ServerMetrics

        snap = tiered_llm.engine.snapshot()
        text = ServerMetrics().render(snap).decode()
        assert f"gemmaserve_kv_offload_loaded_blocks_total {float(st.loaded_blocks)}" in text
        assert f"gemmaserve_kv_offload_bytes {float(st.bytes_used)}" in text
        assert tiered_llm.engine.info.kv_offload_bytes == st.num_pages * st.page_bytes > 0
    off = LLM.from_config(EngineConfig(**opts, enable_prefix_caching=False), base)
    assert _interleaved(off, sessions)[0] == plain


def test_the_tier_with_speculation_an_adapter_and_fp8_kv(gemma3, tmp_path):
    """The tier beside n-gram speculation, a LoRA adapter and an fp8 KV cache (its pages copied as bytes), all at
    once: every token, logprob and top alternative is the same engine's without the tier, and every returning
    turn loads its prefix from the tier (the same engine without it recomputes most of it). Sessions 0 and 1 run
    under the adapter; session 2 repeats session 0's prompts without it, after session 0's blocks went to the
    tier: it never reads them (their keys are salted with the adapter)."""
    from test_lora import _adapter

    hf, path, base, sessions = gemma3
    _adapter(hf, tmp_path / "a", fresh_seed())
    sessions = [sessions[0], sessions[1], [list(p) for p in sessions[0]]]
    loras = ["a", "a", None]
    opts = _tight(path, base, kv_cache_dtype="fp8", lora_modules={"a": str(tmp_path / "a")},
                  speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    plain, plain_cached = _interleaved(LLM.from_config(EngineConfig(**opts), base), sessions, loras=loras)
    tiered_llm = LLM.from_config(EngineConfig(**opts, kv_offload_memory=4 << 20), base)
    tiered, tiered_cached = _interleaved(tiered_llm, sessions, check_every_step=True, loras=loras)
    assert tiered == plain
    engine = tiered_llm.engine
    assert engine.info.kv_cache_dtype == "float8_e4m3fn" and engine._kv.tier.stats().loaded_blocks > 0
    returning = range(len(sessions), len(tiered_cached))   # turns 2 and 3 of every session
    assert all(tiered_cached[i] >= 100 > plain_cached[i] for i in returning), (tiered_cached, plain_cached)
    assert tiered_cached[2] == 0 and tiered[2][0] != tiered[0][0]   # session 0's first prompt, not its blocks
    st = engine._scheduler.spec_stats
    assert st.accepted > 0 and st.drafted > st.accepted, st


def test_two_ranks_keep_their_own_shards_in_the_tier(tmp_path):
    """Tensor parallelism: every rank copies its own KV heads' pages to and from its own store, as the plan
    says, and the tokens are one process's (26B-A4B-like: sliding layers' KV heads split, so that group's pages
    hold twice the tokens on two ranks and prefix hits land elsewhere: cached counts may differ)."""
    seed = fresh_seed()
    hf = tiny_gemma4_hf(seed, "26b_a4b")
    path = str(save_checkpoint(hf, tmp_path / "moe"))
    sessions = _sessions(turns=2, sessions=3, prefix=100, vocab=hf.config.vocab_size, seed=seed)
    results, pages = [], []
    for tp in (1, 2):
        probe = LLM(model=path, dtype="float32", page_size=4, tensor_parallel_size=tp)
        kv = probe.engine._kv
        pool = kv.pages_at(130) * kv.page_bytes * 3 // 2   # about one and a half sessions
        tier = kv.pages_at(130) * kv.page_bytes * 2       # the same pages on one rank or two: it evicts alike
        probe.engine.shutdown()
        llm = LLM.from_config(EngineConfig(model=path, dtype="float32", page_size=4, tensor_parallel_size=tp,
                                           max_num_batched_tokens=32, kv_cache_memory=pool,
                                           kv_offload_memory=tier))
        try:
            results.append(_interleaved(llm, sessions, SamplingParams(max_tokens=4, ignore_eos=True)))
            assert llm.engine._kv.tier.stats().loaded_blocks > 0
            pages.append((llm.engine._kv.num_pages, llm.engine._kv.tier.num_pages))
        finally:
            llm.engine.shutdown()
    assert pages[0] == pages[1]   # the same pool and tier sizes in pages (the split group's pages hold more tokens)
    assert results[0][0] == results[1][0]


def test_bad_offload_sizes_are_clear_errors(tmp_path, capsys):
    with pytest.raises(UserInputError, match="exceeds the host's available memory"):
        EngineConfig(kv_offload_memory=1 << 60)
    # The command line's own parser: a size parses to bytes, anything else is an error naming the option
    from gemmaserve.cli import build_parser
    from gemmaserve.config.options import from_namespace

    parser = build_parser(with_bench=False)
    args = parser.parse_args(["serve", "--kv-offload-memory", "64MiB"])
    assert from_namespace(EngineConfig, args).kv_offload_memory == 64 << 20
    with pytest.raises(SystemExit) as exited:
        parser.parse_args(["serve", "--kv-offload-memory", "lots"])
    assert exited.value.code == 2
    assert "argument --kv-offload-memory: invalid size 'lots'" in capsys.readouterr().err
    path = str(save_checkpoint(tiny_hf_model(fresh_seed()), tmp_path / "tiny"))
    base = LLM(model=path, page_size=4)
    with pytest.raises(UserInputError, match="needs KV cache manager v2 with prefix caching"):
        LLM.from_config(EngineConfig(model=path, kv_offload_memory=1 << 20, enable_prefix_caching=False), base)
    with pytest.raises(UserInputError, match="cannot hold one block"):
        LLM.from_config(EngineConfig(model=path, kv_offload_memory=16, page_size=4), base)


def test_bench_sessions_runs_on_a_tiny_checkpoint(tmp_path, monkeypatch):
    """`bench sessions` compares the tier with recomputation on the same prompts: the same tokens, returning
    turns served from the tier, and the tier's bytes against a tier of every layer."""
    import argparse
    import json

    from gemmaserve.bench import sessions as bench
    from gemmaserve.config.options import add_options

    path = save_checkpoint(tiny_hf_model(fresh_seed(), sliding_window=6), tmp_path / "tiny")
    monkeypatch.setenv("OUT", str(tmp_path))
    ap = argparse.ArgumentParser()
    bench.add_arguments(ap)
    add_options(ap, EngineConfig, "engine")
    args = ap.parse_args(["--model", str(path), "--page-size", "4", "--cpu-compile", "off", "--sessions", "3",
                          "--turns", "2", "--prefixes", "96", "--turn-tokens", "8", "--answer-tokens", "4"])
    assert bench.run(args) == 0
    rows = json.loads((tmp_path / "sessions.json").read_text())["rows"]
    back, fresh = rows
    assert back["returns"] and not fresh["returns"] and back["same_tokens"] and fresh["same_tokens"]
    assert back["recompute"]["cached_tokens"] == 0 and back["tier"]["cached_tokens"] >= 2 * 3 * 96
    assert back["tier"]["loaded_blocks"] > 0 and fresh["tier"]["loaded_blocks"] == 0
    assert 0 < back["tier_bytes_vs_every_layer"] < 1   # a window of 6 tokens: sliding layers keep tails only
