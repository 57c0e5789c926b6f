// The chat page: a client of this server's /v1 API (the model list, streamed chat completions). Plain modern JS,
// no dependencies. Model output reaches the page only as text (textContent), never as markup.

const $ = (id) => document.getElementById(id);

// input_audio's formats (the server decodes them with libsndfile), by MIME subtype or file extension
const AUDIO_FORMATS = { wav: "wav", "x-wav": "wav", wave: "wav", vnd_wave: "wav", mpeg: "mp3", mp3: "mp3",
                        flac: "flac", "x-flac": "flac", ogg: "ogg", oga: "ogg" };

// The `data:` payloads of a server-sent event stream (a fetch body), as they complete: events may be cut anywhere
// across network reads; lines end in \n, \r\n or \r; an event's data lines join with \n.
export async function* sseData(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  const boundary = /\r\n\r\n|\n\n|\r\r/;
  let buffer = "";
  const payload = (block) => {
    const lines = block.split(/\r\n|\n|\r/).filter((line) => line.startsWith("data:"));
    return lines.length ? lines.map((line) => line.slice(line.startsWith("data: ") ? 6 : 5)).join("\n") : null;
  };
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += value;
    for (let m = boundary.exec(buffer); m; m = boundary.exec(buffer)) {
      const data = payload(buffer.slice(0, m.index));
      buffer = buffer.slice(m.index + m[0].length);
      if (data !== null) yield data;
    }
  }
  const data = payload(buffer);   // a last event without its blank line
  if (data !== null) yield data;
}

// The message of an error response (OpenAI's {"error": {"message"}}, or whatever text came).
async function errorText(response) {
  const text = await response.text();
  try {
    return `${response.status}: ${JSON.parse(text).error.message}`;
  } catch {
    return `${response.status}: ${text || response.statusText}`;
  }
}

function element(tag, className, text) {
  const el = document.createElement(tag);
  if (className) el.className = className;
  if (text !== undefined) el.textContent = text;
  return el;
}

function readAsDataURL(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

// An uploaded file -> {part: its content part, preview: an element showing it}.
async function attachment(file) {
  const url = await readAsDataURL(file);
  if (file.type.startsWith("image/")) {
    const preview = element("img");
    preview.src = url;
    preview.alt = file.name;
    return { part: { type: "image_url", image_url: { url } }, preview };
  }
  const subtype = file.type.startsWith("audio/") ? file.type.slice(6) : "";
  const extension = file.name.includes(".") ? file.name.split(".").pop().toLowerCase() : "";
  const format = AUDIO_FORMATS[subtype] ?? AUDIO_FORMATS[extension];
  if (!format) throw new Error(`${file.name}: not an image, nor audio in WAV, MP3, FLAC or OGG`);
  const preview = element("audio");
  preview.controls = true;
  preview.src = url;
  return { part: { type: "input_audio", input_audio: { data: url.slice(url.indexOf(",") + 1), format } }, preview };
}

// One assistant answer on the page: its folded thinking, content, tool calls and status, filled as deltas come.
class AnswerView {
  constructor(list) {
    this.root = element("article", "message assistant");
    this.thinking = element("details", "thinking");
    this.thinking.hidden = true;
    this.thinking.append(element("summary", null, "Thinking"), element("pre", "reasoning"));
    this.content = element("div", "content");
    this.tools = element("div", "tool-calls");
    this.status = element("p", "status");
    this.root.append(this.thinking, this.content, this.tools, this.status);
    list.append(this.root);
    this.message = { content: "", reasoning: "", toolCalls: [] };
  }

  setState(state, text) {
    this.root.dataset.state = state;
    this.status.textContent = text ?? state;
  }

  apply(delta) {
    const m = this.message;
    if (delta.reasoning_content) {
      m.reasoning += delta.reasoning_content;
      this.thinking.hidden = false;
      this.thinking.querySelector("pre").textContent = m.reasoning;
    }
    if (delta.content) {
      m.content += delta.content;
      this.content.textContent = m.content;
    }
    for (const call of delta.tool_calls ?? []) {   // OpenAI's deltas: pieces of each call, by index
      const into = (m.toolCalls[call.index ?? 0] ??= { id: "", type: "function", function: { name: "", arguments: "" } });
      if (call.id) into.id = call.id;
      into.function.name += call.function?.name ?? "";
      into.function.arguments += call.function?.arguments ?? "";
    }
    if (delta.tool_calls) this.showToolCalls();
    this.setState("streaming", m.content || m.toolCalls.length ? "answering…" : "thinking…");
  }

  showToolCalls() {
    this.tools.replaceChildren(...this.message.toolCalls.filter(Boolean).map((call) => {
      const box = element("div", "tool-call");
      let args = call.function.arguments;
      try { args = JSON.stringify(JSON.parse(args), null, 2); } catch { /* shown as it came */ }
      box.append(element("span", "tool-name", `${call.function.name}`), element("pre", "tool-arguments", args));
      return box;
    }));
  }

  // The answer as the conversation goes on with it (its reasoning left out, as the chat template wants).
  historyMessage() {
    const calls = this.message.toolCalls.filter(Boolean);
    return calls.length ? { role: "assistant", content: this.message.content || null, tool_calls: calls }
                        : { role: "assistant", content: this.message.content };
  }
}

class ChatPage {
  constructor() {
    this.history = [];       // the conversation so far, as OpenAI messages
    this.pending = [];       // attachments of the next message
    this.controller = null;  // the running request's, to stop it
    this.modelsAsked = 0;    // model list requests made (an older one's answer is dropped)
    this.apiKey = $("api-key");
    this.apiKey.value = sessionStorage.getItem("gemmaserve.apiKey") ?? "";
    this.apiKey.addEventListener("change", () => {
      sessionStorage.setItem("gemmaserve.apiKey", this.apiKey.value);
      this.loadModels();
    });
    $("reload-models").addEventListener("click", () => this.loadModels());
    $("new-chat").addEventListener("click", () => this.newChat());
    $("stop").addEventListener("click", () => this.controller?.abort());
    $("files").addEventListener("change", (e) => this.attach([...e.target.files]).finally(() => { e.target.value = ""; }));
    $("composer").addEventListener("submit", (e) => { e.preventDefault(); this.send(); });
    $("prompt").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); $("composer").requestSubmit(); }
    });
    this.loadModels();
  }

  headers() {
    const key = this.apiKey.value.trim();
    return { "Content-Type": "application/json", ...(key ? { Authorization: `Bearer ${key}` } : {}) };
  }

  showError(text) {
    $("error").textContent = text ?? "";
  }

  async loadModels() {
    const select = $("model");
    const asked = ++this.modelsAsked;
    try {
      const response = await fetch("v1/models", { headers: this.headers() });
      if (!response.ok) throw new Error(await errorText(response));
      const ids = (await response.json()).data.map((m) => m.id);
      if (asked !== this.modelsAsked) return;
      const keep = select.value;
      select.replaceChildren(...ids.map((id) => element("option", null, id)));
      if (ids.includes(keep)) select.value = keep;
      this.showError();
    } catch (err) {
      if (asked === this.modelsAsked) this.showError(`models: ${err.message}`);
    }
  }

  async attach(files) {
    for (const file of files) {
      try {
        const item = await attachment(file);
        const chip = element("figure", "attachment");
        const remove = element("button", "remove", "×");
        remove.type = "button";
        remove.title = `remove ${file.name}`;
        remove.addEventListener("click", () => {
          this.pending = this.pending.filter((p) => p !== item);
          chip.remove();
        });
        chip.append(item.preview, element("figcaption", null, file.name), remove);
        $("attachments").append(chip);
        this.pending.push(item);
        this.showError();
      } catch (err) {
        this.showError(err.message);
      }
    }
  }

  // The request's sampling and other settings; a bad value throws (the request is not sent).
  settings() {
    const out = {};
    for (const [id, integer] of [["temperature", false], ["top_p", false], ["top_k", true], ["max_tokens", true],
                                 ["seed", true]]) {
      const raw = $(id).value.trim();
      if (raw === "") continue;
      const value = Number(raw);
      if (!Number.isFinite(value) || (integer && !Number.isInteger(value))) {
        throw new Error(`${id}: ${integer ? "a whole number" : "a number"}, not "${raw}"`);
      }
      out[id] = value;
    }
    const thinking = $("thinking").value;
    if (thinking) out.chat_template_kwargs = { enable_thinking: thinking === "on" };
    const tools = $("tools").value.trim();
    if (tools) {
      let parsed;
      try { parsed = JSON.parse(tools); } catch (err) { throw new Error(`tools: not JSON (${err.message})`); }
      if (!Array.isArray(parsed)) throw new Error("tools: a JSON list of tools");
      out.tools = parsed;
    }
    return out;
  }

  newChat() {
    this.controller?.abort();
    this.history = [];
    $("messages").replaceChildren();
    this.showError();
  }

  async send() {
    if (this.controller) return;
    const text = $("prompt").value;
    if (!text.trim() && !this.pending.length) return;
    let settings;
    try {
      settings = this.settings();
    } catch (err) {
      this.showError(err.message);
      return;
    }
    this.showError();
    const parts = this.pending.map((p) => p.part);
    const user = { role: "user", content: parts.length ? [...(text ? [{ type: "text", text }] : []), ...parts] : text };
    const view = element("article", "message user");
    view.append(element("div", "content", text), ...this.pending.map((p) => p.preview));
    $("messages").append(view);
    $("prompt").value = "";
    $("attachments").replaceChildren();
    this.pending = [];

    const history = this.history;   // "New chat" during the answer starts another one: this answer stays here
    const system = $("system").value.trim();
    const body = {
      model: $("model").value, stream: true, stream_options: { include_usage: true },
      messages: [...(system ? [{ role: "system", content: system }] : []), ...history, user], ...settings,
    };
    const answer = new AnswerView($("messages"));
    answer.setState("waiting", "waiting…");
    const controller = (this.controller = new AbortController());
    $("send").disabled = true;
    $("stop").disabled = false;
    let finish = null, usage = null;
    try {
      const response = await fetch("v1/chat/completions", {
        method: "POST", headers: this.headers(), body: JSON.stringify(body), signal: controller.signal,
      });
      if (!response.ok) throw new Error(await errorText(response));
      for await (const data of sseData(response.body)) {
        if (data === "[DONE]") break;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(`${chunk.error.code ?? "error"}: ${chunk.error.message}`);
        for (const choice of chunk.choices ?? []) {
          answer.apply(choice.delta ?? {});
          finish = choice.finish_reason ?? finish;
        }
        usage = chunk.usage ?? usage;
      }
      history.push(user, answer.historyMessage());
      const tokens = usage ? `, ${usage.completion_tokens} tokens` : "";
      answer.setState("done", `${finish ?? "done"}${tokens}`);
    } catch (err) {
      if (controller.signal.aborted) {   // what came so far stays in the conversation
        history.push(user, answer.historyMessage());
        answer.setState("stopped", "stopped");
      } else {   // the turn is left out of the conversation
        view.classList.add("failed");
        answer.setState("error", err.message);
      }
    } finally {
      this.controller = null;
      $("send").disabled = false;
      $("stop").disabled = true;
    }
  }
}

if (document.readyState === "loading") {
  document.addEventListener("DOMContentLoaded", () => new ChatPage());
} else {
  new ChatPage();
}
