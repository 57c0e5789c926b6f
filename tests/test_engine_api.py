"""LLMEngine's public interface (issue 44): `validate` runs the very checks `add_request` runs (same error for
the same bad input), `snapshot()` says what the parts say, and a request the server validated is not
validated again on its way into the engine."""

from __future__ import annotations

import json
import urllib.request

import pytest

from gemmaserve import SamplingParams
from gemmaserve.config.engine import EngineConfig
from gemmaserve.engine.llm_engine import LLMEngine
from gemmaserve.engine.structured.structured_output import GrammarKind, StructuredOutput
from gemmaserve.engine.validation import ContextLengthError, GrammarError, RequestValidator
from gemmaserve.errors import UserInputError

MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def engine(llm_270m_q):
    return LLMEngine(EngineConfig(max_model_len=MAX_MODEL_LEN, max_num_seqs=4, cpu_compile="off"),
                     llm_270m_q.engine._loaded)


def _bad_inputs(engine):
    vocab = engine.info.vocab_size
    ok = [2, 651, 6037, 576]
    yield "too long", [5] * MAX_MODEL_LEN, SamplingParams(max_tokens=4), None, ContextLengthError
    yield "stop id outside the vocabulary", ok, SamplingParams(max_tokens=4, stop_token_ids=[vocab]), None, None
    yield "prompt id outside the vocabulary", ok + [vocab], SamplingParams(max_tokens=4), None, None
    yield "negative prompt id", [-1] + ok, SamplingParams(max_tokens=4), None, None
    yield "unknown adapter", ok, SamplingParams(max_tokens=4), "nope", None
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        return
    bad = StructuredOutput(GrammarKind.JSON_SCHEMA, '{"type": "no such type"}')
    yield "grammar", ok, SamplingParams(max_tokens=4, structured_output=bad), None, GrammarError


def test_validate_fails_as_add_request_does(engine):
    for what, ids, params, lora, kind in _bad_inputs(engine):
        with pytest.raises(UserInputError) as checked:
            engine.validate(ids, params, lora=lora)
        if kind is not GrammarError:   # add_request does not wait for a grammar (it fails the request later)
            with pytest.raises(UserInputError) as added:
                engine.add_request("", params, prompt_ids=ids, lora=lora)
            assert (type(added.value), str(added.value)) == (type(checked.value), str(checked.value)), what
        assert kind is None or isinstance(checked.value, kind), what
    assert not engine.has_unfinished_requests()


def test_strict_length_is_openai_rule(engine):
    ids = [2] + [651] * 40
    engine.validate(ids, SamplingParams(max_tokens=40))   # generation stops at max_model_len instead
    with pytest.raises(ContextLengthError) as exc:
        engine.validate(ids, SamplingParams(max_tokens=40), strict_length=True)
    assert (exc.value.prompt_tokens, exc.value.max_tokens, exc.value.limit) == (41, 40, MAX_MODEL_LEN)


def test_snapshot_says_what_the_parts_say(engine):
    engine.add_request("The capital of France is", SamplingParams(max_tokens=3, ignore_eos=True), request_id="s")
    engine.step()
    snap, st, sched = engine.snapshot(), engine._kv.stats(), engine._scheduler
    assert (snap.waiting, snap.running, snap.preemptions) == (len(sched.waiting), len(sched.running),
                                                             sched.num_preemptions)
    assert (snap.pages_total, snap.pages_used, snap.pages_free, snap.pages_cached, snap.pages_scratch) == (
        st.num_pages, st.pages_used, st.pages_free, st.pages_cached, st.scratch_pages)
    assert (snap.prefix_query_tokens, snap.prefix_hit_tokens) == (st.prefix_query_tokens, st.prefix_hit_tokens)
    assert snap.running == 1 and snap.pages_used > 0
    assert (snap.lora_adapters, snap.max_loras) == (len(engine.adapters.names()), engine.config.max_loras)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.snapshot().pages_used == 0


def test_a_served_request_is_checked_once(engine, monkeypatch):
    """Two prompts in one completions request: the check runs twice (once per prompt, in the handler), not
    four times (the engine queues what the handler checked). A too-long request is refused with the
    server's message before anything is queued."""
    from gemmaserve.server.app import ServerConfig
    from gemmaserve.server.background import BackgroundServer

    calls = []
    check = RequestValidator.check

    def counted(self, prompt_ids, *args, **kwargs):
        calls.append(len(prompt_ids))
        return check(self, prompt_ids, *args, **kwargs)

    monkeypatch.setattr(RequestValidator, "check", counted)

    def post(body: dict) -> tuple[int, dict]:
        req = urllib.request.Request(srv.base_url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())

    with BackgroundServer(engine, ServerConfig()) as srv:
        status, body = post({"prompt": ["one two", "three four five"], "max_tokens": 2})
        assert status == 200 and len(body["choices"]) == 2
        assert len(calls) == 2, calls
        calls.clear()
        status, body = post({"prompt": "one two", "max_tokens": MAX_MODEL_LEN})
        assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
        assert body["error"]["message"].startswith(f"this model's maximum context length is {MAX_MODEL_LEN} tokens; "
                                                   "the request asks for ")
        assert body["error"]["param"] == "prompt" and len(calls) == 1


def test_reset_prefix_cache_forgets_prefixes_and_their_counters(engine):
    """`reset_prefix_cache()`: a prompt served again after it gets no cached tokens, the prefix counters read zero,
    and the KV manager's books stay consistent (`check_integrity`)."""
    ids = [2] + list(range(600, 640))

    def run() -> int:
        rid = engine.add_request("", SamplingParams(max_tokens=2), prompt_ids=ids)
        cached = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == rid and out.finished:
                    cached = out.num_cached_tokens
        return cached

    run()
    assert run() > 0 and engine.snapshot().prefix_hit_tokens > 0   # the second run reuses the first's prefix
    engine.reset_prefix_cache()
    snap = engine.snapshot()
    assert snap.prefix_hit_tokens == snap.prefix_query_tokens == 0 and snap.pages_cached == 0
    engine.check_integrity()
    assert run() == 0
    engine.check_integrity()
