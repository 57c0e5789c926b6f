"""What a request may ask for, checked before it reaches the scheduler: prompt text to token ids, images
to pixels in place, and whether the request can ever run (length, KV budget, vocabulary, grammar).

Every user-facing entry point (CLI, `LLM`, HTTP) goes through here, so each says the same thing about
the same bad input (a `UserInputError`), and a request that passes cannot fail for its shape later.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ..errors import UserInputError
from ..kv.base import KVCacheManager
from ..models.multimodal import ProcessedImage
from ..units import format_bytes
from .images import ImageItem, ImageLimits, expand_prompt, load_image, place_images
from .sampling_params import SamplingParams
from .structured_output import Grammars

log = logging.getLogger(__name__)


@dataclass
class InputProcessor:
    model_name: str
    tokenizer: object
    vocab_size: int
    max_model_len: int
    max_num_batched_tokens: int
    kv: KVCacheManager
    grammars: Grammars
    image_layout: object | None = None   # models/multimodal.py's ImageLayout, None for text-only models

    def tokenize(self, prompt: str) -> list[int]:
        if not isinstance(prompt, str):
            raise UserInputError(f"a prompt must be a string, got {type(prompt).__name__}")
        if not prompt.strip():
            raise UserInputError("empty prompt")
        return self.tokenizer.encode(prompt)

    def load_images(self, images: list, limits: ImageLimits | None = None) -> list[ProcessedImage]:
        """Pixels of each image (PIL images, uint8 numpy arrays, file paths, encoded bytes or data
        URLs), within `limits` (count, pixels, bytes)."""
        layout = self.image_layout
        if layout is None:
            raise UserInputError(f"model {self.model_name!r} does not take images")
        limits = limits or ImageLimits()
        if len(images) > limits.max_images:
            raise UserInputError(f"{len(images)} images; at most {limits.max_images} per request")
        return [layout.processor(load_image(im, limits, f"image {i}")) for i, im in enumerate(images)]

    def prepare_images(self, prompt: str, images: list, limits: ImageLimits | None = None
                       ) -> tuple[list[int], list[ImageItem]]:
        """Prompt ids with each image's tokens in place, and the images (pixels, content keys). The
        prompt marks where each image goes with the model's placeholder (none: the images go first)."""
        pixels = self.load_images(images, limits)
        ids = self.tokenize(expand_prompt(prompt, pixels, self.image_layout))
        return ids, place_images(ids, pixels, self.image_layout)

    def check_request(self, prompt_ids: list[int], params: SamplingParams,
                      images: list[ImageItem] | None = None, wait_for_grammar: bool = True) -> int | None:
        """Raise UserInputError if the request can never run (too long, larger than the KV budget,
        or naming tokens the model does not have). Returns the most prompt tokens it may prefill in
        one step when it fits only in chunks smaller than `max_num_batched_tokens`, else None.
        A structured request's grammar is compiled (on a worker thread, cached) and, with
        `wait_for_grammar`, waited for, so that a bad spec fails here; without, only a compile that
        has already failed does (the engine thread never waits: a later failure fails the request)."""
        params.validate()
        if params.structured_output is not None:
            grammar = self.grammars.submit(params.structured_output)
            if wait_for_grammar or grammar.done():
                grammar.result()
        n = len(prompt_ids)
        if n >= self.max_model_len:
            raise UserInputError(f"prompt is {n} tokens long; max_model_len is {self.max_model_len}, "
                                 "which must leave room for at least one generated token")
        vocab = self.vocab_size
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise UserInputError(f"stop_token_ids {bad} are outside the vocabulary (size {vocab})")
        image_id = self.image_layout.image_token_id if images else None
        if prompt_ids and (min(prompt_ids) < 0 or max((t for t in prompt_ids if t != image_id), default=0) >= vocab):
            raise UserInputError(f"prompt token ids must be in [0, {vocab})")
        if self.image_layout is not None and not images and self.image_layout.image_token_id in prompt_ids:
            raise UserInputError("the prompt holds image tokens but no images")
        peak = min(n + params.max_tokens, self.max_model_len)
        chunk = self.max_num_batched_tokens
        fitting = self.kv.max_chunk(peak, chunk)
        if fitting == chunk:
            return None
        if images and fitting < max(im.length for im in images):
            fitting = 0   # an image is never split across chunks: it must fit one
        if fitting:
            log.info("a request of %d tokens fits the KV cache only in prefill chunks of %d tokens", peak, fitting)
            return fitting
        need = self.kv.peak_pages(peak, 1)
        why = " (its pinned pool split leaves one side too small)" if need <= self.kv.num_pages else ""
        raise UserInputError(f"request needs {format_bytes(need * self.kv.page_bytes)} of KV cache for {peak} tokens, "
                             f"but the KV cache has {format_bytes(self.kv.num_pages * self.kv.page_bytes)}{why}; "
                             "raise --kv-cache-memory or lower max_tokens")
