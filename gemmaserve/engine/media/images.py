"""Images of a request: from what users pass (PIL images, numpy arrays, file paths, encoded bytes, data
URLs) to decoded PIL images, within the request's limits (media.py places them in the prompt)."""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...errors import UserInputError


@dataclass(frozen=True)
class ImageLimits:
    """Per request; the server's defaults (options) protect it from oversized uploads."""

    max_images: int = 16
    max_pixels: int = 40_000_000        # width x height of one decoded image
    max_bytes: int = 20 * 2**20         # of one encoded image


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
    require_data_url(url, what, kind)
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64"):
        raise UserInputError(f"{what}: a data URL must be base64-encoded (data:...;base64,...)")
    return base64_bytes(payload, max_bytes, what)


def require_data_url(url: object, what: str, kind: str) -> None:
    """A UserInputError unless `url` is a `data:` URL: the server never fetches URLs or opens files."""
    if not isinstance(url, str) or not url.startswith("data:"):
        shown = url[:40] + "..." if isinstance(url, str) and len(url) > 40 else url
        raise UserInputError(f"{what}: only data: URLs (base64 {kind}) are accepted, got {shown!r}; "
                             "the server does not fetch URLs")


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
