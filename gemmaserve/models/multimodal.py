"""What a model that reads images tells the engine: how an image appears in the prompt, how its pixels
are prepared, and which layers see an image's tokens bidirectionally.

    prompt text "... <start_of_image> ..."        (the placeholder, one per image)
    -> "... \\n\\n<start_of_image>" + N x "<image_soft_token>" + "<end_of_image>\\n\\n ..."  (expansion)
    -> token ids; each run of N `image_token_id`s is one image's span, filled with its encoder output
"""

from __future__ import annotations

from dataclasses import dataclass

from .image_processing import ImageProcessor


@dataclass(frozen=True)
class ImageLayout:
    placeholder: str           # what marks an image in a prompt
    expansion: str             # the text that replaces each placeholder before tokenising
    image_token_id: int        # the soft-token id of every image row
    tokens_per_image: int
    processor: ImageProcessor
