"""fp32 convolutions that stay fp32 on CUDA.

cuDNN runs fp32 convolutions in TF32 (a 10-bit mantissa) unless told otherwise: torch's default for
`torch.backends.cudnn.conv.fp32_precision` is "tf32", unlike matrix products' "ieee". An fp32 tower's
convolutions (the audio tower's subsampling and depthwise ones, SigLIP's patch embedding) would then lose
precision on a GPU (TF32 keeps 10 bits of each input's mantissa: simulated, an audio prompt's logits moved 7e-3
from transformers' instead of 5e-6). So they run inside `exact_fp32_convs`: for an fp32 input on CUDA, cuDNN's
convolution precision is "ieee" for the call and what it was after; bf16 and fp16 inputs (no TF32 to lose), CPU
ones and the rest of the process keep theirs.

The flag is the process's: while a scope is open another thread's cuDNN convolutions run in full fp32 too (and
torch's legacy `torch.backends.cudnn.allow_tf32` getter refuses to read the mixed flags), and scopes are taken
one at a time so that one thread's restore never ends another's scope or leaves "ieee" behind.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

_SCOPE = threading.RLock()   # the flag is process-wide: one scope at a time (a thread may nest its own)


def tf32_would_apply(x: torch.Tensor) -> bool:
    """Whether cuDNN would run a convolution of `x` in TF32 by default: fp32 on a CUDA device."""
    return x.dtype == torch.float32 and x.device.type == "cuda"


@contextlib.contextmanager
def exact_fp32_convs(x: torch.Tensor) -> Iterator[None]:
    """Convolutions of `x` (fp32 on CUDA) inside run in full fp32; anything else passes through untouched."""
    if not tf32_would_apply(x):
        yield
        return
    conv = torch.backends.cudnn.conv
    with _SCOPE:
        before = conv.fp32_precision
        conv.fp32_precision = "ieee"
        try:
            yield
        finally:
            conv.fp32_precision = before
