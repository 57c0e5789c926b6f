"""What a model that reads images tells the engine: how an image appears in the prompt, how its pixels
are prepared, and which layers see an image's tokens bidirectionally.

    prompt text "... <start_of_image> ..."        (the placeholder, one per image)
    -> "... \\n\\n<start_of_image>" + N x "<image_soft_token>" + "<end_of_image>\\n\\n ..."  (Gemma 3)
    -> token ids; each run of N `image_token_id`s is one image's span, filled with its encoder output
    (N: fixed for Gemma 3, from the image's size for Gemma 4)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np


@dataclass(frozen=True)
class ProcessedImage:
    """What the encoder reads of one image, and how many soft tokens it becomes."""

    pixels: np.ndarray                     # Gemma 3: [3, S, S]; Gemma 4: [max_patches, 3 * p * p] patches
    num_tokens: int
    positions: np.ndarray | None = None    # Gemma 4: [max_patches, 2] (x, y) of each patch, -1 for padding


@dataclass(frozen=True)
class ImageLayout:
    """Texts left empty ("") are the tokenizer's texts of the ids (`with_texts`): Gemma 4's
    `<|image|>` placeholder is its soft token itself, between its begin/end-of-image tokens."""

    placeholder: str           # what marks an image in a prompt
    before: str                # text before the image's soft tokens (e.g. "\n\n<start_of_image>")
    token: str                 # the soft-token text, repeated once per soft token
    after: str
    image_token_id: int        # the soft-token id of every image row
    max_tokens_per_image: int  # the most soft tokens one image can take (an image is never split across chunks)
    processor: Callable[[object], ProcessedImage]   # a PIL image -> what the encoder reads
    boi_token_id: int | None = None
    eoi_token_id: int | None = None

    def expansion(self, num_tokens: int) -> str:
        return self.before + self.token * num_tokens + self.after

    def with_texts(self, token_text: Callable[[int], str]) -> "ImageLayout":
        """Empty texts filled from the tokenizer (`token_text`: id -> its text)."""
        token = self.token or token_text(self.image_token_id)
        return replace(self, token=token, placeholder=self.placeholder or token,
                       before=self.before or (token_text(self.boi_token_id) if self.boi_token_id is not None else ""),
                       after=self.after or (token_text(self.eoi_token_id) if self.eoi_token_id is not None else ""))
