"""KV transfer for disaggregated serving, without processes: what a plan sends (from the KV groups),
runtime resolution (one test per rule of seed 000), a handoff between two in-process engines of
different KV managers and page sizes, and a stalled transfer timing out."""

from __future__ import annotations

import dataclasses
import logging
import threading

import pytest
import torch

from gemmaserve.attention.base import BackendCapabilities
from gemmaserve.config.engine import EngineConfig
from gemmaserve.config.kv_transfer import KVTransferConfig
from gemmaserve.config.resolve import resolve_cache_options
from gemmaserve.errors import UserInputError
from gemmaserve.kv import KVCacheManagerV1, KVCacheManagerV2
from gemmaserve.models.base import ModelPreferences
from gemmaserve.testing.shapes import SHAPES
from gemmaserve.transfer.plan import TransferPlan, check_plan, plan_transfer
from gemmaserve.transfer.runtime import RuntimeInfo, TransferTimeout

CAPS = BackendCapabilities("full", frozenset({"cpu"}), None, scratch_pages=True, shared_arena=True)
GEMMA = ModelPreferences(kv_cache_manager="v2", swa_scratch_reuse=True, kv_transfer_runtime="nixl")
SPECS = SHAPES["gemma3-1b"].layer_specs(torch.float32)
WORKS = {"nixl": RuntimeInfo("nixl", True), "torch": RuntimeInfo("torch", True)}
NO_NIXL = {"nixl": RuntimeInfo("nixl", True, "NIXL is not installed"), "torch": RuntimeInfo("torch", True)}


def _resolve(runtimes=WORKS, prefs=GEMMA, role="prefill", runtime="auto", **opts):
    config = EngineConfig(kv_transfer=KVTransferConfig(role=role, kv_transfer_runtime=runtime), **opts)
    return resolve_cache_options(config, prefs, CAPS, SPECS, probe=lambda name: runtimes[name])


# -- what moves ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", ["gemma3-27b", "gemma4-31b", "gemma4-e2b"])
def test_v2_sends_full_layers_every_token_and_sliding_layers_the_window_tail(shape):
    specs = SHAPES[shape].layer_specs()
    n = 32768
    v2 = plan_transfer(KVCacheManagerV2(specs, 16, 4096).groups, n)
    v1 = plan_transfer(KVCacheManagerV1(specs, 16, 64).groups, n)
    owners = [s for s in specs if s.owns_kv]
    assert v2.nbytes(specs) == sum((n if s.window is None else s.window - 1) * s.bytes_per_token() for s in owners)
    assert v1.nbytes(specs) == n * sum(s.bytes_per_token() for s in owners)
    # KV-shared layers (Gemma 4 E2B's tail) send nothing; every owner is in both plans.
    assert [s.layer for s in v2.spans] == [s.layer for s in v1.spans] == [i for i, s in enumerate(specs) if s.owns_kv]
    assert check_plan(v2, specs) is None and check_plan(v1, specs) is None
    assert TransferPlan.from_dict(v2.to_dict()) == v2


def test_a_receiver_refuses_a_plan_that_misses_what_it_reads():
    n = 100
    plan = plan_transfer(KVCacheManagerV2(SPECS, 16, 4096).groups, n)
    short = dataclasses.replace(plan, spans=tuple(dataclasses.replace(s, start=s.start + 1) for s in plan.spans))
    assert "needs tokens" in check_plan(short, SPECS)
    assert "layers" in check_plan(dataclasses.replace(plan, spans=plan.spans[1:]), SPECS)


# -- runtime resolution (seed 000) -------------------------------------------------------------------
def test_rule_no_role_no_runtime_nothing_changes():
    r = _resolve(runtimes=NO_NIXL, role="both")
    assert (r.kv_transfer_runtime, r.kv_cache_manager, r.demotions) == (None, "v2", ())


def test_rule_auto_takes_the_models_preference():
    assert _resolve().kv_transfer_runtime == "nixl"
    assert _resolve(prefs=ModelPreferences("v2", True)).kv_transfer_runtime == "torch"   # the default preference


def test_rule_explicit_runtime_wins_both_ways():
    assert _resolve(runtime="torch").kv_transfer_runtime == "torch"
    assert _resolve(prefs=ModelPreferences("v2", True), runtime="nixl").kv_transfer_runtime == "nixl"


def test_rule_unavailable_runtime_auto_demotes_and_logs(caplog):
    with caplog.at_level(logging.INFO, logger="gemmaserve.config.resolve"):
        r = _resolve(runtimes=NO_NIXL, role="decode")
    assert r.kv_transfer_runtime == "torch" and r.kv_cache_manager == "v2"
    assert r.demotions == ("kv_transfer_runtime auto -> torch (nixl is not available: NIXL is not installed)",)
    assert "kv_transfer_runtime auto -> torch" in caplog.text


def test_rule_unavailable_runtime_explicit_is_an_error():
    with pytest.raises(UserInputError, match="--kv-transfer-runtime nixl is not available: NIXL is not installed"):
        _resolve(runtimes=NO_NIXL, runtime="nixl")


def test_rule_runtime_that_cannot_move_v2_pages_demotes_the_manager_to_v1(caplog):
    flat = {**WORKS, "torch": RuntimeInfo("torch", moves_v2_pages=False)}
    with caplog.at_level(logging.INFO, logger="gemmaserve.config.resolve"):
        r = _resolve(runtimes=flat, runtime="torch")
    assert (r.kv_cache_manager, r.swa_scratch_reuse, r.enable_prefix_caching) == ("v1", False, False)
    assert r.demotions[0] == "kv_cache_manager auto -> v1 (KV transfer runtime 'torch' cannot move v2's pages)"
    assert "kv_cache_manager auto -> v1" in caplog.text
    with pytest.raises(UserInputError, match="--kv-cache-manager v2 is not available: .*cannot move v2's pages"):
        _resolve(runtimes=flat, runtime="torch", kv_cache_manager="v2")


def test_transfer_options_are_validated():
    with pytest.raises(UserInputError, match="role must be one of"):
        KVTransferConfig(role="decoder")
    with pytest.raises(UserInputError, match="kv_transfer_timeout"):
        KVTransferConfig(kv_transfer_timeout=0)


# -- the handoff between two engines -----------------------------------------------------------------
@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    from gemmaserve.engine.llm_engine import LLMEngine

    from helpers import fresh_seed, save_checkpoint, tiny_hf_model

    path = save_checkpoint(tiny_hf_model(fresh_seed(), sliding_window=8), tmp_path_factory.mktemp("m"))
    base = EngineConfig(model=str(path), page_size=4, max_num_batched_tokens=64, kv_cache_memory=2 << 20)
    single = LLMEngine(base)
    role = lambda r: KVTransferConfig(role=r, kv_transfer_runtime="torch")   # noqa: E731
    prefill = LLMEngine(base.replace(kv_transfer=role("prefill")), single._loaded)
    decode_v1 = LLMEngine(base.replace(kv_transfer=role("decode"), kv_cache_manager="v1", page_size=8), single._loaded)
    return single, prefill, decode_v1


def _run(engine, rid, params, ids, lora=None):
    engine.add_request("", params, prompt_ids=ids, request_id=rid, lora=lora)
    return _drain(engine)


def _drain(engine):
    """Step until nothing is left; the last finished output."""
    final = None
    while engine.has_unfinished_requests():
        final = next((o for o in engine.step() if o.finished), final)
    return final


def _hand_over(prefill, decode, prompt, params, prefill_id, decode_id, transfer_id, lora=None):
    """Prefill `prompt` on `prefill` (one token), stage its KV and adopt it on `decode` as `decode_id` (under
    adapter `lora` on both): (staging, the decode handoff, the staged description, the outputs the adoption
    gave)."""
    from gemmaserve.engine.connectors.kv_handoff import DecodeHandoff, PrefillHandoff
    from gemmaserve.transfer.torch_runtime import TorchSource

    source = TorchSource(torch.device("cpu"))
    staging = PrefillHandoff(prefill, source, timeout=30, engine_id="p")
    staging.expect(prefill_id, transfer_id)
    _run(prefill, prefill_id, dataclasses.replace(params, max_tokens=1), prompt, lora)
    desc = staging.describe_transfer(transfer_id)
    handoff = DecodeHandoff(decode)
    decode.add_request("", params, prompt_ids=prompt, request_id=decode_id, lora=lora)
    handoff.reserve(decode_id, prompt)
    outputs = handoff.adopt(decode, decode_id, TransferPlan.from_dict(desc["plan"]), source._buffers[transfer_id],
                            desc["first_token"], None, desc["cached_tokens"])
    return staging, handoff, desc, outputs


def test_handoff_to_another_manager_and_page_size_gives_the_single_engine_tokens(engines):
    """V2 with scratch (page 4) hands to V1 (page 8): tokens equal a single engine's; no page leaks;
    a reservation whose transfer fails is freed."""
    from gemmaserve.engine.connectors.kv_handoff import NoKVRoom
    from gemmaserve.engine.sampling_params import SamplingParams

    single, prefill, decode = engines
    assert prefill.info.swa_scratch_reuse and decode._kv.name == "v1"
    prompt = [(7 * i + 3) % 290 + 5 for i in range(50)]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    want = _run(single, "a", params, prompt).outputs[0].token_ids
    staging, handoff, desc, outputs = _hand_over(prefill, decode, prompt, params, "x", "y", "t1")
    # The prompt's pages went back; the staged bytes hold as many pages until released (the KV budget).
    staged_pages = -(-desc["nbytes"] // prefill._kv.page_bytes)
    assert desc["first_token"] == want[0] and prefill._kv.stats().pages_used == staged_pages > 0
    assert [o.outputs[0].delta_token_ids for o in outputs] == [[want[0]]]   # the first token, at once
    final = _drain(decode)
    assert final.outputs[0].token_ids == want
    assert staging.release("t1") and staging.num_staged == 0
    # A reservation the transfer never filled goes back to the pool; a full cache refuses at once.
    handoff.reserve("z", prompt)
    assert decode._kv.stats().pages_used > 0
    handoff.cancel("z")
    handoff.reserve("never-started", prompt)   # its client left before the response began
    assert handoff.expire(max_age=0.0) == 1 and handoff.num_reserved == 0
    with pytest.raises(NoKVRoom):
        handoff.reserve("big", list(range(5, 20000)))
    for eng in (prefill, decode):
        eng._kv.check_integrity()
        assert eng._kv.stats().pages_used == 0


def test_a_decode_engine_that_speculates_gives_the_single_engine_tokens(engines):
    """Speculative decoding (prompt lookup) on the decode engine: the handed-over request drafts from its
    first decode step on, and its tokens are the single engine's."""
    from gemmaserve.engine.llm_engine import LLMEngine
    from gemmaserve.engine.sampling_params import SamplingParams

    single, prefill, _ = engines
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "disable_by_batch_size": 8}
    decode = LLMEngine(prefill.config.replace(kv_transfer=KVTransferConfig(role="decode", kv_transfer_runtime="torch"),
                                              speculative_config=ngram), single._loaded)
    prompt = [5 + (i % 7) * 11 for i in range(40)]   # repetitive: lookups find matches
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    want = _run(single, "s", params, prompt).outputs[0].token_ids
    staging = _hand_over(prefill, decode, prompt, params, "xs", "ys", "t2")[0]
    final = _drain(decode)
    assert final.outputs[0].token_ids == want
    assert decode._scheduler.spec_stats.accepted > 0, decode._scheduler.spec_stats   # drafts kept after the handoff
    assert staging.release("t2")
    decode._kv.check_integrity()
    assert decode._kv.stats().pages_used == 0


def test_a_draft_model_on_both_roles_travels_with_the_target(engines):
    """A draft model configured on both roles: the prefill engine computes its KV with the target's (the
    mirror), the handoff moves its layers with the target's (they are layers of the same pool), and the
    decode engine drafts from its first step. The target as its own draft has every draft accepted only
    if that KV arrived whole; tokens equal the single engine's."""
    from gemmaserve.engine.llm_engine import LLMEngine
    from gemmaserve.engine.sampling_params import SamplingParams

    single, prefill, _ = engines
    draft = {"method": "draft_model", "model": single.config.model, "num_speculative_tokens": 3,
             "disable_by_batch_size": 8}
    role = lambda r: KVTransferConfig(role=r, kv_transfer_runtime="torch")   # noqa: E731
    prefill_d = LLMEngine(prefill.config.replace(speculative_config=draft), single._loaded)
    decode_d = LLMEngine(prefill.config.replace(kv_transfer=role("decode"), speculative_config=draft), single._loaded)
    prompt = [(5 * i + 2) % 280 + 7 for i in range(45)]
    params = SamplingParams(max_tokens=14, ignore_eos=True)
    want = _run(single, "d", params, prompt).outputs[0].token_ids
    staging = _hand_over(prefill_d, decode_d, prompt, params, "xd", "yd", "t3")[0]
    final = _drain(decode_d)
    st = decode_d.snapshot().spec
    assert final.outputs[0].token_ids == want
    assert st.drafted > 0 and st.accepted == st.drafted, st
    assert staging.release("t3")
    decode_d.check_integrity()
    # a prefill engine without the draft model sends no KV for its layers: refused, not adopted half
    with pytest.raises(UserInputError, match="this engine stores layers"):
        _hand_over(prefill, decode_d, prompt, params, "xe", "ye", "t4")


def test_staged_kv_nobody_fetches_is_freed_after_the_timeout(engines):
    import time

    from gemmaserve.engine.connectors.kv_handoff import PrefillHandoff
    from gemmaserve.engine.sampling_params import SamplingParams
    from gemmaserve.transfer.torch_runtime import TorchSource

    _, prefill, _ = engines
    staging = PrefillHandoff(prefill, TorchSource(torch.device("cpu")), timeout=0.2, engine_id="p")
    staging.expect("w", "t2")
    _run(prefill, "w", SamplingParams(max_tokens=1), list(range(5, 40)))
    assert staging.num_staged == 1
    time.sleep(0.3)
    assert staging.expire() == 1 and staging.num_staged == 0 and staging.describe_transfer("t2") is None


def test_a_stalled_torch_transfer_times_out():
    """The source joins the pair group but never sends: the receive gives up at the timeout."""
    from gemmaserve.transfer.torch_runtime import TorchSink, TorchSource

    source, sink = TorchSource(torch.device("cpu")), TorchSink(torch.device("cpu"), "127.0.0.1")
    joined = []

    def control(op: str, body: dict) -> dict:
        if op == "connect":   # as the prefill engine's handler would, on its own thread
            t = threading.Thread(target=lambda: joined.append(source.handle("connect", body, 5.0)))
            t.start()
            return {}
        return {}             # "send": a prefill engine that stalls

    with pytest.raises(TransferTimeout):
        sink.receive({"engine": "p"}, "t", 64, torch.device("cpu"), 1.0, control)
    assert joined == [{}]


def test_received_blocks_enter_the_prefix_cache_and_cached_tokens_follow_the_prefill_engine(engines):
    """The decode engine (V2, a host tier on) adopts a prompt: a later request extending it is served from the
    received blocks. The handed-over request reports the cached tokens the prefill engine's prefix cache gave."""
    from gemmaserve.engine.llm_engine import LLMEngine
    from gemmaserve.engine.sampling_params import SamplingParams

    single, prefill, _ = engines
    decode = LLMEngine(prefill.config.replace(kv_transfer=KVTransferConfig(role="decode", kv_transfer_runtime="torch"),
                                              kv_offload_memory=1 << 20), single._loaded)
    prompt = [(11 * i + 5) % 280 + 7 for i in range(60)]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    _run(prefill, "warm", dataclasses.replace(params, max_tokens=1), prompt[:40])   # the prefill side hits 36
    want = _run(single, "r", params, prompt).outputs[0].token_ids
    staging, _, desc, _ = _hand_over(prefill, decode, prompt, params, "xr", "yr", "t5")
    final = _drain(decode)
    assert final.outputs[0].token_ids == want
    assert final.num_cached_tokens == desc["cached_tokens"] >= 32
    assert staging.release("t5")
    longer = prompt + want + [9, 10, 11]
    again = _run(decode, "later", params, longer)
    assert again.num_cached_tokens >= 60 - 60 % 4 - 4   # the received blocks, not recomputed
    assert again.outputs[0].token_ids == _run(single, "later1", params, longer).outputs[0].token_ids
    decode._kv.check_integrity()


def test_an_adapters_received_blocks_are_keyed_under_the_adapter(engines, tmp_path):
    """A prompt computed under a LoRA adapter and handed over: the description names the adapter (name and
    digest), the decode engine gives the single engine's tokens for it, and its prefix cache serves the
    received blocks to a later request under that adapter only (the base recomputes them)."""
    from peft import LoraConfig, get_peft_model

    from gemmaserve.engine.llm_engine import LLMEngine
    from gemmaserve.engine.sampling_params import SamplingParams

    from helpers import tiny_hf_model

    single, prefill, _ = engines
    hf = tiny_hf_model(3, sliding_window=8, vocab_size=single._model.vocab_size)
    torch.manual_seed(4)
    get_peft_model(hf, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"], init_lora_weights=False)
                   ).save_pretrained(tmp_path / "ad")
    decode = LLMEngine(prefill.config.replace(kv_transfer=KVTransferConfig(role="decode", kv_transfer_runtime="torch")),
                       single._loaded)
    for engine in (single, prefill, decode):
        if "ad" not in engine.adapters:
            engine.adapters.add("ad", str(tmp_path / "ad"))
    prompt = [(13 * i + 3) % 280 + 7 for i in range(44)]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    want = _run(single, "ra", params, prompt, "ad").outputs[0].token_ids
    assert want != _run(single, "rb", params, prompt).outputs[0].token_ids
    staging, _, desc, _ = _hand_over(prefill, decode, prompt, params, "xa", "ya", "t7", lora="ad")
    assert desc["lora"] == decode.adapters.get("ad").key
    assert _drain(decode).outputs[0].token_ids == want
    staging.release("t7")
    longer = prompt + want + [9, 10, 11]
    assert _run(decode, "base", params, longer).num_cached_tokens == 0
    again = _run(decode, "under", params, longer, "ad")
    assert again.num_cached_tokens >= 40
    assert again.outputs[0].token_ids == _run(single, "under1", params, longer, "ad").outputs[0].token_ids
    decode._kv.check_integrity()


@pytest.mark.parametrize("ranks", [(2, 1), (1, 2)])
def test_prefill_and_decode_roles_with_two_ranks(tmp_path, ranks):
    """Tensor parallelism on either side (26B-A4B-like: sliding layers' KV heads split across ranks): each rank
    saves or loads its own heads inside the step, rank 0 puts the wire's rows together or sends them out, and
    the tokens are one engine's."""
    from gemmaserve.engine.llm_engine import LLMEngine
    from gemmaserve.engine.sampling_params import SamplingParams

    from helpers import fresh_seed, save_checkpoint, tiny_gemma4_hf

    path = save_checkpoint(tiny_gemma4_hf(fresh_seed(), "26b_a4b"), tmp_path / "moe")
    base = EngineConfig(model=str(path), dtype="float32", page_size=4, max_num_batched_tokens=32,
                        kv_cache_memory=2 << 20)
    role = lambda r: KVTransferConfig(role=r, kv_transfer_runtime="torch")   # noqa: E731
    single = LLMEngine(base)
    prefill = LLMEngine(base.replace(kv_transfer=role("prefill"), tensor_parallel_size=ranks[0]))
    decode = LLMEngine(base.replace(kv_transfer=role("decode"), tensor_parallel_size=ranks[1]))
    try:
        prompt = [(13 * i + 3) % 250 + 5 for i in range(70)]
        params = SamplingParams(max_tokens=8, ignore_eos=True)
        want = _run(single, "s", params, prompt).outputs[0].token_ids
        staging = _hand_over(prefill, decode, prompt, params, "x", "y", "t")[0]
        assert _drain(decode).outputs[0].token_ids == want
        assert staging.release("t")
        for eng in (prefill, decode):
            eng._kv.check_integrity()
            assert eng._kv.stats().pages_used == 0
    finally:
        for eng in (prefill, decode):
            eng.shutdown()
