"""Reading GGUF files: metadata, tensors and dequantisation.

We use the `gguf` package (llama.cpp's own reader and dequantiser) with two speed-ups that keep its
results bit for bit:

* `GGUFReader` parses metadata arrays one element at a time, which costs ~15 s for a 262k-token
  vocabulary (three arrays of 262k items). `_FastReader` overrides that one step: numeric arrays
  become one numpy view, string arrays one byte blob that `GGUFFile.strings()` splits on demand.
* Q8_0 (the 270M's 168M-element embedding) is dequantised with torch: scale (fp16) x int8 in fp32,
  the same single multiply `gguf.quants` does, ~10x faster. Other types go through `gguf.quants`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch


def _reader_class() -> type:
    import gguf

    class _FastReader(gguf.GGUFReader):
        def _get_field_parts(self, orig_offs: int, raw_type: int):  # noqa: D401 - gguf private hook
            gtype = gguf.GGUFValueType(raw_type)
            if gtype != gguf.GGUFValueType.ARRAY:
                return super()._get_field_parts(orig_offs, raw_type)
            offs = orig_offs
            raw_itype = self._get(offs, np.uint32)
            offs += 4
            alen = self._get(offs, np.uint64)
            offs += 8
            itype = gguf.GGUFValueType(int(raw_itype[0]))
            count = int(alen[0])
            nptype = self.gguf_scalar_to_np.get(itype)
            if nptype is not None:
                values = self._get(offs, nptype, count)
                return offs + int(values.nbytes) - orig_offs, [raw_itype, alen, values], [2], [gtype, itype]
            if itype == gguf.GGUFValueType.STRING:
                view = memoryview(self.data)
                start = offs
                for _ in range(count):
                    offs += 8 + int.from_bytes(view[offs:offs + 8], "little")
                blob = self.data[start:offs]
                return offs - orig_offs, [raw_itype, alen, blob], [2], [gtype, itype]
            return super()._get_field_parts(orig_offs, raw_type)  # nested arrays: rare, keep generic

    return _FastReader


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # torch order (outermost first)
    quant_type: str


class GGUFFile:
    """Metadata and tensors of one GGUF file (memory-mapped; tensors dequantised on request)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self._reader = _reader_class()(str(self.path))
        except (ValueError, KeyError) as exc:
            raise ValueError(f"{self.path} is not a readable GGUF file: {exc}") from exc
        self._tensors = {t.name: t for t in self._reader.tensors}

    # -- metadata -------------------------------------------------------------------------
    def keys(self) -> list[str]:
        return list(self._reader.fields)

    def get(self, key: str, default: Any = None) -> Any:
        """Scalar, string or numeric-array value of a metadata key (arrays as numpy)."""
        import gguf

        field = self._reader.fields.get(key)
        if field is None:
            return default
        main = field.types[0]
        if main == gguf.GGUFValueType.ARRAY:
            if field.types[-1] == gguf.GGUFValueType.STRING:
                return self.strings(key)
            return np.asarray(field.parts[field.data[0]])
        if main == gguf.GGUFValueType.STRING:
            return bytes(field.parts[-1]).decode("utf-8")
        return field.parts[-1].tolist()[0]

    def strings(self, key: str) -> list[str]:
        """A string array, split from the blob `_FastReader` kept."""
        field = self._reader.fields[key]
        blob = memoryview(field.parts[field.data[0]])
        out: list[str] = []
        offs, end = 0, len(blob)
        while offs < end:
            n = int.from_bytes(blob[offs:offs + 8], "little")
            out.append(bytes(blob[offs + 8:offs + 8 + n]).decode("utf-8", errors="replace"))
            offs += 8 + n
        return out

    # -- tensors --------------------------------------------------------------------------
    def tensors(self) -> list[GGUFTensor]:
        return [
            GGUFTensor(t.name, tuple(int(d) for d in reversed(t.shape.tolist())), t.tensor_type.name)
            for t in self._reader.tensors
        ]

    def tensors_by_name(self) -> dict[str, GGUFTensor]:
        return {t.name: t for t in self.tensors()}

    def load(self, name: str) -> torch.Tensor:
        """Dequantise one tensor to fp32, in torch layout ([out, in] for matrices)."""
        import gguf

        t = self._tensors[name]
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        qtype = t.tensor_type
        raw = np.asarray(t.data)
        if qtype == gguf.GGMLQuantizationType.F32:
            return torch.from_numpy(np.array(raw, dtype=np.float32)).reshape(shape)
        if qtype == gguf.GGMLQuantizationType.F16:
            return torch.from_numpy(np.array(raw)).to(torch.float32).reshape(shape)
        if qtype == gguf.GGMLQuantizationType.Q8_0:
            return dequantize_q8_0(raw).reshape(shape)
        return torch.from_numpy(gguf.quants.dequantize(raw, qtype)).reshape(shape)

    def int4_groups(self, name: str, stacked: bool = False):
        """A Q4_K, Q4_0 or Q4_1 matrix as its exact 4-bit groups of 32 (`quant.Int4Groups`), or None for other
        types. `stacked`: a 3-D tensor (MoE experts [E, N, K]) too, as its rows stacked [E * N, K]."""
        from .quant import q4_0_groups, q4_1_groups, q4_k_groups

        t = self._tensors[name]
        read = {"Q4_K": q4_k_groups, "Q4_0": q4_0_groups, "Q4_1": q4_1_groups}.get(t.tensor_type.name)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        if read is None or not (len(shape) == 2 or (stacked and len(shape) == 3)):
            return None
        return read(np.asarray(t.data), (int(np.prod(shape[:-1])), shape[-1]))

    def int8_groups(self, name: str):
        """A Q8_0, Q6_K or Q4_0 matrix as its exact int8 groups (`schemes.Int8Weight`: Q8_0 d fp16 per 32, Q6_K
        d * sc fp32 per 16, Q4_0 q - 8 with d fp16 per 32), or None for other types."""
        from .quant import q4_0_int8, q6_k_int8, q8_0_int8

        t = self._tensors[name]
        read = {"Q8_0": q8_0_int8, "Q6_K": q6_k_int8, "Q4_0": q4_0_int8}.get(t.tensor_type.name)
        if read is None or len(t.shape) != 2:
            return None
        return read(np.asarray(t.data), tuple(int(d) for d in reversed(t.shape.tolist())))


def dequantize_q8_0(raw: np.ndarray) -> torch.Tensor:
    """Q8_0 blocks of 34 bytes: fp16 scale d, then 32 int8 q; value = d * q (fp32)."""
    blocks = torch.from_numpy(np.array(raw, dtype=np.uint8).reshape(-1, 34))  # copy: the mmap is read-only
    scale = blocks[:, :2].contiguous().view(torch.float16).to(torch.float32)
    quants = blocks[:, 2:].contiguous().view(torch.int8).to(torch.float32)
    return (quants * scale).reshape(-1)
