"""What a model that reads images or audio tells the engine: how each item appears in the prompt, how its raw
input is prepared for the encoder, and which of its tokens see each other.

    prompt text "... <start_of_image> ..."        (the modality's placeholder, one per item)
    -> "... \\n\\n<start_of_image>" + N x "<image_soft_token>" + "<end_of_image>\\n\\n ..."  (Gemma 3)
    -> token ids; each run of N `token_id`s is one item's span, filled with its encoder output
    (N: fixed for Gemma 3 images, from the image's size for Gemma 4, from the clip's length for audio)
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np


class Modality(str, enum.Enum):
    IMAGE = "image"
    AUDIO = "audio"
    VIDEO = "video"

    @property
    def inputs(self) -> str:
        """How messages name a request's inputs of this kind ("images", "audio", "videos")."""
        return "audio" if self is Modality.AUDIO else self.value + "s"


@dataclass(frozen=True)
class EncoderInput:
    """What the encoder reads of one item, and how many soft tokens it becomes."""

    data: np.ndarray                   # image, video frame: [3, S, S] (Gemma 3) or [max_patches, 3 p^2] patches (Gemma 4);
                                       # audio: [frames, mel bins] log-mel features
    num_tokens: int
    extra: np.ndarray | None = None    # Gemma 4 image: [max_patches, 2] (x, y) of each patch, -1 for padding;
                                       # audio: [frames] bool, the frames that hold the clip


@dataclass(frozen=True)
class MediaLayout:
    """Texts left empty ("") are the tokenizer's texts of the ids (`with_texts`): Gemma 4's
    `<|image|>` placeholder is its soft token itself, between its begin/end-of-image tokens."""

    modality: Modality
    placeholder: str           # what marks an item in a prompt
    before: str                # text before the item's soft tokens (e.g. "\n\n<start_of_image>")
    token: str                 # the soft-token text, repeated once per soft token
    after: str
    token_id: int              # the soft-token id of every row of the item
    max_tokens: int            # the most soft tokens one item can take (an item is never split across chunks)
    processor: Callable[[object], EncoderInput]   # the decoded input (PIL image, samples) -> what the encoder reads
    bidirectional: bool = True  # an item's tokens see each other on the layers that ask for it (images); audio: causal
    begin_token_id: int | None = None
    end_token_id: int | None = None

    def expansion(self, num_tokens: int) -> str:
        return self.before + self.token * num_tokens + self.after

    def with_texts(self, token_text: Callable[[int], str]) -> "MediaLayout":
        """Empty texts filled from the tokenizer (`token_text`: id -> its text)."""
        token = self.token or token_text(self.token_id)
        return replace(self, token=token, placeholder=self.placeholder or token,
                       before=self.before or (token_text(self.begin_token_id) if self.begin_token_id is not None else ""),
                       after=self.after or (token_text(self.end_token_id) if self.end_token_id is not None else ""))
