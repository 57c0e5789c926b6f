"""Thinking (Gemma 4's thought channel): chat_template_kwargs reach the template; the reasoning comes back apart
(`reasoning_content`, streamed as its own deltas) and is counted in usage; a response format or tool grammar
starts where the reasoning ends; transcripts never hold it. The tiny model's output is scripted (its logits put
on chosen tokens) so that it thinks as a trained one does."""

import json
import random

import pytest
import torch

from gemmaserve.engine.structured.structured_output import Grammars, StructuredOutput
from gemmaserve.server.reasoning import ReasoningFormat, ReasoningStream

from helpers import CHANNEL_BEGIN, CHANNEL_END, add_special_tokens, scripted_logits, tiny_gemma4_hf, write_tokenizer

TEMPLATE = ("{{ bos_token }}{% if enable_thinking %}<|think|>{% endif %}{% for m in messages %}<start_of_turn>"
            "{{ m.role }}\n{{ m.content }}<end_of_turn>\n{% endfor %}<start_of_turn>model\n")
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    """A tiny Gemma 4 whose tokenizer has the channel markers and whose chat template takes enable_thinking."""
    from gemmaserve import LLM

    path = tmp_path_factory.mktemp("thinker")
    hf = tiny_gemma4_hf(11, "31b")
    hf.save_pretrained(path, safe_serialization=True)
    write_tokenizer(path, 290)
    add_special_tokens(path, {CHANNEL_BEGIN: "<|channel>", CHANNEL_END: "<channel|>"})
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TEMPLATE}))
    return path, LLM(str(path), dtype="float32", kv_cache_memory=8 << 20, cpu_compile="off")


def _script(llm, thought: str, answer: str = "") -> list[int]:
    tok = llm.tokenizer
    return ([CHANNEL_BEGIN] + tok.encode("thought\n" + thought, add_special_tokens=False) + [CHANNEL_END]
            + tok.encode(answer, add_special_tokens=False))


def test_the_stream_splitter_agrees_with_the_whole_text_at_any_cut():
    fmt = ReasoningFormat(1, 2)
    cases = {"<|channel>thought\nI think<channel|>The answer.": ("I think", "The answer."),
             "plain <channel|> x": (None, "plain <channel|> x"), "<|channel>thought\ncut off": ("cut off", ""),
             "<|channel>thought<channel|>A": ("", "A"), "<|channel>thoughtful<channel|>A": ("thoughtful", "A"),
             "<|channel>thought\nplan<|tool_call>call:f{}<tool_call|>": ("plan", "<|tool_call>call:f{}<tool_call|>"),
             "\n<|channel>thought\nr<channel|>\nA": ("r", "\nA"), "": (None, ""), "<|chan": (None, "<|chan")}
    rng = random.Random(0)
    for text, want in cases.items():
        assert fmt.split(text) == want, text
        for _ in range(100):
            cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 6)))) + [len(text)]
            stream, got, prev = ReasoningStream(fmt), ["", ""], 0
            for c in cuts:
                for k, part in enumerate(stream.feed(text[prev:c])):
                    got[k] += part
                prev = c
            for k, part in enumerate(stream.finish()):
                got[k] += part
            assert ((got[0] if stream.thought else None), got[1]) == want, (text, cuts)
    assert fmt.reasoning_tokens([1, 5, 6, 2, 7]) == 4 and fmt.reasoning_tokens([5, 1]) == 1   # opened late


def test_a_grammar_starts_where_the_reasoning_ends(thinker):
    """The gate alone (xgrammar, our tokenizer): the first token may open the channel or start the JSON; inside
    it anything goes; after its end only the grammar's tokens; drafts are checked the same way."""
    path, llm = thinker
    grammars = Grammars(llm.tokenizer, llm.engine._model.vocab_size)
    so = StructuredOutput.json_schema(SCHEMA)
    gated = grammars.matcher(StructuredOutput(so.kind, so.spec, (CHANNEL_BEGIN, CHANNEL_END)))
    plain = grammars.matcher(so)

    def allowed(state) -> set[int]:
        mask = grammars.bitmask(1)
        grammars.fill([state], mask, [0])
        bits = [(int(w) & 0xFFFFFFFF) >> b & 1 for w in mask[0].tolist() for b in range(32)]
        return {t for t, on in enumerate(bits[:llm.engine._model.vocab_size]) if on}

    brace = llm.tokenizer.encode("{", add_special_tokens=False)[0]
    first = allowed(gated)
    assert CHANNEL_BEGIN in first and brace in first and first - {CHANNEL_BEGIN} == allowed(plain)
    thought = _script(llm, "x = 1")[:-1]
    assert gated.allowed_prefix(thought + [CHANNEL_END, brace, 5]) == len(thought) + 2   # 5: not JSON
    for t in thought:
        gated.accept(t)
        assert len(allowed(gated)) == llm.engine._model.vocab_size   # inside the channel: anything
    gated.accept(CHANNEL_END)
    assert allowed(gated) == allowed(plain) and CHANNEL_BEGIN not in allowed(gated)
    with pytest.raises(Exception, match="does not fit"):
        grammars.matcher(so).accept(CHANNEL_BEGIN)   # without the gate the channel cannot open


def test_chat_reasoning_through_the_openai_client(thinker):
    openai = pytest.importorskip("openai")
    from gemmaserve.config.engine import EngineConfig
    from gemmaserve.engine.llm_engine import LLMEngine
    from gemmaserve.server.background import BackgroundServer
    from gemmaserve.server.config import ServerConfig

    path, llm = thinker
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", kv_cache_memory=8 << 20, cpu_compile="off"),
                       llm.engine._loaded)
    script = _script(llm, "two and two")
    calls = scripted_logits(engine._model, script)
    messages = [{"role": "user", "content": "what is it"}]
    thinking = {"chat_template_kwargs": {"enable_thinking": True}}
    try:
        with BackgroundServer(engine, ServerConfig()) as srv:
            client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0, timeout=300)

            def ask(**kw):
                calls.clear()
                return client.chat.completions.create(model=str(path), messages=messages, temperature=0,
                                                      max_tokens=len(script) + 12, **kw)

            # the template sees enable_thinking (its "<|think|>" takes 9 byte tokens here)
            on, off = ask(extra_body=thinking), ask()
            assert on.usage.prompt_tokens == off.usage.prompt_tokens + 9
            assert on.choices[0].message.reasoning_content == "two and two"
            assert "two and two" not in on.choices[0].message.content and "<" not in on.choices[0].message.content
            assert on.usage.completion_tokens_details.reasoning_tokens == len(script)
            # streamed: the same reasoning and answer, as their own deltas
            calls.clear()
            chunks = list(client.chat.completions.create(model=str(path), messages=messages, temperature=0,
                                                         max_tokens=len(script) + 12, stream=True,
                                                         stream_options={"include_usage": True}, extra_body=thinking))
            deltas = [c.choices[0].delta for c in chunks if c.choices]
            assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "two and two"
            assert "".join(d.content or "" for d in deltas) == on.choices[0].message.content
            assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == len(script)
            # a schema does not stop the thinking: the JSON comes after it, valid
            fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
            js = ask(response_format=fmt, extra_body=thinking)
            assert js.choices[0].message.reasoning_content == "two and two"
            assert set(json.loads(js.choices[0].message.content)) == {"a"}
            # include_reasoning false: one text, as the model wrote it (markers dropped)
            raw = ask(extra_body={**thinking, "include_reasoning": False})
            assert raw.choices[0].message.content.startswith("thought\ntwo and two")
            with pytest.raises(openai.BadRequestError, match="may not set messages"):
                ask(extra_body={"chat_template_kwargs": {"messages": []}})
            # reasoning_effort: "none" is off, any level on; an explicit enable_thinking wins; a bad level is a 400
            for effort, kw, tokens in (("low", {}, on), ("high", {}, on), ("none", {}, off),
                                       ("none", thinking, on)):
                got = ask(reasoning_effort=effort, extra_body=kw)
                assert got.usage.prompt_tokens == tokens.usage.prompt_tokens, (effort, kw)
            with pytest.raises(openai.BadRequestError, match="reasoning_effort"):
                ask(reasoning_effort="extreme")
    finally:
        del engine._model.compute_logits


def test_llm_chat_passes_template_kwargs(thinker):
    from gemmaserve import SamplingParams

    _, llm = thinker
    params = SamplingParams(max_tokens=1)
    on = llm.chat([{"role": "user", "content": "hi"}], params, chat_template_kwargs={"enable_thinking": True})
    off = llm.chat([{"role": "user", "content": "hi"}], params)
    assert llm.tokenizer.decode(on.prompt_token_ids).count("<|think|>") == 1
    assert "<|think|>" not in llm.tokenizer.decode(off.prompt_token_ids)
    assert torch.tensor(on.prompt_token_ids).numel() == len(off.prompt_token_ids) + 9
