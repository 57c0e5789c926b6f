"""The HTTP server, started for real on loopback with the embedded 270M, driven by the official
`openai` client (and raw HTTP for what a client library would refuse to send)."""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import socket
import time

import pytest
from helpers import assert_server_kv_clean

from gemmaserve import SamplingParams
from gemmaserve.bench.soak import metric_value, scrape_metrics

openai = pytest.importorskip("openai")

API_KEY = "test-key"
MAX_MODEL_LEN = 512
MAX_BODY = 1 << 20


@pytest.fixture(scope="module")
def server(llm_270m_q):
    from gemmaserve.config.engine import EngineConfig
    from gemmaserve.engine.llm_engine import LLMEngine
    from gemmaserve.server.app import ServerConfig
    from gemmaserve.server.background import BackgroundServer

    engine = LLMEngine(EngineConfig(max_model_len=MAX_MODEL_LEN, max_num_seqs=32), llm_270m_q.engine._loaded)
    with BackgroundServer(engine, ServerConfig(api_key=API_KEY, max_request_bytes=MAX_BODY)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)


def _engine(server, fn):
    return server.server.async_engine.call_blocking(fn)


def _wait_idle(server, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while _engine(server, lambda e: e.has_unfinished_requests()):
        assert time.monotonic() < deadline, "requests still running"
        time.sleep(0.05)


def _greedy(llm, prompt: str, max_tokens: int):
    return llm.generate([prompt], SamplingParams(max_tokens=max_tokens))[0].outputs[0]


def _raw(server, method: str, path: str, body: bytes | str | dict | None = None,
         headers: dict | None = None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    hdrs = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    hdrs.update(headers or {})
    hdrs = {k: v for k, v in hdrs.items() if v is not None}
    if isinstance(body, dict):
        body = json.dumps(body)
    conn.request(method, path, body=body, headers=hdrs)
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, json.loads(data) if data else {}


# -- the happy paths ------------------------------------------------------------------------------------
def test_models_health_and_open_probes(server, client):
    assert [m.id for m in client.models.list().data] == ["gemma3-270m"]
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("GET", "/health")   # probes need no API key
    resp = conn.getresponse()
    assert resp.status == 200 and json.loads(resp.read()) == {"status": "ok"}


def test_completion_is_the_engines_greedy_output(server, client, llm_270m_q):
    prompt = "The river runs past the old mill and"
    ref = _greedy(llm_270m_q, prompt, 12)
    r = client.completions.create(model="gemma3-270m", prompt=prompt, max_tokens=12, temperature=0)
    assert r.choices[0].text == ref.text and r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.prompt_tokens == len(llm_270m_q.tokenizer.encode(prompt))
    assert r.usage.completion_tokens == len(ref.token_ids) and r.usage.total_tokens == r.usage.prompt_tokens + 12
    assert r.object == "text_completion" and r.id.startswith("cmpl-")


def test_streamed_text_equals_non_streamed_text(client):
    args = dict(model="gemma3-270m", prompt="Once upon a time, in a village by the sea,", max_tokens=12, temperature=0)
    whole = client.completions.create(**args)
    chunks = list(client.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason

    msgs = [{"role": "user", "content": "Name three colours."}]
    whole = client.chat.completions.create(model="gemma3-270m", messages=msgs, max_tokens=10, temperature=0)
    chunks = list(client.chat.completions.create(model="gemma3-270m", messages=msgs, max_tokens=10, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_streamed_choices_of_several_prompts_and_completions(client):
    """n > 1 and a list of prompts, streamed: choice indices interleave, each assembles to its
    non-streamed text (same seed); echo puts each prompt in front of its choices once."""
    args = dict(model="gemma3-270m", prompt=["Red is", "Blue is"], n=2, max_tokens=4, temperature=0.8, seed=3,
                echo=True)
    whole = {c.index: c.text for c in client.completions.create(**args).choices}
    streamed: dict[int, str] = {}
    for ch in client.completions.create(**args, stream=True):
        for c in ch.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == whole and whole[0].startswith("Red is") and whole[3].startswith("Blue is")
    chat = dict(model="gemma3-270m", messages=[{"role": "user", "content": "Hi"}], n=2, max_tokens=4,
                temperature=0.8, seed=3)
    whole = {c.index: c.message.content for c in client.chat.completions.create(**chat).choices}
    streamed, finished = {}, set()
    for ch in client.chat.completions.create(**chat, stream=True):
        for c in ch.choices:
            streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finished.add(c.index)
    assert streamed == whole and finished == {0, 1}


def test_reasoning_effort_on_a_model_that_does_not_think(client):
    """Gemma 3 has no thought channel: "none" is what it does anyway, a level above it is a clear 400."""
    args = dict(model="gemma3-270m", messages=[{"role": "user", "content": "Hi"}], max_tokens=2, temperature=0)
    assert client.chat.completions.create(**args, reasoning_effort="none").usage.completion_tokens == 2
    with pytest.raises(openai.BadRequestError, match="reasoning_effort: gemma3-270m does not think"):
        client.chat.completions.create(**args, reasoning_effort="low")


def test_chat_uses_the_gemma_turn_format(client, llm_270m_q):
    """The embedded 270M ships no chat template: the Gemma turn format is used (system text opens
    the first user turn)."""
    msgs = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is the sea?"}]
    rendered = "<start_of_turn>user\nAnswer briefly.\n\nWhat is the sea?<end_of_turn>\n<start_of_turn>model\n"
    ref = _greedy(llm_270m_q, rendered, 16)
    r = client.chat.completions.create(model="gemma3-270m", messages=msgs, max_tokens=16, temperature=0)
    assert r.choices[0].message.content == ref.text and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(llm_270m_q.tokenizer.encode(rendered))


def test_checkpoint_chat_template_is_used_without_a_second_bos(llm_270m_q):
    import dataclasses

    from gemmaserve.models.chat_template import ChatFormatter, ChatMessage, gemma_turns

    template = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m.role == 'assistant' else "
                "m.role }}\n{{ m.content | trim }}<end_of_turn>\n{% endfor %}"
                "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
    tok = dataclasses.replace(llm_270m_q.tokenizer, chat_template=template)
    msgs = [ChatMessage("user", "Hi there"), ChatMessage("assistant", "Hello."), ChatMessage("user", "Bye")]
    fmt = ChatFormatter(tok)
    assert fmt.source == "checkpoint template"
    ids = fmt.encode(msgs)
    assert ids == llm_270m_q.tokenizer.encode(gemma_turns(msgs)) and ids.count(tok.bos_token_id) == 1


def test_tokenize_and_detokenize_as_vllm_shapes_them(server, client, llm_270m_q):
    """/tokenize counts what the generation routes would feed the model: a prompt as /v1/completions tokenises it
    (BOS unless add_special_tokens is false), messages as the chat route renders them (the usage it reports);
    /detokenize gives the text back; bad input is a 400 naming the field, never a 5xx."""
    tok = llm_270m_q.tokenizer
    counted = metric_value(scrape_metrics(server.port), "gemmaserve_http_requests_total", '{status="200"}')
    status, body = _raw(server, "POST", "/tokenize", {"prompt": "The sea is", "return_token_strs": True})
    assert status == 200 and body["tokens"] == tok.encode("The sea is") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == MAX_MODEL_LEN and "".join(body["token_strs"]) == tok.decode(
        body["tokens"], skip_special_tokens=False)
    status, plain = _raw(server, "POST", "/tokenize", {"prompt": "The sea is", "add_special_tokens": False})
    assert status == 200 and plain["tokens"] == body["tokens"][1:] and plain["token_strs"] is None
    msgs = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is the sea?"}]
    status, chat = _raw(server, "POST", "/tokenize", {"model": "gemma3-270m", "messages": msgs})
    r = client.chat.completions.create(model="gemma3-270m", messages=msgs, max_tokens=1, temperature=0)
    assert status == 200 and chat["count"] == r.usage.prompt_tokens
    status, back = _raw(server, "POST", "/detokenize", {"tokens": chat["tokens"]})
    assert status == 200 and back["prompt"].startswith("<bos><start_of_turn>user\nAnswer briefly.")
    for path, bad, param in (("/tokenize", {"prompt": "a", "messages": msgs}, "messages"), ("/tokenize", {}, "prompt"),
                             ("/tokenize", {"prompt": 3}, "prompt"), ("/detokenize", {"tokens": [1, 10 ** 9]}, "tokens"),
                             ("/detokenize", {"tokens": "abc"}, "tokens"), ("/tokenize", {"prompt": "a", "model": "x"},
                                                                           "model")):
        status, err = _raw(server, "POST", path, bad)
        assert 400 <= status < 500 and err["error"]["param"] == param, (path, bad, status, err)
    assert _raw(server, "POST", "/tokenize", {"prompt": "a"}, {"Authorization": None})[0] == 401
    # counted as /v1 requests are (the chat completion above is one of the 5 answered with 200)
    assert metric_value(scrape_metrics(server.port), "gemmaserve_http_requests_total", '{status="200"}') == counted + 5


def test_n_seed_stop_and_logprobs(client, llm_270m_q):
    args = dict(model="gemma3-270m", prompt="My favourite food is", max_tokens=8, temperature=0.9, n=3, seed=11)
    a = client.completions.create(**args)
    b = client.completions.create(**args)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]   # same seed, same completions
    assert len({c.text for c in a.choices}) > 1 and a.usage.completion_tokens == 24

    two = client.completions.create(model="gemma3-270m", prompt=["Red", "Blue"], max_tokens=4, temperature=0, n=2)
    assert [c.index for c in two.choices] == [0, 1, 2, 3]
    assert two.choices[0].text == two.choices[1].text == _greedy(llm_270m_q, "Red", 4).text
    assert two.choices[2].text == _greedy(llm_270m_q, "Blue", 4).text

    prompt = "The capital of France is"
    ref = _greedy(llm_270m_q, prompt, 16).text
    word = ref.split()[2]
    r = client.completions.create(model="gemma3-270m", prompt=prompt, max_tokens=16, temperature=0, stop=[word])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == ref[:ref.index(word)]

    r = client.completions.create(model="gemma3-270m", prompt=prompt, max_tokens=6, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == r.choices[0].text and lp.text_offset[0] == 0
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and 1 <= len(top) <= 2 and abs(max(top.values()) - chosen) < 1e-4   # greedy: the best

    r = client.chat.completions.create(model="gemma3-270m", messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=5, temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens and all(len(t.top_logprobs) == 3 for t in content)
    assert content[0].top_logprobs[0].logprob == pytest.approx(content[0].logprob, abs=1e-4)


def test_32_concurrent_requests(server, llm_270m_q):
    prompts = [f"Story {i}: the {w} was" for i, w in enumerate(
        ("farmer miller baker smith sailor tailor weaver hunter " * 4).split())]
    refs = [o.outputs[0].text for o in llm_270m_q.generate(prompts, SamplingParams(max_tokens=8))]

    async def run() -> list[str]:
        aclient = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)

        async def one(i: int, p: str) -> str:
            if i % 2:
                stream = await aclient.completions.create(model="gemma3-270m", prompt=p, max_tokens=8,
                                                          temperature=0, stream=True)
                return "".join([c.choices[0].text async for c in stream if c.choices])
            r = await aclient.completions.create(model="gemma3-270m", prompt=p, max_tokens=8, temperature=0)
            return r.choices[0].text

        try:
            return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        finally:
            await aclient.close()

    assert asyncio.run(run()) == refs
    _wait_idle(server)
    assert_server_kv_clean(server)


def _open_stream(server, body: dict) -> socket.socket:
    payload = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return sock


def test_a_client_that_disconnects_aborts_its_request(server):
    before = metric_value(scrape_metrics(server.port), "gemmaserve_requests_total", '{finish_reason="abort"}')
    body = dict(model="gemma3-270m", prompt="Tell me a long story about", max_tokens=400, ignore_eos=True,
                temperature=0)
    sock = _open_stream(server, {**body, "stream": True})   # streaming: leave after a few events
    seen = b""
    while seen.count(b"data: ") < 3:
        seen += sock.recv(4096)
    sock.close()
    sock = _open_stream(server, body)   # not streaming: leave while it runs
    time.sleep(0.5)
    sock.close()
    _wait_idle(server, timeout=30)
    text = scrape_metrics(server.port)
    assert metric_value(text, "gemmaserve_requests_total", '{finish_reason="abort"}') == before + 2
    assert_server_kv_clean(server)


# -- bad input ----------------------------------------------------------------------------------------------
GOOD = {"model": "gemma3-270m", "prompt": "Hello", "max_tokens": 2}
CHAT = {"model": "gemma3-270m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


@pytest.mark.parametrize("path, body, headers, status, param", [
    ("/v1/completions", b"{not json", None, 400, None),
    ("/v1/completions", b"[1, 2]", None, 400, None),
    ("/v1/completions", {**GOOD, "max_tokens": "5"}, None, 400, "max_tokens"),
    ("/v1/completions", {**GOOD, "temperature": "hot"}, None, 400, "temperature"),
    ("/v1/completions", {**GOOD, "prompt": 5}, None, 400, "prompt"),
    ("/v1/completions", {"model": "gemma3-270m"}, None, 400, "prompt"),
    ("/v1/completions", {**GOOD, "prompt": ""}, None, 400, "prompt"),
    ("/v1/completions", {**GOOD, "prompt": []}, None, 400, "prompt"),
    ("/v1/completions", {**GOOD, "prompt": [1, 999999999]}, None, 400, "prompt"),
    ("/v1/completions", {**GOOD, "prompt": "word " * 600}, None, 400, "prompt"),
    ("/v1/completions", {**GOOD, "max_tokens": MAX_MODEL_LEN}, None, 400, "prompt"),
    ("/v1/completions", {**GOOD, "temperature": -1}, None, 400, "temperature"),
    ("/v1/completions", {**GOOD, "top_p": 0}, None, 400, "top_p"),
    ("/v1/completions", {**GOOD, "top_p": 1.5}, None, 400, "top_p"),
    ("/v1/completions", {**GOOD, "n": 0}, None, 400, "n"),
    ("/v1/completions", {**GOOD, "max_tokens": 0}, None, 400, "max_tokens"),
    ("/v1/completions", {**GOOD, "logprobs": 50}, None, 400, "logprobs"),
    ("/v1/completions", {**GOOD, "presence_penalty": 5}, None, 400, "presence_penalty"),
    ("/v1/completions", {**GOOD, "stop": [""]}, None, 400, "stop"),
    ("/v1/completions", {**GOOD, "logit_bias": {"5": 1.0}}, None, 400, "logit_bias"),
    # Found by the API fuzzer (test_server_fuzz.py): values that overflowed float32 in the sampler (500s).
    ("/v1/completions", {**GOOD, "top_p": 5e-324}, None, 400, "top_p"),
    ("/v1/completions", {**GOOD, "repetition_penalty": 5e-324}, None, 400, "repetition_penalty"),
    ("/v1/completions", {**GOOD, "seed": 2 ** 80}, None, 400, "seed"),
    ("/v1/completions", {**GOOD, "request_timeout": 0}, None, 400, "request_timeout"),
    # Refused after admission: the completions are withdrawn (test_kv_is_clean_after_everything counts them).
    ("/v1/completions", {**GOOD, "kv_transfer_params": {"transfer_id": "x"}}, None, 400, "kv_transfer_params"),
    ("/v1/chat/completions", {"model": "gemma3-270m"}, None, 400, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, None, 400, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, None, 400, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": 7}]}, None, 400, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "assistant", "content": "x"}]}, None, 400, "messages"),
    # Found by schemathesis: a content part's `type` that is no string was a 500 (unhashable type).
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": {}, "text": "hi"}]}]}, None,
     400, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": ["text"], "text": "hi"}]}]},
     None, 400, "messages"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, None, 400, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]}, None, 400, "tools"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "go " * 600}]}, None, 400,
     "messages"),
    ("/v1/completions", {**GOOD, "model": "gpt-4"}, None, 404, "model"),
    ("/v1/chat/completions", {**CHAT, "model": "gpt-4"}, None, 404, "model"),
    ("/v1/completions", GOOD, {"Authorization": None}, 401, None),
    ("/v1/completions", GOOD, {"Authorization": "Bearer wrong"}, 401, None),
    ("/v1/models", None, {"Authorization": "Basic abc"}, 401, None),
    ("/v1/completions", {**GOOD, "prompt": "x" * MAX_BODY}, None, 413, None),
    ("/v1/nothing", GOOD, None, 404, None),
])
def test_bad_input_gets_an_openai_error(server, path, body, headers, status, param):
    method = "GET" if path == "/v1/models" else "POST"
    code, data = _raw(server, method, path, body, headers)
    assert code == status, data
    err = data["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param


@pytest.mark.parametrize("path, body, field", [
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 100}, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("/v1/completions", {**GOOD, "logprobs": 100}, "logprobs"),
    ("/v1/completions", {**GOOD, "logprobs": -1}, "logprobs"),
])
def test_a_logprob_count_out_of_range_names_its_field_and_the_range(server, path, body, field):
    from gemmaserve.engine.sampling_params import MAX_LOGPROBS

    code, data = _raw(server, "POST", path, body)
    assert code == 400 and data["error"]["param"] == field
    assert data["error"]["message"] == f"{field} must be an integer in [0, {MAX_LOGPROBS}], got {body[field]}"


def test_a_wrong_method_is_a_client_error_naming_the_allowed_ones(server):
    """Found by schemathesis: a 405 said type server_error and had no Allow header (RFC 9110 requires it)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("PUT", "/v1/completions", body=json.dumps(GOOD), headers={"Authorization": f"Bearer {API_KEY}"})
    resp = conn.getresponse()
    err = json.loads(resp.read())["error"]
    conn.close()
    assert resp.status == 405 and resp.getheader("Allow") == "POST", resp.getheaders()
    assert err["type"] == "invalid_request_error" and "PUT" in err["message"]


def test_oversized_chunked_body_is_413(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    chunks = (b"x" * 65536 for _ in range(MAX_BODY // 65536 + 2))   # no Content-Length: chunked
    conn.request("POST", "/v1/completions", body=chunks, headers={"Authorization": f"Bearer {API_KEY}"},
                 encode_chunked=True)
    resp = conn.getresponse()
    assert resp.status == 413 and json.loads(resp.read())["error"]["code"] == "request_too_large"


def test_client_library_sees_typed_errors(server, client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="gemma3-270m", prompt="x", temperature=-1)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    bad = openai.OpenAI(base_url=server.base_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_an_internal_failure_fails_only_its_request(server, client, llm_270m_q):
    engine = server.server.async_engine._engine
    launch = engine._runner.launch

    def flaky(plan, only=None):
        seqs = plan.seqs if only is None else [plan.seqs[i] for i in only]
        if any("POISON" in engine._request(s.req_id).prompt for s in seqs):
            raise RuntimeError("injected failure")
        return launch(plan, only)

    prompts = ["A quiet morning in", "POISON pill", "The harbour at night", "POISON stream"]
    refs = {p: _greedy(llm_270m_q, p, 6).text for p in prompts[::2]}
    engine._runner.launch = flaky
    try:
        async def run():
            aclient = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0)

            async def one(p: str):
                try:
                    if p == "POISON stream":
                        s = await aclient.completions.create(model="gemma3-270m", prompt=p, max_tokens=6,
                                                             temperature=0, stream=True)
                        return "".join([c.choices[0].text async for c in s if c.choices])
                    r = await aclient.completions.create(model="gemma3-270m", prompt=p, max_tokens=6, temperature=0)
                    return r.choices[0].text
                except openai.APIError as exc:
                    return exc

            try:
                return await asyncio.gather(*(one(p) for p in prompts))
            finally:
                await aclient.close()

        results = dict(zip(prompts, asyncio.run(run())))
    finally:
        engine._runner.launch = launch
    assert isinstance(results["POISON pill"], openai.InternalServerError)
    assert isinstance(results["POISON stream"], openai.APIError)
    assert "injected failure" in str(results["POISON stream"])
    for p, text in refs.items():
        assert results[p] == text
    assert client.completions.create(model="gemma3-270m", prompt="Still up?", max_tokens=2).usage.completion_tokens == 2
    _wait_idle(server)
    assert_server_kv_clean(server)


def test_metrics_report_the_traffic(server, client):
    long_prompt = "The harbour master counted the ships that came in with the evening tide. " * 4
    for _ in range(2):   # the second run finds the first one's full pages in the prefix cache
        client.completions.create(model="gemma3-270m", prompt=long_prompt, max_tokens=3, temperature=0)
    assert _raw(server, "POST", "/v1/completions", {**GOOD, "n": -1})[0] == 400
    text = scrape_metrics(server.port)
    for name in ("gemmaserve_prompt_tokens_total", "gemmaserve_generation_tokens_total",
                 "gemmaserve_time_to_first_token_seconds_count", "gemmaserve_inter_token_latency_seconds_count",
                 "gemmaserve_e2e_request_latency_seconds_count", "gemmaserve_kv_pages_total"):
        assert metric_value(text, name) > 0, name
    assert metric_value(text, "gemmaserve_requests_total", '{finish_reason="length"}') > 0
    assert metric_value(text, "gemmaserve_kv_pages", '{state="free"}') > 0
    for name in ("gemmaserve_num_requests_waiting", "gemmaserve_num_requests_running", "gemmaserve_preemptions_total",
                 "gemmaserve_prefix_cache_hit_rate", 'gemmaserve_kv_pages{state="cached"}',
                 'gemmaserve_http_errors_total{status="400"}'):
        assert re.search(rf"^{re.escape(name)} ", text, re.M), name
    assert metric_value(text, "gemmaserve_prefix_cache_hit_tokens_total") >= 48


def test_kv_is_clean_after_everything(server):
    _wait_idle(server)
    assert_server_kv_clean(server)


@pytest.mark.parametrize("args, needle", [
    (["--api-key", " "], "api_key must be a non-empty string"),
    (["--port", "70000"], "must be a port in [0, 65535]"),
    (["--max-request-bytes", "10"], "max_request_bytes must be at least 1KiB"),
])
def test_serve_rejects_bad_options(args, needle, capsys):
    """Checked before the model loads: argparse's own check (exit 2) or the config's (status 2)."""
    import contextlib

    from gemmaserve.cli import main

    with pytest.raises(SystemExit) if args[0] == "--port" else contextlib.nullcontext():
        assert main(["serve", *args]) == 2
    assert needle in capsys.readouterr().err


def test_serve_command(tmp_path):
    """`gemmaserve serve` as users start it: any free port, ready once loaded, a completion, a clean exit
    on Ctrl-C."""
    import signal
    import urllib.error
    import urllib.request

    from helpers import serve_process

    # Eager: this test is about the process's life cycle; compiled steps are tests/test_compiled_decode.py's
    proc, port = serve_process("--max-model-len", "256", "--cpu-compile", "off")
    try:
        deadline = time.monotonic() + 120
        while True:   # it listens at once and answers 503 until the model has loaded
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30).status == 200:
                    break
            except urllib.error.HTTPError as exc:
                assert exc.code == 503 and time.monotonic() < deadline
            time.sleep(0.1)
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", method="POST",
                                     data=json.dumps({"prompt": "Hello", "max_tokens": 3}).encode(),
                                     headers={"Content-Type": "application/json"})
        body = json.loads(urllib.request.urlopen(req, timeout=60).read())
        assert body["usage"]["completion_tokens"] == 3
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()
