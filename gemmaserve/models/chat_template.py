"""Chat messages -> prompt tokens: the checkpoint's own Jinja chat template when it ships one,
otherwise Gemma's turn format (what the Gemma templates render):

    <bos><start_of_turn>user
    {system}

    {first user message}<end_of_turn>
    <start_of_turn>model
    {assistant message}<end_of_turn>
    <start_of_turn>model
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import UserInputError
from .multimodal import Modality
from .tokenizer import Tokenizer

ROLES = ("system", "developer", "user", "assistant", "tool")
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})


@dataclass(frozen=True)
class ChatMessage:
    role: str       # one of ROLES
    content: str
    tool_calls: tuple[dict, ...] = ()   # assistant: calls it made ({"name", "arguments" (a dict)})
    name: str | None = None             # tool: the function whose result this is

    def template_dict(self) -> dict:
        d: dict = {"role": self.role, "content": self.content}
        if self.tool_calls:
            d["tool_calls"] = [{"type": "function", "function": c} for c in self.tool_calls]
        if self.name is not None:
            d["name"] = self.name
        return d


# content part type -> (modality, the field holding it, whether the field is {"url": ...}); "image"/"audio" parts
# (Python objects: PIL images, arrays, samples, paths) only through the Python API
_MEDIA_PARTS = {"image_url": (Modality.IMAGE, "image_url", True), "audio_url": (Modality.AUDIO, "audio_url", True),
                "input_audio": (Modality.AUDIO, "input_audio", False), "video_url": (Modality.VIDEO, "video_url", True)}
_OBJECT_PARTS = {"image": (Modality.IMAGE, "image", False), "audio": (Modality.AUDIO, "audio", False),
                 "video": (Modality.VIDEO, "video", False)}


def parse_chat(raw: object, placeholders: dict[Modality, str], python_objects: bool = False
               ) -> tuple[list[ChatMessage], list[tuple[Modality, object]]]:
    """OpenAI `messages` -> (ChatMessage list, the images, audio and videos in order, each with its modality). Content
    is a string or a list of parts: text, `image_url`, `audio_url`, `video_url` (their URL strings are returned),
    `input_audio`
    (its {"data", "format"} object is returned); each media part becomes its modality's placeholder in the text
    (`placeholders`: what the model takes; a part of another kind is an error). `python_objects` (the Python API)
    also takes {"type": "image" | "audio" | "video", <that type>: ...} with objects."""
    if not isinstance(raw, list) or not raw:
        raise UserInputError("messages must be a non-empty list of {role, content} objects")
    kinds = {**_MEDIA_PARTS, **(_OBJECT_PARTS if python_objects else {})}
    out, media = [], []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise UserInputError(f"messages[{i}] must be an object with role and content")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise UserInputError(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                where = f"messages[{i}].content[{j}]"
                if not isinstance(part, dict):
                    raise UserInputError(f'{where} must be an object ({{"type": "text", "text": ...}} or a media part)')
                kind = part.get("type")
                if not isinstance(kind, str):   # (a dict or list here is no key of `kinds`: unhashable)
                    raise UserInputError(f"{where}.type must be a string naming the part's kind, got {kind!r:.80}")
                if kind in kinds:
                    modality, key, is_url = kinds[kind]
                    if modality not in placeholders:
                        raise UserInputError(f"{where}: this model does not take {modality.inputs}")
                    value = part.get(key)
                    if is_url:
                        value = value.get("url") if isinstance(value, dict) else value
                        if not isinstance(value, str):
                            raise UserInputError(f"{where}.{key}.url must be a string")
                    elif kind == "input_audio" and not isinstance(value, dict):
                        raise UserInputError(f'{where}.input_audio must be {{"data": base64 audio, "format": ...}}')
                    media.append((modality, value))
                    parts.append(placeholders[modality])
                    continue
                if kind != "text" or not isinstance(part.get("text"), str):
                    raise UserInputError(f"{where}: only text, image_url, input_audio, audio_url and video_url parts "
                                         "are supported ({\"type\": \"text\", \"text\": ...})")
                parts.append(part["text"])
            content = "".join(parts)
        calls = _tool_calls(m.get("tool_calls"), i) if role == "assistant" else ()
        if content is None and calls:
            content = ""
        if not isinstance(content, str):
            raise UserInputError(f"messages[{i}].content must be a string or a list of text parts")
        name = m.get("name") if role == "tool" else None
        if name is not None and not isinstance(name, str):
            raise UserInputError(f"messages[{i}].name must be a string")
        out.append(ChatMessage(role, content, calls, name))
    return out, media


def _tool_calls(raw: object, i: int) -> tuple[dict, ...]:
    """An assistant message's OpenAI tool_calls -> ({"name", "arguments" as a dict}, ...)."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise UserInputError(f"messages[{i}].tool_calls must be a list")
    out = []
    for j, call in enumerate(raw):
        fn = call.get("function") if isinstance(call, dict) else None
        args = fn.get("arguments", "{}") if isinstance(fn, dict) else None
        if isinstance(args, str):
            try:
                args = json.loads(args or "{}")
            except json.JSONDecodeError:
                args = None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(args, dict):
            raise UserInputError(f"messages[{i}].tool_calls[{j}] must be {{\"function\": {{\"name\": ..., "
                                 "\"arguments\": <a JSON object or its text>}}")
        out.append({"name": fn["name"], "arguments": args})
    return tuple(out)


class ChatFormatter:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._template = None
        if tokenizer.chat_template:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            env.globals["raise_exception"] = _raise
            self._template = env.from_string(tokenizer.chat_template)

    @property
    def source(self) -> str:
        return "checkpoint template" if self._template is not None else "gemma turn format"

    @property
    def renders_tools(self) -> bool:
        """The checkpoint's template declares tools itself (else the caller describes them)."""
        return self._template is not None and "tools" in (self.tokenizer.chat_template or "")

    def render(self, messages: list[ChatMessage], tools: list[dict] | None = None,
               template_kwargs: dict | None = None) -> str:
        """`tools`: OpenAI function tools, passed to a template that renders them (`renders_tools`).
        `template_kwargs`: more variables for the checkpoint's template (e.g. enable_thinking); Gemma's turn
        format (no template) has none to set."""
        template_kwargs = dict(template_kwargs or {})
        if not all(isinstance(k, str) for k in template_kwargs):
            raise UserInputError("chat_template_kwargs must be an object with string keys")
        taken = sorted(set(template_kwargs) & RESERVED_TEMPLATE_VARIABLES)
        if taken:
            raise UserInputError(f"chat_template_kwargs may not set {', '.join(taken)} (the server sets them)")
        if self._template is None:
            return gemma_turns(messages)
        from jinja2 import TemplateError

        tok = self.tokenizer
        extra = {"tools": tools} if tools else {}
        try:
            return self._template.render(**template_kwargs, messages=[m.template_dict() for m in messages],
                                         add_generation_prompt=True, bos_token=tok.special_text(tok.bos_token_id),
                                         eos_token=tok.special_text(tok.eos_token_id), **extra)
        except (TemplateError, TypeError, ValueError, LookupError, AttributeError, ArithmeticError) as exc:
            # the checkpoint's template failing on what the request gave it (chat_template_kwargs of any JSON type)
            raise UserInputError(f"chat template: {type(exc).__name__}: {exc}") from None

    def encode(self, messages: list[ChatMessage], expand: Callable[[str], str] | None = None,
               tools: list[dict] | None = None, template_kwargs: dict | None = None) -> list[int]:
        """Token ids of the rendered conversation; `expand` rewrites the text first (image placeholders)."""
        text = self.render(messages, tools, template_kwargs)
        if expand is not None:
            text = expand(text)
        bos = self.tokenizer.special_text(self.tokenizer.bos_token_id)
        # Templates usually write BOS themselves: then the tokenizer must not add a second one.
        return self.tokenizer.encode(text, add_special_tokens=not (bos and text.startswith(bos)))


def gemma_turns(messages: list[ChatMessage]) -> str:
    """Gemma's turn format (without BOS: the tokenizer adds it). System text opens the first user
    turn; turns must alternate user / assistant, starting with user. Tool results are a user turn
    (consecutive ones together); an assistant's tool calls are written as the JSON it was asked for."""
    messages = _fold_tools(messages)
    system = []
    i = 0
    while i < len(messages) and messages[i].role in ("system", "developer"):
        system.append(messages[i].content.strip())
        i += 1
    turns = messages[i:]
    if not turns:
        raise UserInputError("messages need at least one user message")
    out = []
    for k, m in enumerate(turns):
        if m.role in ("system", "developer"):
            raise UserInputError("system messages must come before the conversation")
        want = "user" if k % 2 == 0 else "assistant"
        if m.role != want:
            raise UserInputError("conversation roles must alternate user / assistant, starting with user")
        text = m.content.strip()
        if k == 0 and system:
            text = "\n\n".join(system) + "\n\n" + text
        out.append(f"<start_of_turn>{'model' if m.role == 'assistant' else 'user'}\n{text}<end_of_turn>\n")
    out.append("<start_of_turn>model\n")
    return "".join(out)


def _fold_tools(messages: list[ChatMessage]) -> list[ChatMessage]:
    out: list[ChatMessage] = []
    for m in messages:
        if m.role == "tool":
            text = f"Result of {m.name or 'the function'}: {m.content}"
            if out and out[-1].role == "user" and out[-1].name == "tool":
                out[-1] = ChatMessage("user", out[-1].content + "\n" + text, name="tool")
            else:
                out.append(ChatMessage("user", text, name="tool"))
        elif m.tool_calls:
            calls = [json.dumps({"name": c["name"], "parameters": c["arguments"]}, ensure_ascii=False)
                     for c in m.tool_calls]
            out.append(ChatMessage("assistant", "\n".join(filter(None, [m.content.strip()] + calls))))
        else:
            out.append(m)
    return out


def _raise(message: str):
    raise UserInputError(f"chat template: {message}")
