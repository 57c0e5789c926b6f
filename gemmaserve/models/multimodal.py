"""What a model that reads images tells the engine: how an image appears in the prompt, how its pixels
are prepared, and which layers see an image's tokens bidirectionally.

    prompt text "... <start_of_image> ..."        (the placeholder, one per image)
    -> "... \\n\\n<start_of_image>" + N x "<image_soft_token>" + "<end_of_image>\\n\\n ..."  (Gemma 3)
    -> token ids; each run of N `image_token_id`s is one image's span, filled with its encoder output
    (N: fixed for Gemma 3, from the image's size for Gemma 4)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ProcessedImage:
    """What the encoder reads of one image, and how many soft tokens it becomes."""

    pixels: np.ndarray                     # Gemma 3: [3, S, S]; Gemma 4: [max_patches, 3 * p * p] patches
    num_tokens: int
    positions: np.ndarray | None = None    # Gemma 4: [max_patches, 2] (x, y) of each patch, -1 for padding


@dataclass(frozen=True)
class ImageLayout:
    placeholder: str           # what marks an image in a prompt
    before: str                # text before the image's soft tokens (e.g. "\n\n<start_of_image>")
    token: str                 # the soft-token text, repeated once per soft token
    after: str
    image_token_id: int        # the soft-token id of every image row
    max_tokens_per_image: int  # the most soft tokens one image can take (an image is never split across chunks)
    processor: Callable[[object], ProcessedImage]   # a PIL image -> what the encoder reads

    def expansion(self, num_tokens: int) -> str:
        return self.before + self.token * num_tokens + self.after
