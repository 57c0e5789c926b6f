"""Images, audio and video of a request, once prepared: where each item sits in the prompt and what keys its
content.

    prompt "Describe <|image|> and <|audio|>" + {image: [img], audio: [clip]}
      -> text with each placeholder expanded (a modality without placeholders: its inputs go first)
      -> token ids; the i-th run of a modality's soft-token id is its i-th item  ->  MediaItem(start, length, ...)

An input is one or more items at one placeholder (MediaInput): an image is one, audio one per 30 s clip (written
one after the other), a video one per sampled frame (each after its time stamp, "mm:ss", separated by spaces).

The key hashes what the encoder reads, so the same picture or clip sent twice (any encoding) shares its encoder
output and its KV blocks, and two items behind the same placeholder ids never do.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from ...errors import UserInputError
from ...models.multimodal import EncoderInput, MediaLayout, Modality


@dataclass
class MediaItem:
    """One image or clip of a request's prompt: its soft tokens sit at positions [start, start + length)."""

    start: int
    length: int
    key: str                       # content hash of what the encoder reads (hex)
    data: np.ndarray               # see EncoderInput
    extra: np.ndarray | None = None
    modality: Modality = Modality.IMAGE
    bidirectional: bool = True     # its tokens see each other (on the layers that ask for it)

    def __post_init__(self):
        self.modality = Modality(self.modality)   # a step description read back from its serialised form

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclass(frozen=True)
class MediaInput:
    """One input of a request at its placeholder: its items in order, each after its label if it has labels."""

    items: list[EncoderInput]
    labels: list[str] | None = None   # a video's frame time stamps

    def expansion(self, layout: MediaLayout) -> str:
        if self.labels is None:
            return "".join(layout.expansion(it.num_tokens) for it in self.items)
        return " ".join(f"{label} {layout.expansion(it.num_tokens)}" for label, it in zip(self.labels, self.items))


def expand_prompt(prompt: str, inputs: dict[Modality, list[MediaInput]], layouts: dict[Modality, MediaLayout]) -> str:
    """The prompt with every placeholder expanded to its input's tokens, inputs of a modality in order; a modality
    whose placeholder the prompt lacks has its inputs put first."""
    inputs = {m: given for m, given in inputs.items() if given}
    for modality, given in inputs.items():
        layout = layouts[modality]
        found = prompt.count(layout.placeholder)
        if found == 0:
            prompt = layout.placeholder * len(given) + prompt
        elif found != len(given):
            raise UserInputError(f"the prompt has {found} {modality.value} placeholders ({layout.placeholder}) for "
                                 f"{len(given)} {modality.inputs}")
    out, pos, taken = [], 0, {m: 0 for m in inputs}
    marks = {layouts[m].placeholder: m for m in inputs}
    while marks:
        at, mark = min(((prompt.find(p, pos), p) for p in marks if prompt.find(p, pos) >= 0), default=(-1, ""))
        if at < 0:
            break
        modality = marks[mark]
        out += [prompt[pos:at], inputs[modality][taken[modality]].expansion(layouts[modality])]
        taken[modality] += 1
        pos = at + len(mark)
    out.append(prompt[pos:])
    return "".join(out)


def token_spans(token_ids: list[int], token_id: int) -> list[tuple[int, int]]:
    """(start, length) of every run of `token_id`."""
    spans, i, n = [], 0, len(token_ids)
    while i < n:
        if token_ids[i] == token_id:
            j = i
            while j < n and token_ids[j] == token_id:
                j += 1
            spans.append((i, j - i))
            i = j
        else:
            i += 1
    return spans


def place_media(token_ids: list[int], inputs: dict[Modality, list[MediaInput]],
                layouts: dict[Modality, MediaLayout]) -> list[MediaItem]:
    """MediaItems for the prompt's soft-token spans (one span per item, in order within each modality), sorted by
    position."""
    out = []
    for modality, given in inputs.items():
        layout = layouts[modality]
        items = [it for g in given for it in g.items]
        spans = token_spans(token_ids, layout.token_id)
        if [n for _, n in spans] != [it.num_tokens for it in items]:
            raise UserInputError(f"the prompt holds {modality.value} spans of lengths {[n for _, n in spans]} for "
                                 f"{modality.value} inputs of {[it.num_tokens for it in items]} tokens: "
                                 f"{modality.value} tokens may not appear in the text itself")
        out += [MediaItem(start, n, content_key(it, modality), it.data, it.extra, modality, layout.bidirectional)
                for (start, n), it in zip(spans, items)]
    return sorted(out, key=lambda it: it.start)


def content_key(item: EncoderInput, modality: Modality) -> str:
    h = hashlib.blake2b(modality.value.encode(), digest_size=16)
    h.update(np.ascontiguousarray(item.data).tobytes())
    if item.extra is not None:
        h.update(np.ascontiguousarray(item.extra).tobytes())
    return h.hexdigest()


def hash_token_ids(token_ids: list[int], media: list[MediaItem]) -> list[int]:
    """The ids the prefix cache hashes: each item's tokens become a (negative) id derived from its key, so a block
    key covers the item's content, not just its placeholder ids."""
    out = list(token_ids)
    for it in media:
        tag = -1 - (int(it.key[:15], 16))
        out[it.start:it.end] = [tag] * it.length
    return out
