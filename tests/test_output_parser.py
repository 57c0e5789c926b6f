"""The incremental output parser: thinking, content and tool calls read from any chunking of the text (one
character, several tokens at once as a speculative step gives them, a marker cut anywhere) equal the whole text
read at once; Gemma 4 call arguments become the JSON that `gemma_arguments` reads; JSON-format calls (Gemma 3)
hold the answer only while it may still be a call; parsers share no state."""

from __future__ import annotations

import json
import random
import re

from hypothesis import given, settings, strategies as st

from gemmaserve.server.output_parser import (
    ContentDelta, OutputParser, ReasoningDelta, ToolCallDelta, ToolCallDone, ToolCallStart, fold, parse_output,
)
from gemmaserve.server.reasoning import ReasoningFormat
from gemmaserve.server.tools import Tool, ToolCalling, ToolFormat, gemma_arguments

Q = '<|"|>'
FMT = ReasoningFormat(1, 2)
NATIVE = ToolCalling((Tool("get_weather", "", {}), Tool("get_time", "", {})), "auto", None, True, ToolFormat.NATIVE)
JSON = ToolCalling((Tool("get_time", "", {}),), "auto", None, True, ToolFormat.JSON)
TRICKY = (f"{{city:{Q}São, {{Paulo}}] \"quoted\" a:b,c\\n\nline{Q},days:3,ok:true,no:false,none:null,ratio:-1.5e2,"
          f"list:[{Q}a{Q}, 2, [true]],nested:{{deep:{{x:{Q}y{Q},e:{{}},l:[]}}}},{Q}quoted key{Q}:1,}}")


def call(name: str, args: str) -> str:
    return f"<|tool_call>call:{name}{args}<tool_call|>"


def streamed(text: str, cuts: list[int], **kw) -> tuple[list, object]:
    """The events of `text` fed in pieces ending at `cuts`, and the fold of them."""
    parser = OutputParser(**kw)
    events, prev = [], 0
    for c in sorted(cuts) + [len(text)]:
        events += parser.feed(text[prev:c])
        prev = max(prev, c)
    events += parser.finish()
    return events, fold(events, parser.thought, parser.content_optional)


def every_chunking_agrees(text: str, **kw) -> object:
    """Cut once at every position, then into MTP-like runs of 2-7 characters from every offset: each equals the
    whole text (ids too: seeded)."""
    kw.setdefault("seed", "s")
    whole = parse_output(text, **kw)
    for i in range(len(text) + 1):
        assert streamed(text, [i], **kw)[1] == whole, (text, i)
    for step in range(2, 8):
        for start in range(step):
            assert streamed(text, list(range(start, len(text), step)), **kw)[1] == whole, (text, step, start)
    assert streamed(text, list(range(len(text))), **kw)[1] == whole   # one character at a time
    return whole


def test_gemma4_arguments_become_json_as_they_stream():
    text = "I'll check. " + call("get_weather", TRICKY)
    whole = every_chunking_agrees(text, calling=NATIVE)
    want = json.dumps(gemma_arguments(TRICKY), ensure_ascii=False)
    assert whole.content == "I'll check." and [c["function"] for c in whole.tool_calls] == [
        {"name": "get_weather", "arguments": want}]
    # one character at a time: the name comes before any argument, then many fragments that join to the JSON
    events, _ = streamed(text, list(range(len(text))), calling=NATIVE, seed="s")
    kinds = [type(e) for e in events]
    assert kinds.index(ToolCallStart) < kinds.index(ToolCallDelta) and kinds[-1] is ToolCallDone
    fragments = [e.arguments for e in events if isinstance(e, ToolCallDelta)]
    assert len(fragments) > 20 and "".join(fragments) == events[-1].arguments == want
    # the name is out as soon as the "{" after it arrives, before the arguments do
    head = text.index("{city")
    assert any(isinstance(e, ToolCallStart) for e in streamed(text[:head + 1], [], calling=NATIVE)[0])


def test_parallel_calls_get_indexes_and_their_own_ids():
    text = call("get_time", f"{{zone:{Q}utc{Q}}}") + call("get_weather", "{days:1}") + call("get_time", "{}")
    whole = every_chunking_agrees(text, calling=NATIVE)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole.tool_calls] == [
        ("get_time", '{"zone": "utc"}'), ("get_weather", '{"days": 1}'), ("get_time", "{}")]
    ids = [c["id"] for c in whole.tool_calls]
    assert len(set(ids)) == 3 and all(i.startswith("call_") and len(i) == 29 for i in ids)
    assert whole.content is None
    events, _ = streamed(text, [5, 50], calling=NATIVE, seed="s")
    assert [e.index for e in events if isinstance(e, ToolCallStart)] == [0, 1, 2]
    assert ids != [c["id"] for c in parse_output(text, calling=NATIVE, seed="other").tool_calls]


def test_thinking_opened_by_the_prompt_and_again_after_a_tool_result():
    opened = every_chunking_agrees("thought\nplan it<channel|>The answer.", reasoning=FMT, starts_in_reasoning=True)
    assert (opened.reasoning, opened.content) == ("plan it", "The answer.")
    unlabelled = parse_output("plan<channel|>A", reasoning=FMT, starts_in_reasoning=True)
    assert (unlabelled.reasoning, unlabelled.content) == ("plan", "A")
    # a model turn that thinks, calls, and (the tool's result in the prompt) thinks again: no thought in content
    text = ("<|channel>thought\nfirst<channel|>Calling." + call("get_time", "{}")
            + "\n<|channel>thought\nsecond <channel|> thought <|chan>not a marker")
    whole = every_chunking_agrees(text, reasoning=FMT, calling=NATIVE)
    assert whole.reasoning == "firstsecond " and whole.content == "Calling.\n thought <|chan>not a marker"
    assert [c["function"]["name"] for c in whole.tool_calls] == ["get_time"]
    # a call ends the thinking (as the template lets it)
    plan = parse_output("<|channel>thought\nplan" + call("get_time", "{}"), reasoning=FMT, calling=NATIVE)
    assert plan.reasoning == "plan" and len(plan.tool_calls) == 1
    # no format: the markers are text
    assert parse_output("<|channel>thought\nx<channel|>y").content == "<|channel>thought\nx<channel|>y"


def test_the_whole_text_reads_as_tool_calling_and_the_reasoning_split_read_it_before():
    """What the chat route answered before (ReasoningFormat.split, then ToolCalling.parse) for well-formed outputs.
    (Changed: an unknown tool's call text stays content beside known calls, and a known call whose arguments
    break is a call, not content; see the two tests below.)"""
    texts = ["<|channel>thought\nhm<channel|>  Sure. " + call("get_time", f"{{zone:{Q}cet{Q}}}") + "  ",
             "\n<|channel>thought\nr<channel|>\nA", "plain <channel|> x", "<|channel>thought\ncut off", "",
             call("get_weather", TRICKY) + "\n" + call("get_time", "{}"), "<|chan"]
    for text in texts:
        for calling in (NATIVE, None):
            thought, answer = FMT.split(text)
            content, calls = calling.parse(answer) if calling else (answer, [])
            got = every_chunking_agrees(text, reasoning=FMT, calling=calling)
            assert (got.reasoning, got.content) == (thought, content), text
            assert [c["function"] for c in got.tool_calls] == [c["function"] for c in calls], text


def test_what_is_no_call_stays_content():
    known = parse_output(call("unknown", "{a:1}") + call("get_time", "{}"), calling=NATIVE)
    assert known.content == call("unknown", "{a:1}") and len(known.tool_calls) == 1
    for text in (call("unknown", "{a:1}"), "<|tool_call>nope", "<|tool_call>call:get_time x", "<|tool_call>call:{}"):
        got = every_chunking_agrees("a " + text + " b", calling=NATIVE)
        assert got.tool_calls == [] and got.content == "a " + text + " b"
    assert parse_output("<|tool_call>call:get_ti", calling=NATIVE).content == "<|tool_call>call:get_ti"
    # after the handover to the tool nothing is the answer
    assert parse_output("x<|tool_response>response:y", calling=NATIVE).content == "x"


def test_a_call_cut_short_keeps_its_arguments_without_a_done():
    text = "<|tool_call>call:get_weather{city:" + Q + "Par"
    events, got = streamed(text, [3, 30], calling=NATIVE)
    assert not any(isinstance(e, ToolCallDone) for e in events)
    assert got.tool_calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Par'}
    # broken arguments: the call keeps what was sent, the rest of its text is dropped, what follows is content
    broken = every_chunking_agrees(call("get_time", "{a:1 b}") + "after", calling=NATIVE)
    assert broken.tool_calls[0]["function"]["arguments"] == '{"a": 1' and broken.content == "after"


def test_json_format_calls_wait_only_while_they_may_be_calls():
    parser = OutputParser(calling=JSON)
    assert parser.feed("Hello") == [ContentDelta("Hello")]   # not "{": content at once
    parser = OutputParser(calling=JSON)
    assert parser.feed(' {"name": "get_time", "parameters": {"zone"') == []
    assert parser.feed(': "utc"}}') == [] and parser.feed(" ") == []   # a call so far: held
    assert parser.feed("!") == [ContentDelta(' {"name": "get_time", "parameters": {"zone": "utc"}} !')]
    parser = OutputParser(calling=JSON)
    assert parser.feed('{"a": [1}') == [ContentDelta('{"a": [1}')]   # brackets that cannot close
    parser = OutputParser(calling=JSON)
    assert parser.feed('{"name": "other", "parameters": {}}') == [ContentDelta('{"name": "other", "parameters": {}}')]
    for text in (' {"name": "get_time", "arguments": {"zone": "cet"}}\n', '```json\n{"name": "get_time", '
                 '"parameters": {"zone": "x}"}}\n```', "no call", '{"name": "get_time"}', ""):
        got = every_chunking_agrees(text, calling=JSON)
        content, calls = JSON.parse(text)
        assert got.content == content and [c["function"] for c in got.tool_calls] == [c["function"] for c in calls]
    got = parse_output("<|channel>thought\nx<channel|>" + '{"name": "get_time", "parameters": {}}', reasoning=FMT,
                       calling=JSON)
    assert (got.reasoning, got.content, got.tool_calls[0]["function"]["name"]) == ("x", None, "get_time")


def test_special_texts_left_in_content_are_removed_even_when_cut():
    specials = ("<channel|>", "<eos>", "<eos_long>", "<|channel>")
    fmt = ReasoningFormat(1, 2, re.compile("|".join(map(re.escape, sorted(specials, key=len, reverse=True)))),
                          tuple(sorted(specials)))
    got = every_chunking_agrees("<|channel>thought\nr<channel|>A<eos>B<eos_long>C<eo", reasoning=fmt,
                                hide_specials=True)
    assert (got.reasoning, got.content) == ("r", "ABC<eo")
    assert parse_output("A<eos>", reasoning=fmt).content == "A<eos>"   # asked to show them


def test_parsers_share_no_state():
    """Two requests read side by side, piece by piece in turn, each as if alone."""
    a = "<|channel>thought\nfor a<channel|>A " + call("get_time", f"{{zone:{Q}u,}}{Q}}}")
    b = "B text " + call("get_weather", "{days:2}")
    pa, pb = OutputParser(FMT, NATIVE, seed="a"), OutputParser(FMT, NATIVE, seed="b")
    ea, eb = [], []
    for i in range(max(len(a), len(b))):
        ea += pa.feed(a[i:i + 1])
        eb += pb.feed(b[i:i + 1])
    ea, eb = ea + pa.finish(), eb + pb.finish()
    assert fold(ea, pa.thought, pa.content_optional) == parse_output(a, FMT, NATIVE, seed="a")
    assert fold(eb, pb.thought, pb.content_optional) == parse_output(b, FMT, NATIVE, seed="b")
    assert not any(isinstance(e, ReasoningDelta) for e in eb)


# -- property tests: random outputs, random chunkings ----------------------------------------------------------

_CHARS = st.sampled_from(list("ab {}[],:\"'\\\n<|>-.0é") + ["thought", "<|", "|>", "<|\"", "call:", "<channel"])
_TEXT = st.lists(_CHARS, max_size=12).map("".join).filter(
    lambda s: not any(m in s for m in ("<|channel>", "<channel|>", "<|tool_call>", "<|tool_response>", Q)))
_SCALARS = (st.integers(-10**6, 10**6) | st.floats(allow_nan=False, allow_infinity=False, width=32)
            | st.booleans() | st.none() | _TEXT)
_VALUES = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.from_regex(r"[a-z_][a-z0-9_]{0,5}", fullmatch=True), inner, max_size=3), max_leaves=8)


def gemma(value) -> str:
    """A value in Gemma 4's argument syntax."""
    if isinstance(value, str):
        return Q + value + Q
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{gemma(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(map(gemma, value)) + "]"
    return json.dumps(value)


_PART = st.one_of(
    st.tuples(st.just("think"), _TEXT), st.tuples(st.just("text"), _TEXT),
    st.tuples(st.just("call"), st.tuples(st.sampled_from(["get_time", "get_weather"]),
                                         st.dictionaries(st.from_regex(r"[a-z]{1,4}", fullmatch=True), _VALUES,
                                                         max_size=3))))


def native_text(parts) -> tuple[str, list[tuple[str, str]]]:
    """`_PART`s as Gemma 4 output text, and the calls it holds as (name, JSON arguments)."""
    text, calls = "", []
    for kind, body in parts:
        if kind == "think":
            text += f"<|channel>thought\n{body}<channel|>"
        elif kind == "text":
            text += body
        else:
            text += call(body[0], gemma(body[1]))
            calls.append((body[0], json.dumps(body[1], ensure_ascii=False)))
    return text, calls


@settings(max_examples=150, deadline=None)
@given(parts=st.lists(_PART, max_size=6), opened=st.booleans(), cuts=st.lists(st.integers(0, 400), max_size=40),
       chunk_seed=st.integers(0, 2**16))
def test_any_chunking_of_random_native_outputs_equals_the_whole(parts, opened, cuts, chunk_seed):
    text, calls = native_text(parts)
    kw = dict(reasoning=FMT, calling=NATIVE, starts_in_reasoning=opened, seed="s")
    whole = parse_output(text, **kw)
    rng = random.Random(chunk_seed)   # MTP-like: runs of 1-8 characters
    runs, i = [], 0
    while i < len(text):
        i += rng.randint(1, 8)
        runs.append(i)
    for chunking in (cuts, runs):
        events, got = streamed(text, [c for c in chunking if c <= len(text)], **kw)
        assert got == whole
        for done in (e for e in events if isinstance(e, ToolCallDone)):
            assert "".join(e.arguments for e in events if isinstance(e, ToolCallDelta) and e.index == done.index) \
                == done.arguments
    if not opened:   # (opened: the first call may sit in the thinking the prompt opened, ended by the call itself)
        got = [(c["function"]["name"], c["function"]["arguments"]) for c in whole.tool_calls]
        assert got == calls
        for _, arguments in got:
            json.loads(arguments)


@settings(max_examples=100, deadline=None)
@given(body=st.one_of(_TEXT, _VALUES.map(json.dumps),
                      st.dictionaries(st.sampled_from(["name", "parameters", "arguments", "x"]),
                                      st.sampled_from(["get_time", "x"]) | _VALUES).map(json.dumps)),
       pad=st.sampled_from(["", " ", "\n", " x"]), think=st.booleans(), cuts=st.lists(st.integers(0, 200), max_size=20))
def test_any_chunking_of_random_json_format_outputs_equals_the_whole(body, pad, think, cuts):
    text = ("<|channel>thought\nt<channel|>" if think else "") + pad[:1] + body + pad
    whole = parse_output(text, reasoning=FMT, calling=JSON, seed="s")
    assert streamed(text, [c for c in cuts if c <= len(text)], reasoning=FMT, calling=JSON, seed="s")[1] == whole
    content, calls = JSON.parse(FMT.split(text)[1])
    assert whole.content == content and [c["function"] for c in whole.tool_calls] == [c["function"] for c in calls]


def test_reasoning_tokens_count_every_channel_and_one_the_prompt_opened():
    """usage's reasoning_tokens: markers included, thinking again after a call, and thinking the prompt opened
    (which was counted 0: the count looked only for an output opening with the channel)."""
    b, e = FMT.begin_id, FMT.end_id
    assert FMT.reasoning_tokens([b, 7, 8, e, 9]) == 4
    assert FMT.reasoning_tokens([9, b, 7, e, 9, b, 7, 8, e]) == 7
    assert FMT.reasoning_tokens([7, 8, e, 9], opened=True) == 3
    assert FMT.reasoning_tokens([7, 8, e, 9]) == 0
    assert FMT.reasoning_tokens([b, 7, 8], opened=False) == 3   # cut short inside the channel
