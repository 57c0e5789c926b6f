"""Structured output: every completed output parses against its schema / regex, whatever the weights
(a tiny random model sampling at temperature 1 would write anything unconstrained), constrained and
free rows share batches without touching each other, and async scheduling, preemption and siblings
leave the tokens unchanged."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest

from gemmaserve import LLM
from gemmaserve.engine.sampling_params import SamplingParams
from gemmaserve.engine.structured.json_grammar import I_JSON_MAX, bound_numbers
from gemmaserve.engine.structured.structured_output import GrammarKind, Grammars, StructuredOutput, parse_cli_structured
from gemmaserve.errors import UserInputError

from helpers import fresh_seed, save_checkpoint, tiny_hf_model


# Small on purpose: a random model spends most tokens on the whitespace it may put between JSON
# tokens (a newline and an indent at most, see json_grammar.py) and on byte tokens inside free strings.
SCHEMA = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["cat", "dog", "eel"]},
        "legs": {"type": "integer", "minimum": 0, "maximum": 99},
        "tame": {"type": "boolean"},
        "name": {"type": "string", "pattern": "^[a-z]{1,5}$"},
        "tags": {"type": "array", "items": {"enum": ["x", "yy"]}, "maxItems": 2},
    },
    "required": ["kind", "legs", "tame", "name", "tags"],
    "additionalProperties": False,
}
PROMPTS = ["abc", "the dog", "zz top", "a b c d e"]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return save_checkpoint(tiny_hf_model(fresh_seed()), tmp_path_factory.mktemp("tiny") / "m")


@pytest.fixture(scope="module")
def llm(tiny_path):
    return LLM(str(tiny_path), page_size=4, async_scheduling="off")


def _schema_params(**kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 40, "structured_output": StructuredOutput.json_schema(SCHEMA), **kw})


def test_random_weights_sampled_hot_still_give_valid_documents(llm):
    outs = llm.generate(PROMPTS[:2], _schema_params(max_tokens=200, temperature=1.0, seed=fresh_seed(), n=3))
    done = [c.text for o in outs for c in o.outputs if c.finish_reason == "stop"]
    assert len(done) >= 3, [c.finish_reason for o in outs for c in o.outputs]   # most finish within 200 tokens
    for text in done:
        jsonschema.validate(json.loads(text), SCHEMA)
    # Unconstrained, the same sampling writes no JSON at all (the test could not pass by luck).
    free = llm.generate(PROMPTS, SamplingParams(max_tokens=40, temperature=1.0, seed=fresh_seed()))
    assert not any(o.outputs[0].text.lstrip().startswith('{"kind"') for o in free)


def test_regex_json_object_and_grammar(llm):
    so = StructuredOutput(GrammarKind.REGEX, r"[0-9]{3}-[a-z]{2,4}")
    for o in llm.generate(PROMPTS, SamplingParams(max_tokens=20, temperature=1.0, seed=1, structured_output=so)):
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", o.outputs[0].text), o.outputs[0].text
    obj = StructuredOutput(GrammarKind.JSON)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=200, temperature=0.7, seed=2, structured_output=obj))
    done = [o.outputs[0].text for o in outs if o.outputs[0].finish_reason == "stop"]
    assert done and all(isinstance(json.loads(t), dict) for t in done)
    ebnf = StructuredOutput(GrammarKind.GRAMMAR, 'root ::= ("yes" | "no") " " [a-c]+ "."')
    for o in llm.generate(PROMPTS, SamplingParams(max_tokens=20, temperature=1.0, seed=3, structured_output=ebnf)):
        assert re.fullmatch(r"(yes|no) [a-c]+\.", o.outputs[0].text), o.outputs[0].text


def test_penalties_apply_on_top_of_the_grammar(llm):
    """Repetition and presence penalties change the masked logits: the mask survives them (it was
    dropped, and every such request failed with a token outside its grammar)."""
    so = StructuredOutput(GrammarKind.REGEX, r"[0-9]{3}-[a-z]{2,4}")
    for extra in ({"repetition_penalty": 1.3}, {"presence_penalty": 1.0, "frequency_penalty": 0.5}):
        params = SamplingParams(max_tokens=20, temperature=1.0, seed=4, structured_output=so, **extra)
        for o in llm.generate(PROMPTS, params):
            c = o.outputs[0]
            assert c.finish_reason == "stop" and re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", c.text), (extra, c)


def test_constrained_and_free_rows_share_a_batch_without_touching_each_other(llm):
    """Greedy: each request alone equals the same request in a mixed batch (masks land on their own
    rows only), and free rows equal a batch without constrained neighbours."""
    constrained, free = _schema_params(), SamplingParams(max_tokens=24)
    alone_c = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], constrained)]
    alone_f = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[2:], free)]
    engine = llm.engine
    ids = [engine.add_request(p, constrained if i < 2 else free, request_id=f"mix{i}")
           for i, p in enumerate([PROMPTS[2], PROMPTS[0], PROMPTS[3], PROMPTS[1]][::-1])]
    got = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                got[out.request_id] = out.outputs[0]
    order = [PROMPTS[2], PROMPTS[0], PROMPTS[3], PROMPTS[1]][::-1]
    texts = {p: got[rid].text for p, rid in zip(order, ids)}
    by_prompt = {p: got[rid].token_ids for p, rid in zip(order, ids)}
    # Requests 0 and 1 (constrained) ran on PROMPTS[1] and PROMPTS[3]; 2 and 3 (free) on PROMPTS[0], PROMPTS[2].
    # The masks reached the constrained rows and only them: those wrote (the start of) a document of
    # the schema, the free rows did not. Without this, masks applied nowhere would pass the
    # comparisons below (every run as unconstrained as the others).
    so = constrained.structured_output
    for p, masked in ((PROMPTS[1], True), (PROMPTS[3], True), (PROMPTS[0], False), (PROMPTS[2], False)):
        assert llm.engine._grammars.matcher(so).matcher.accept_string(texts[p]) == masked, (p, texts[p])
    assert by_prompt[PROMPTS[1]] == llm.generate([PROMPTS[1]], constrained)[0].outputs[0].token_ids
    assert by_prompt[PROMPTS[3]] == llm.generate([PROMPTS[3]], constrained)[0].outputs[0].token_ids
    assert by_prompt[PROMPTS[0]] == llm.generate([PROMPTS[0]], free)[0].outputs[0].token_ids
    assert by_prompt[PROMPTS[2]] == alone_f[0]
    assert alone_c[0] == llm.generate([PROMPTS[0]], constrained)[0].outputs[0].token_ids


@pytest.mark.parametrize("preempting", [False, True], ids=["async", "async-preempting"])
def test_async_scheduling_and_preemption_keep_the_tokens(llm, tiny_path, preempting):
    """The matcher accepts each token exactly once: when the next step was launched before it was
    known (async), and when a request is preempted and recomputed."""
    params = _schema_params(temperature=1.0, seed=fresh_seed(), n=2)
    want = [[c.token_ids for c in o.outputs] for o in llm.generate(PROMPTS, params)]
    options = dict(async_scheduling="on", max_num_batched_tokens=16)
    if preempting:   # room for the longest request and a third more: decodes growing together preempt
        kv = llm.engine._kv
        longest = max(len(llm.engine.inputs.tokenize(p)) for p in PROMPTS) + params.max_tokens
        options["kv_cache_memory"] = int(1.3 * kv.peak_pages(longest, 16)) * kv.page_bytes
    other = LLM(str(tiny_path), page_size=4, **options)
    got = [[c.token_ids for c in o.outputs] for o in other.generate(PROMPTS, params)]
    assert got == want
    assert (other.engine._scheduler.num_preemptions > 0) == preempting
    other.engine._kv.check_integrity()


def test_bad_specs_are_user_errors(llm):
    with pytest.raises(UserInputError, match="invalid json_schema"):
        llm.generate(["abc"], SamplingParams(structured_output=StructuredOutput.json_schema({"type": "objec"})))
    with pytest.raises(UserInputError, match="not valid JSON"):
        llm.generate(["abc"], SamplingParams(structured_output=StructuredOutput(GrammarKind.JSON_SCHEMA, '{"a": ')))
    with pytest.raises(UserInputError, match="invalid regex"):
        llm.generate(["abc"], SamplingParams(structured_output=StructuredOutput(GrammarKind.REGEX, "([a-z")))
    with pytest.raises(UserInputError, match="ignore_eos"):
        _schema_params(ignore_eos=True)
    with pytest.raises(UserInputError, match="kind must be one of"):
        StructuredOutput("yaml", "x")
    with pytest.raises(UserInputError, match="needs a non-empty spec"):
        StructuredOutput(GrammarKind.REGEX, " ")
    assert parse_cli_structured("json") == StructuredOutput(GrammarKind.JSON)
    with pytest.raises(UserInputError, match="KIND=SPEC"):
        parse_cli_structured("schema.json")
    assert not llm.engine.has_unfinished_requests()


def _accepts(llm, so: StructuredOutput, text: str) -> bool:
    """Whether the request's grammar takes `text` as a whole output."""
    matcher = llm.engine._grammars.matcher(so).matcher
    return matcher.accept_string(text) and matcher.is_completed()


def test_json_whitespace_is_what_pretty_printing_needs_not_padding(llm):
    doc = {"kind": "cat", "legs": 4, "tame": True, "name": "tom", "tags": ["x", "yy"]}
    pretty = json.dumps(doc, indent=2)
    for so in (StructuredOutput(GrammarKind.JSON), StructuredOutput.json_schema(SCHEMA)):
        for text in (json.dumps(doc), json.dumps(doc, separators=(",", ":")), pretty, json.dumps(doc, indent=4),
                     json.dumps(doc, indent="\t")):
            assert _accepts(llm, so, text), text
        for text in (pretty.replace('\n  "legs"', '\n\n  "legs"'),     # a blank line
                     pretty.replace('{\n', '{\n  \n  \n'),              # the padding seen in practice
                     pretty.replace(': 4', ':     4'),                    # a run of spaces
                     json.dumps(doc).replace(', "legs"', ',      "legs"'),
                     json.dumps(doc, indent=40)):                         # an indent beyond any nesting
            assert not _accepts(llm, so, text), text


def test_numbers_are_bounded_as_i_json_unless_the_schema_says_more(llm):
    obj = StructuredOutput(GrammarKind.JSON)
    assert _accepts(llm, obj, '{"n": 1234567890123456, "m": -9007199254740991}')
    assert _accepts(llm, obj, '{"x": -3.141592653589793, "y": 6.02214076e23, "z": 0.30000000000000004, "w": 5e-324}')
    for bad in ("1" * 40, "12345678901234567", "1." + "0" * 40, "1e1000"):
        assert not _accepts(llm, obj, '{"n": %s}' % bad), bad
    schema = StructuredOutput.json_schema({
        "type": "object", "properties": {"i": {"type": "integer"}, "n": {"type": "number"},
                                         "low": {"type": "integer", "minimum": 0},
                                         "big": {"type": "integer", "minimum": 0, "maximum": 10**18}},
        "required": ["i", "n", "low", "big"], "additionalProperties": False})

    def doc(i=1, n=1.5, low=1, big=1) -> str:
        return json.dumps({"i": i, "n": n, "low": low, "big": big})

    assert _accepts(llm, schema, doc(i=-I_JSON_MAX, n=-2.5e-7, low=I_JSON_MAX, big=10**18))   # the schema's bound wins
    for bad in (doc(i=I_JSON_MAX + 1), doc(i=10**39), doc(low=10**39), doc(n=10**39), doc(big=10**18 + 1),
                doc(low=-1)):
        assert not _accepts(llm, schema, bad), bad


def test_bound_numbers_walks_subschemas_not_values():
    schema = {"$defs": {"a": {"type": "integer"}}, "anyOf": [{"type": ["number", "null"], "minimum": 1}],
              "items": {"type": "integer", "maximum": 5}, "properties": {"enum": {"type": "integer"}},
              "const": {"type": "integer"}, "additionalProperties": {"type": "number"}}
    out = bound_numbers(schema)
    assert out["$defs"]["a"] == {"type": "integer", "minimum": -I_JSON_MAX, "maximum": I_JSON_MAX}
    assert out["anyOf"][0] == {"type": ["number", "null"], "minimum": 1, "maximum": I_JSON_MAX}
    assert out["items"] == {"type": "integer", "maximum": 5, "minimum": -I_JSON_MAX}
    assert out["properties"]["enum"]["minimum"] == -I_JSON_MAX
    assert out["const"] == {"type": "integer"}                   # a value, not a schema
    assert out["additionalProperties"] == {"type": "number"}     # open: the grammar bounds its digits
    assert schema["$defs"]["a"] == {"type": "integer"}           # the caller's schema is left as it was


def test_a_compiling_grammar_delays_only_its_own_request(llm, monkeypatch):
    """Grammars compile on worker threads: the engine admits a request once its grammar is ready and
    steps the others meanwhile (add_request does not wait for the compile either)."""
    grammars, engine = llm.engine._grammars, llm.engine
    release, compile_ = threading.Event(), grammars._compile

    def slow(so):
        release.wait(20)
        return compile_(so)

    monkeypatch.setattr(grammars, "_compile", slow)
    so = StructuredOutput.json_schema({**SCHEMA, "description": "not compiled before"})
    params = SamplingParams(max_tokens=8, structured_output=so)
    engine.add_request(PROMPTS[0], params, request_id="slow-grammar")
    engine.add_request(PROMPTS[1], SamplingParams(max_tokens=8), request_id="free")
    done = {}
    while "free" not in done:
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    assert "slow-grammar" not in done and not engine._request("slow-grammar").output_token_ids   # still waiting
    release.set()
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    assert done["slow-grammar"].outputs[0].token_ids == llm.generate([PROMPTS[0]], params)[0].outputs[0].token_ids


def test_grammars_are_cached_by_canonical_spec_in_a_bounded_lru(llm):
    grammars = Grammars(llm.engine._tokenizer, llm.engine._model.vocab_size, cache_size=2)
    schema = grammars.submit(StructuredOutput(GrammarKind.JSON_SCHEMA, '{"type": "object", "minProperties": 1}'))
    # Insignificant whitespace is not part of the key; key order is (it orders the properties).
    assert grammars.submit(StructuredOutput(GrammarKind.JSON_SCHEMA, '{ "type" : "object",\n "minProperties":1 }')) \
        is schema
    assert grammars.submit(StructuredOutput(GrammarKind.JSON_SCHEMA, '{"minProperties": 1, "type": "object"}')) \
        is not schema
    assert grammars.submit(StructuredOutput(GrammarKind.REGEX, "[0-9]+")).result() is not None
    assert grammars.submit(StructuredOutput(GrammarKind.JSON_SCHEMA, '{"type": "object", "minProperties": 1}')) \
        is not schema   # the least recently used of three was evicted
    with pytest.raises(UserInputError, match="not valid JSON"):
        grammars.submit(StructuredOutput(GrammarKind.JSON_SCHEMA, '{"a": '))   # at once, on the caller's thread


def test_cpu_mask_kernel_is_built_off_the_request_path(llm):
    """After warm-up the masks go through llguidance's compiled kernel, and no request compiles
    anything (the first request of issue 29 spent ~17 s in this kernel's torch.compile)."""
    import torch._dynamo.utils

    grammars = llm.engine._grammars
    grammars.warm_up(cpu_kernel=True)
    assert grammars.wait_for_kernel(timeout=600)
    kernel, rows = grammars._cpu_kernel, []
    grammars._cpu_kernel = lambda logits, mask: (rows.append(logits.shape[0]), kernel(logits, mask))
    try:
        graphs = dict(torch._dynamo.utils.counters["stats"])
        constrained, free = _schema_params(max_tokens=6), SamplingParams(max_tokens=6)
        llm.generate(PROMPTS[:1], constrained)                                   # one row
        llm.generate(PROMPTS, constrained)                                       # every row
        llm.generate(PROMPTS, [constrained, free, constrained, free])            # some rows
        assert dict(torch._dynamo.utils.counters["stats"]) == graphs
    finally:
        grammars._cpu_kernel = kernel
    assert 1 in rows and max(rows) > 1


def test_plan_round_trip_keeps_the_structured_output():
    from gemmaserve.engine.step import NewRequest, StepPlan

    params = _schema_params(temperature=0.5)
    plan = StepPlan(3, new_requests=[NewRequest("r", params, 7, [1, 2])])
    back = StepPlan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert back.new_requests[0].params == params


@pytest.mark.slow
def test_embedded_model_fills_a_schema(llm_270m_q):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "population": {"type": "integer", "minimum": 0, "maximum": 99999999}},
              "required": ["city", "population"], "additionalProperties": False}
    out = llm_270m_q.generate(["The largest city in France, as JSON:"],
                            SamplingParams(max_tokens=40, structured_output=StructuredOutput.json_schema(schema)))
    c = out[0].outputs[0]
    assert c.finish_reason == "stop", c.text
    jsonschema.validate(json.loads(c.text), schema)
