"""Image pixels for a vision tower, with Pillow and numpy only (the same tensors as the checkpoint's
Hugging Face image processor, PIL backend):

    any image -> RGB (transparency composited onto white) -> resize (bilinear, on uint8)
              -> x / 255 (computed in float64, stored float32) -> (x - mean) / std -> [3, S, S] float32

Gemma 3: S = 896, mean = std = 0.5, so pixels land in [-1, 1]. Pan-and-scan (off in the released
processor configs) is not implemented.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .multimodal import EncoderInput


def to_rgb(image):
    """A PIL image in RGB mode; transparency is composited onto white, as transformers does."""
    from PIL import Image

    if image.mode == "RGB" and image.info.get("transparency") is None:
        return image   # as it is: convert() would copy every pixel (30 ms for 12 megapixels)
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


@dataclass(frozen=True)
class ImageProcessor:
    size: int                                  # square output side
    num_tokens: int = 0                        # soft tokens of every image (the model's pooling)
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)

    def __call__(self, image) -> EncoderInput:
        return EncoderInput(self.pixels(image), self.num_tokens)

    def pixels(self, image) -> np.ndarray:
        """A PIL image -> [3, size, size] float32."""
        from PIL import Image

        rgb = to_rgb(image)
        if rgb.size != (self.size, self.size):
            rgb = rgb.resize((self.size, self.size), Image.Resampling.BILINEAR)
        # channels first (contiguous) while still bytes; x / 255 in float32 is bit for bit transformers' float64 x * (1 / 255)
        # rounded to float32 (the preprocessing tests compare exactly)
        x = np.divide(np.ascontiguousarray(np.asarray(rgb).transpose(2, 0, 1)), np.float32(255), dtype=np.float32)
        mean = np.asarray(self.mean, dtype=np.float32)[:, None, None]
        std = np.asarray(self.std, dtype=np.float32)[:, None, None]
        x -= mean
        x /= std
        return x
