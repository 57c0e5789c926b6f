"""Images of a request: from what users pass (PIL images, numpy arrays, file paths, encoded bytes, data
URLs) to pixels, a content key and a place in the prompt.

    prompt "Describe <start_of_image>"  + [img]
      -> text with each placeholder expanded (no placeholder: the images go first, one per image)
      -> token ids; the i-th run of image ids (its soft-token count long) is image i  ->  ImageItem(start, length)

The key hashes the preprocessed pixels, so the same picture sent twice (any encoding) shares its
encoder output and its KV blocks, and two pictures behind the same placeholder ids never do.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import UserInputError
from ..models.multimodal import ImageLayout, ProcessedImage


@dataclass(frozen=True)
class ImageLimits:
    """Per request; the server's defaults (options) protect it from oversized uploads."""

    max_images: int = 16
    max_pixels: int = 40_000_000        # width x height of one decoded image
    max_bytes: int = 20 * 2**20         # of one encoded image


@dataclass
class ImageItem:
    """One image of a request's prompt: its soft tokens sit at positions [start, start + length)."""

    start: int
    length: int
    key: str                  # content hash of the pixels (hex)
    pixels: np.ndarray        # what the encoder reads (see ProcessedImage)
    positions: np.ndarray | None = None

    @property
    def end(self) -> int:
        return self.start + self.length


def decode_image_bytes(data: bytes, limits: ImageLimits, what: str = "image"):
    """Encoded PNG/JPEG/WebP/... bytes -> a PIL image (fully decoded), or a UserInputError naming why not."""
    from PIL import Image

    if len(data) > limits.max_bytes:
        raise UserInputError(f"{what} is {len(data)} bytes; the limit is {limits.max_bytes}")
    try:
        image = Image.open(io.BytesIO(data))
        width, height = image.size
        if width * height > limits.max_pixels:
            raise UserInputError(f"{what} is {width}x{height} pixels; the limit is {limits.max_pixels} pixels")
        image.load()
    except UserInputError:
        raise
    except Exception as exc:   # Pillow raises many kinds for broken files
        raise UserInputError(f"{what} could not be decoded: {type(exc).__name__}: {exc}") from None
    return image


def data_url_bytes(url: str, max_bytes: int, what: str, kind: str) -> bytes:
    """The bytes of a base64 `data:` URL (`kind`: what it should hold, for the message). Anything else is
    refused: the server never fetches URLs or opens files named in a request."""
    if not isinstance(url, str) or not url.startswith("data:"):
        shown = url[:40] + "..." if isinstance(url, str) and len(url) > 40 else url
        raise UserInputError(f"{what}: only data: URLs (base64 {kind}) are accepted, got {shown!r}; "
                             "the server does not fetch URLs")
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64"):
        raise UserInputError(f"{what}: a data URL must be base64-encoded (data:...;base64,...)")
    return base64_bytes(payload, max_bytes, what)


def base64_bytes(payload: str, max_bytes: int, what: str) -> bytes:
    """Decoded base64 of at most `max_bytes` bytes, or a UserInputError."""
    if len(payload) > max_bytes * 4 // 3 + 4:
        raise UserInputError(f"{what} is larger than {max_bytes} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise UserInputError(f"{what}: invalid base64 data") from None


def decode_data_url(url: str, limits: ImageLimits, what: str = "image") -> object:
    """A `data:image/...;base64,...` URL -> PIL image."""
    return decode_image_bytes(data_url_bytes(url, limits.max_bytes, what, "PNG/JPEG/WebP"), limits, what)


def load_image(image: object, limits: ImageLimits, what: str = "image"):
    """A PIL image, a uint8 numpy array (H x W, H x W x 3 or 4), a file path, encoded bytes or a data
    URL -> a PIL image."""
    from PIL import Image

    if isinstance(image, Image.Image):
        width, height = image.size
        if width * height > limits.max_pixels:
            raise UserInputError(f"{what} is {width}x{height} pixels; the limit is {limits.max_pixels} pixels")
        return image
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim not in (2, 3) or (image.ndim == 3 and image.shape[2] not in (1, 3, 4)):
            raise UserInputError(f"{what}: a numpy image must be uint8 of shape HxW, HxWx3 or HxWx4, got "
                                 f"{image.dtype} {image.shape}")
        return load_image(Image.fromarray(image[..., 0] if image.ndim == 3 and image.shape[2] == 1 else image),
                          limits, what)
    if isinstance(image, (bytes, bytearray)):
        return decode_image_bytes(bytes(image), limits, what)
    if isinstance(image, str) and image.startswith("data:"):
        return decode_data_url(image, limits, what)
    if isinstance(image, (str, Path)):
        path = Path(image).expanduser()
        if not path.is_file():
            raise UserInputError(f"{what}: no such file {str(path)!r}")
        return decode_image_bytes(path.read_bytes(), limits, f"{what} ({path.name})")
    raise UserInputError(f"{what}: expected a PIL image, numpy array, file path or bytes, got {type(image).__name__}")


def expand_prompt(prompt: str, images: list[ProcessedImage], layout: ImageLayout) -> str:
    """The prompt with every placeholder expanded; without placeholders the images go first."""
    found = prompt.count(layout.placeholder)
    if found == 0:
        prompt = layout.placeholder * len(images) + prompt
    elif found != len(images):
        raise UserInputError(f"the prompt has {found} image placeholders ({layout.placeholder}) for "
                             f"{len(images)} images")
    pieces = prompt.split(layout.placeholder)
    out = [pieces[0]]
    for image, piece in zip(images, pieces[1:]):
        out += [layout.expansion(image.num_tokens), piece]
    return "".join(out)


def image_spans(token_ids: list[int], layout: ImageLayout) -> list[tuple[int, int]]:
    """(start, length) of every run of image tokens."""
    spans, i, n = [], 0, len(token_ids)
    while i < n:
        if token_ids[i] == layout.image_token_id:
            j = i
            while j < n and token_ids[j] == layout.image_token_id:
                j += 1
            spans.append((i, j - i))
            i = j
        else:
            i += 1
    return spans


def place_images(token_ids: list[int], images: list[ProcessedImage], layout: ImageLayout) -> list[ImageItem]:
    """ImageItems for the prompt's image spans (one span of each image's soft tokens, in order)."""
    spans = image_spans(token_ids, layout)
    if [n for _, n in spans] != [im.num_tokens for im in images]:
        raise UserInputError(f"the prompt holds image spans of lengths {[n for _, n in spans]} for images of "
                             f"{[im.num_tokens for im in images]} tokens: image tokens may not appear in the text itself")
    return [ImageItem(start, n, content_key(im), im.pixels, im.positions) for (start, n), im in zip(spans, images)]


def content_key(image: ProcessedImage) -> str:
    h = hashlib.blake2b(np.ascontiguousarray(image.pixels).tobytes(), digest_size=16)
    if image.positions is not None:
        h.update(np.ascontiguousarray(image.positions).tobytes())
    return h.hexdigest()


def hash_token_ids(token_ids: list[int], images: list[ImageItem]) -> list[int]:
    """The ids the prefix cache hashes: each image's tokens become a (negative) id derived from its
    key, so a block key covers the image's content, not just its placeholder ids."""
    out = list(token_ids)
    for im in images:
        tag = -1 - (int(im.key[:15], 16))
        out[im.start:im.end] = [tag] * im.length
    return out
