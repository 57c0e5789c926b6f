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

from collections.abc import Callable
from dataclasses import dataclass

from ..errors import UserInputError
from .tokenizer import Tokenizer

ROLES = ("system", "developer", "user", "assistant")


@dataclass(frozen=True)
class ChatMessage:
    role: str       # one of ROLES
    content: str


def parse_chat(raw: object, image_placeholder: str | None,
               image_objects: bool = False) -> tuple[list[ChatMessage], list[object]]:
    """OpenAI `messages` -> (ChatMessage list, images in order). Content is a string or a list of
    text and `image_url` parts (their URL strings are returned); each image part becomes
    `image_placeholder` in the text (None: the model takes no images, and an image part is an error).
    `image_objects` (the Python API) also takes {"type": "image", "image": <PIL image, array, path>}."""
    if not isinstance(raw, list) or not raw:
        raise UserInputError("messages must be a non-empty list of {role, content} objects")
    out, urls = [], []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise UserInputError(f"messages[{i}] must be an object with role and content")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise UserInputError(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "image_url" or (image_objects and kind == "image"):
                    if image_placeholder is None:
                        raise UserInputError(f"messages[{i}].content[{j}]: this model does not take images")
                    if kind == "image":
                        image = part.get("image")
                    else:
                        image = part.get("image_url")
                        image = image.get("url") if isinstance(image, dict) else image
                        if not isinstance(image, str):
                            raise UserInputError(f"messages[{i}].content[{j}].image_url.url must be a string")
                    urls.append(image)
                    parts.append(image_placeholder)
                    continue
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise UserInputError(f"messages[{i}].content[{j}]: only text and image_url parts are supported "
                                         "({\"type\": \"text\", \"text\": ...})")
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise UserInputError(f"messages[{i}].content must be a string or a list of text parts")
        out.append(ChatMessage(role, content))
    return out, urls


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

    def render(self, messages: list[ChatMessage]) -> str:
        if self._template is None:
            return gemma_turns(messages)
        from jinja2 import TemplateError

        tok = self.tokenizer
        try:
            return self._template.render(messages=[{"role": m.role, "content": m.content} for m in messages],
                                         add_generation_prompt=True, bos_token=tok.special_text(tok.bos_token_id),
                                         eos_token=tok.special_text(tok.eos_token_id))
        except TemplateError as exc:
            raise UserInputError(f"chat template: {exc}") from None

    def encode(self, messages: list[ChatMessage], expand: Callable[[str], str] | None = None) -> list[int]:
        """Token ids of the rendered conversation; `expand` rewrites the text first (image placeholders)."""
        text = self.render(messages)
        if expand is not None:
            text = expand(text)
        bos = self.tokenizer.special_text(self.tokenizer.bos_token_id)
        # Templates usually write BOS themselves: then the tokenizer must not add a second one.
        return self.tokenizer.encode(text, add_special_tokens=not (bos and text.startswith(bos)))


def gemma_turns(messages: list[ChatMessage]) -> str:
    """Gemma's turn format (without BOS: the tokenizer adds it). System text opens the first user
    turn; turns must alternate user / assistant, starting with user."""
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


def _raise(message: str):
    raise UserInputError(f"chat template: {message}")
