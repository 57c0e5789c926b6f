"""The chat page at `/`, in a real headless Chromium (Debian's chromium + chromium-driver, driven by Selenium) against
a real server: it loads without the API key and then sends the one typed in; a typed message streams an answer equal
to the API's greedy one, in visible steps; thinking comes folded, tool calls shown; uploads become image_url and
input_audio parts (with previews); stop aborts the request in the engine; errors are shown and leave the
conversation usable; nothing but the server is ever requested. The tiny model's tokenizer knows the thought channel
and the tool-call tokens; where a test needs it to think or call, its logits are scripted."""

import json
import random
import re
import shutil
import time
import urllib.error
import urllib.request
import wave
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from gemmaserve.config.engine import EngineConfig
from gemmaserve.engine.llm_engine import LLMEngine
from gemmaserve.server.background import BackgroundServer
from gemmaserve.server.chat_page import STATIC_DIR
from gemmaserve.server.config import ServerConfig

from helpers import (CHANNEL_BEGIN, CHANNEL_END, add_special_tokens, assert_server_kv_clean, fresh_seed, save_checkpoint,
                     tiny_hf_model)

KEY = "page-key"
MODEL = "tiny"
CALL_BEGIN, CALL_END, QUOTE = 288, 289, 290
SPECIALS = {CALL_BEGIN: "<|tool_call>", CALL_END: "<tool_call|>", QUOTE: '<|"|>', 291: "<|tool_response>",
            CHANNEL_BEGIN: "<|channel>", CHANNEL_END: "<channel|>"}
TEMPLATE = ("{{ bos_token }}{% if enable_thinking %}<|think|>{% endif %}{% if tools %}tools:{% for t in tools %} "
            "{{ t.function.name }}{% endfor %}\n{% endif %}{% for m in messages %}{{ m.role }}: {{ m.content }}\n"
            "{% endfor %}model:")
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"]}}}
BROWSER_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--window-size=1200,900")


class Steering:
    """The model's logits, steered: a script's tokens forced first (one per logits call: one request at a time), and
    `delay` seconds per call, so that a stream comes in visible steps."""

    def __init__(self, model):
        self.script: list[int] = []
        self.delay = 0.0
        self.calls = 0
        original = model.compute_logits

        def steered(hidden):
            time.sleep(self.delay)
            logits = original(hidden)
            if self.calls < len(self.script):
                logits = torch.full_like(logits, -1e4)
                logits[:, self.script[self.calls]] = 0.0
            self.calls += 1
            return logits

        model.compute_logits = steered

    def play(self, script: list[int], delay: float = 0.0) -> None:
        self.script, self.delay, self.calls = script, delay, 0


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = save_checkpoint(tiny_hf_model(fresh_seed()), tmp_path_factory.mktemp("chat_page") / "m")
    add_special_tokens(path, SPECIALS)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TEMPLATE}))
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", page_size=4, kv_cache_memory=8 << 20,
                                    cpu_compile="off"))
    steering = Steering(engine._model)
    with BackgroundServer(engine, ServerConfig(api_key=KEY, served_model_name=[MODEL])) as srv:
        yield srv, steering, Tokenizer.from_file(str(path / "tokenizer.json"))


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if not (chromium and driver_path):
        pytest.skip("NO CHROMIUM: the chat page's browser tests did not run. Install Debian's chromium and "
                    "chromium-driver (the README's test command does when they are missing).")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in BROWSER_FLAGS:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"performance": "ALL", "browser": "ALL"})
    driver = webdriver.Chrome(service=Service(driver_path), options=options)   # no Selenium Manager: no downloads
    yield driver
    driver.quit()


# -- the page, driven --------------------------------------------------------------------------------------------

def _wait(driver, script: str, timeout: float = 60.0):
    """The value of `script` (JS, `return ...`) once it is truthy."""
    deadline = time.monotonic() + timeout
    while not (value := driver.execute_script(script)):
        assert time.monotonic() < deadline, f"timed out waiting for: {script}"
        time.sleep(0.02)
    return value


def _open(driver, srv, key: str | None = KEY) -> None:
    """Load the page and give it the key; returns once the model list has come."""
    driver.get(srv.base_url + "/")
    _wait(driver, "return window.document.readyState === 'complete'")
    if key is not None:
        field = driver.find_element("id", "api-key")
        field.clear()
        field.send_keys(key + "\t")   # the change event reloads the models
        _wait(driver, f"return [...document.querySelectorAll('#model option')].some(o => o.value === '{MODEL}')")
    _requests(driver)   # forget what loading did


def _setting(driver, field: str, value: str) -> None:
    el = driver.find_element("id", field)
    if el.tag_name == "select":
        driver.execute_script("arguments[0].value = arguments[1]", el, value)
    else:
        el.clear()
        el.send_keys(value)


def _send(driver, text: str) -> int:
    """Type `text` and press Enter; the index of the answer it starts."""
    n = len(driver.find_elements("css selector", "article.assistant"))
    driver.find_element("id", "prompt").send_keys(text + "\n")
    return n


def _answer(driver, index: int, states=("done", "error", "stopped")) -> dict:
    """The `index`-th answer on the page once it is in one of `states`."""
    return _wait(driver, f"""
        const a = document.querySelectorAll('article.assistant')[{index}];
        if (!a || !{json.dumps(list(states))}.includes(a.dataset.state)) return null;
        return {{state: a.dataset.state, status: a.querySelector('.status').textContent,
                content: a.querySelector('.content').textContent,
                thinking_shown: !a.querySelector('details.thinking').hidden,
                thinking_open: a.querySelector('details.thinking').open,
                reasoning: a.querySelector('details.thinking pre').textContent,
                tools: [...a.querySelectorAll('.tool-call')].map(c => [c.querySelector('.tool-name').textContent,
                                                                      c.querySelector('.tool-arguments').textContent])}};
    """)


def _requests(driver) -> list[dict]:
    """Network requests the page made since the last call (Chrome's performance log); each one went to the server
    or stayed in the page (the page works offline)."""
    out = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            request = message["params"]["request"]
            assert request["url"].startswith(("http://127.0.0.1:", "data:", "blob:")), request["url"]
            out.append(request)
    return out


def _chat_requests(driver) -> list[dict]:
    return [r for r in _requests(driver) if r["url"].endswith("/v1/chat/completions") and r["method"] == "POST"]


def _http(url: str, body: dict | None = None, key: str | None = None) -> tuple[int, dict, bytes]:
    """(status, headers, body) of a GET, or of a POST of `body` as JSON."""
    headers = {"Content-Type": "application/json"} if body is not None else {}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(url, None if body is None else json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read()
    except urllib.error.HTTPError as err:
        return err.code, {k.lower(): v for k, v in err.headers.items()}, err.read()


def _api(srv, **body) -> dict:
    status, _, answer = _http(srv.base_url + "/v1/chat/completions", {"model": MODEL, **body}, KEY)
    assert status == 200, answer
    return json.loads(answer)["choices"][0]


def _assert_offline(driver, srv) -> None:
    """Every request went to the server (or stayed in the page), and nothing was blocked by the CSP."""
    for r in _requests(driver):
        assert r["url"].startswith((srv.base_url + "/", "data:", "blob:")), r["url"]
    console = driver.get_log("browser")
    assert not [m for m in console if "Content Security Policy" in m["message"] or "Uncaught" in m["message"]], console


# -- tests -------------------------------------------------------------------------------------------------------

def test_a_typed_message_streams_the_greedy_answer(served, browser):
    srv, steering, _ = served
    browser.get(srv.base_url + "/")   # without the key: the page loads, the model list is refused
    assert "401" in _wait(browser, "return document.getElementById('error').textContent")
    _open(browser, srv)
    assert browser.find_element("id", "error").text == ""
    _setting(browser, "temperature", "0")
    _setting(browser, "max_tokens", "10")
    browser.execute_script("""
        window.seen = [];
        new MutationObserver(() => {
            const a = [...document.querySelectorAll('article.assistant')].pop();
            if (a) window.seen.push([a.dataset.state, a.querySelector('.content').textContent]);
        }).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true,
                                                         attributes: true});""")
    steering.play([], delay=0.03)   # the model's own greedy tokens, in steps a page can show
    first = _answer(browser, _send(browser, "hello there"))
    want = _api(srv, messages=[{"role": "user", "content": "hello there"}], temperature=0, max_tokens=10)
    assert first["state"] == "done" and first["content"] == want["message"]["content"] != ""
    assert first["reasoning"] == (want["message"].get("reasoning_content") or "")
    assert first["status"].startswith(want["finish_reason"])
    # it streamed: waiting first, then growing prefixes of the answer before it was done
    seen = browser.execute_script("return window.seen")
    assert seen[0][0] == "waiting"
    partial = {text for state, text in seen if state == "streaming" and text}
    assert len(partial) >= 2 and all(first["content"].startswith(p) for p in partial), seen
    [sent] = _chat_requests(browser)
    body = json.loads(sent["postData"])
    assert sent["headers"]["Authorization"] == f"Bearer {KEY}"
    assert body["stream"] is True and body["model"] == MODEL and body["temperature"] == 0 and body["max_tokens"] == 10
    assert body["messages"] == [{"role": "user", "content": "hello there"}]

    # the conversation goes on with the answer in it
    second = _answer(browser, _send(browser, "and then"))
    history = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": first["content"]},
               {"role": "user", "content": "and then"}]
    assert json.loads(_chat_requests(browser)[0]["postData"])["messages"] == history
    assert second["content"] == _api(srv, messages=history, temperature=0, max_tokens=10)["message"]["content"]
    _assert_offline(browser, srv)
    assert_server_kv_clean(srv)


def test_thinking_is_folded_and_tool_calls_shown(served, browser):
    srv, steering, tok = served
    _open(browser, srv)
    _setting(browser, "temperature", "0")
    _setting(browser, "max_tokens", "100")
    _setting(browser, "thinking", "on")
    _setting(browser, "tools", json.dumps([WEATHER]))

    def text(s: str) -> list[int]:
        return tok.encode(s, add_special_tokens=False).ids

    script = ([CHANNEL_BEGIN] + text("thought\nrain <i>in</i> paris") + [CHANNEL_END] + [CALL_BEGIN]
              + text("call:get_weather{city:") + [QUOTE] + text("paris") + [QUOTE] + text(",days:2}") + [CALL_END, 1])
    steering.play(script)
    got = _answer(browser, _send(browser, "weather?"))
    assert got["state"] == "done" and got["status"].startswith("tool_calls"), got
    assert got["thinking_shown"] and not got["thinking_open"] and got["reasoning"] == "rain <i>in</i> paris"
    assert not browser.find_elements("css selector", "article i")   # model output is text, never markup
    [(name, arguments)] = got["tools"]
    assert name == "get_weather" and json.loads(arguments) == {"city": "paris", "days": 2}
    assert got["content"] == ""
    body = json.loads(_chat_requests(browser)[0]["postData"])
    assert body["chat_template_kwargs"] == {"enable_thinking": True} and body["tools"] == [WEATHER]
    # what the API answers to the same request, not streamed
    steering.play(script)
    want = _api(srv, messages=[{"role": "user", "content": "weather?"}], temperature=0, max_tokens=100,
                tools=[WEATHER], chat_template_kwargs={"enable_thinking": True})
    assert want["message"]["reasoning_content"] == got["reasoning"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in want["message"]["tool_calls"]] \
        == [(name, json.loads(arguments))]
    # unfolding shows the thought
    browser.find_element("css selector", "article.assistant details.thinking summary").click()
    assert browser.find_element("css selector", "article.assistant details.thinking pre").text == "rain <i>in</i> paris"
    _assert_offline(browser, srv)


def _png(path: Path) -> Path:
    from PIL import Image

    Image.new("RGB", (8, 8), (200, 30, 30)).save(path)
    return path


def _wav(path: Path) -> Path:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(bytes(3200))
    return path


def test_uploads_errors_and_stop(served, browser, tmp_path):
    srv, steering, tok = served
    _open(browser, srv)
    _setting(browser, "max_tokens", "12")
    steering.play([])
    # bad settings are refused on the page, nothing sent
    _setting(browser, "top_k", "1.5")
    _send(browser, "x")
    assert "top_k" in _wait(browser, "return document.getElementById('error').textContent")
    _setting(browser, "top_k", "")
    _setting(browser, "tools", "[{")
    browser.find_element("id", "send").click()
    assert "tools" in _wait(browser, "return document.getElementById('error').textContent")
    _setting(browser, "tools", "")
    assert not _chat_requests(browser) and not browser.find_elements("css selector", "article.assistant")
    assert browser.find_element("id", "prompt").get_property("value") == "x"   # kept, to send once fixed
    browser.find_element("id", "prompt").clear()

    # an image and a WAV: previews, then image_url and input_audio parts; this model takes neither: a 400, shown
    png, wav = _png(tmp_path / "red.png"), _wav(tmp_path / "tone.wav")
    browser.find_element("id", "files").send_keys(f"{png}\n{wav}")
    _wait(browser, "return document.querySelectorAll('#attachments img, #attachments audio').length === 2")
    failed = _answer(browser, _send(browser, "look"))
    assert failed["state"] == "error" and failed["status"].startswith("400: messages[0].content[1]"), failed
    parts = json.loads(_chat_requests(browser)[0]["postData"])["messages"][0]["content"]
    assert parts[0] == {"type": "text", "text": "look"}
    assert parts[1]["type"] == "image_url" and parts[1]["image_url"]["url"].startswith("data:image/png;base64,")
    assert parts[2] == {"type": "input_audio", "input_audio": {"data": parts[2]["input_audio"]["data"], "format": "wav"}}
    import base64
    assert base64.b64decode(parts[2]["input_audio"]["data"]) == wav.read_bytes()
    assert browser.find_elements("css selector", "article.user.failed")
    assert not browser.find_elements("css selector", "#attachments *")   # sent with the message

    # the failed turn is left out of the conversation: the next message goes alone and is answered
    ok = _answer(browser, _send(browser, "hi"))
    assert ok["state"] == "done"
    assert json.loads(_chat_requests(browser)[0]["postData"])["messages"] == [{"role": "user", "content": "hi"}]

    # stop: the request ends in the engine too, and what came stays in the conversation
    _setting(browser, "max_tokens", "400")
    steering.play(tok.encode("a" * 400, add_special_tokens=False).ids, delay=0.05)   # 20 s if it ran to the end
    index = _send(browser, "go on")
    _wait(browser, f"return document.querySelectorAll('article.assistant')[{index}].querySelector('.content')"
                   ".textContent.length > 0")
    browser.find_element("id", "stop").click()
    stopped = _answer(browser, index)
    assert stopped["state"] == "stopped" and stopped["content"]
    assert_server_kv_clean(srv, timeout=10)   # not the 20 s of the whole answer
    steering.play([])
    _setting(browser, "max_tokens", "4")
    _answer(browser, _send(browser, "more"))
    sent = json.loads(_chat_requests(browser)[-1]["postData"])["messages"]
    assert sent[-3:-1] == [{"role": "user", "content": "go on"}, {"role": "assistant", "content": stopped["content"]}]
    _assert_offline(browser, srv)


def test_the_page_reads_server_sent_events_cut_anywhere(served, browser):
    """chat.js's SSE reader on bytes cut at random places (inside UTF-8 characters and line ends too): the same
    payloads as the whole stream gives."""
    srv, _, _ = served
    _open(browser, srv, key=None)
    payloads = ['{"a": "é€😀"}', "line one\nline two", "[DONE]", "x"]
    stream = ('data: {"a": "é€😀"}\r\n\r\n: a comment\n\nevent: e\ndata: line one\ndata:line two\n\n'
              "data: [DONE]\r\rdata: x").encode()
    rng = random.Random(fresh_seed())
    cuts = [sorted(rng.sample(range(1, len(stream)), rng.randint(1, 12))) for _ in range(40)] + [[], list(range(1, len(stream)))]
    pieces = [[list(stream[a:b]) for a, b in zip([0] + c, c + [len(stream)])] for c in cuts]
    got = browser.execute_async_script("""
        const [all, done] = arguments;
        import('./static/chat.js').then(async ({sseData}) => {
            const out = [];
            for (const pieces of all) {
                const body = new ReadableStream({start(c) { pieces.forEach(p => c.enqueue(new Uint8Array(p))); c.close(); }});
                const got = [];
                for await (const data of sseData(body)) got.push(data);
                out.push(got);
            }
            done(out);
        }).catch(e => done(String(e)));""", pieces)
    assert got == [payloads] * len(pieces)


class _Assets(HTMLParser):
    def __init__(self):
        super().__init__()
        self.refs: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.refs += [v for k, v in attrs if k in ("src", "href") and v]


def test_the_page_and_its_assets_are_served_without_the_key_and_offline(served):
    srv, _, _ = served

    def api_requests() -> float:
        text = _http(srv.base_url + "/metrics")[2].decode()
        return sum(float(v) for v in re.findall(r"^gemmaserve_http_requests_total\{.*\} (\S+)$", text, re.M))

    before = api_requests()
    status, headers, page = _http(srv.base_url + "/")
    assert status == 200 and headers["content-type"].startswith("text/html")
    assert "connect-src 'self'" in headers["content-security-policy"]
    parser = _Assets()
    parser.feed(page.decode())
    assert sorted(parser.refs) == ["static/chat.css", "static/chat.js"]
    types = {".css": "text/css", ".js": "text/javascript"}
    for ref in parser.refs:
        status, headers, asset = _http(f"{srv.base_url}/{ref}")
        assert status == 200 and headers["content-type"].startswith(types[Path(ref).suffix]), ref
        assert asset == (STATIC_DIR / Path(ref).name).read_bytes()
    for path in STATIC_DIR.iterdir():   # no external URL anywhere: the page works offline
        assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}", path.read_text(), re.I), path.name
    assert _http(srv.base_url + "/static/%2e%2e/chat_page.py")[0] == 404
    assert _http(srv.base_url + "/static/nothing.js")[0] == 404
    assert _http(srv.base_url + "/v1/models")[0] == 401   # the API still wants the key
    assert api_requests() == before + 1   # the page is not an API route; the refused /v1/models is
    assert "/" not in json.loads(_http(srv.base_url + "/openapi.json")[2])["paths"]
