"""A GGUF model's quantised CPU weights kept in the cache directory, so that a later start skips the work.

Quantising the 270M at load (quant.py: int8 rows of every matrix and of the output table, the
rotations, the 4-bit scan copy, row sums) took ~10 of a ~20 s load on 2 cores, on every start. The
first load records what each quantised module was built from (`quantize_model(record=...)`) and
writes it here, with the model's other tensors (norms, RoPE frequencies); a later load builds the
model without weights, materialises the others from the file, and rebuilds each quantised module
from its parts (`from_parts`: only fbgemm's packing runs again, as its packed form is a live C++
object, not bytes). The key is the GGUF file (path, size, modification time), torch, the CPU's
kernel choices and gemmaserve's code: any of them changing makes a new file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import platform
import threading
from pathlib import Path

import torch
from torch import nn

from .embedded import cache_dir

log = logging.getLogger(__name__)

FORMAT = 1


# What a model computes is in these parts of the package (the model code and its kernels, the KV layout
# and attention a compiled step reads, the export itself); a change anywhere else (the server, the
# benchmarks) keeps cached weights and compiled steps valid.
_COMPUTE_CODE = ("models", "attention", "kv", "rowops.py", "opaque.py", "engine/compile/aot_decode.py")


def code_fingerprint() -> str:
    """A hash of the source of what gemmaserve computes (`_COMPUTE_CODE`)."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for part in _COMPUTE_CODE:
        files = sorted((root / part).rglob("*.py")) if (root / part).is_dir() else [root / part]
        for path in files:
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


def cache_path(gguf: Path) -> Path:
    from .cpu_isa import cpu_class
    from .quant import default_int8_kernel

    st = gguf.stat()
    key = {"format": FORMAT, "file": [str(gguf.resolve()), st.st_size, st.st_mtime_ns], "torch": torch.__version__,
           "code": code_fingerprint(), "machine": platform.machine(), "int8": default_int8_kernel().value,
           "isa": cpu_class().value}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return cache_dir() / "quantized" / f"{digest}.safetensors"


def save(path: Path, model: nn.Module, record: dict, formats: dict[str, int]) -> threading.Thread:
    """Write the recorded parts and the model's other tensors to `path`, on a thread (the caller goes
    on; the parts stay alive until written). Returns the thread."""
    from safetensors.torch import save_file

    quantised = tuple(name + "." for name in record)
    tensors: dict[str, torch.Tensor] = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if not name.startswith(quantised):
            tensors[f"rest/{name}"] = t.detach()
    modules = {}
    for name, (fmt, parts) in record.items():
        modules[name] = fmt
        tensors.update((f"{name}/{k}", v.contiguous()) for k, v in parts.items())
    meta = {"modules": json.dumps(modules), "formats": json.dumps(formats)}

    def write() -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + ".tmp")
            save_file(tensors, str(tmp), metadata=meta)
            tmp.rename(path)
            log.info("quantised weights cached in %s: later starts load them without quantising", path)
        except Exception as e:   # a full disk, a read-only cache: the next start quantises again
            log.warning("could not cache the quantised weights in %s: %s", path, e)

    thread = threading.Thread(target=write, name="quant-cache", daemon=False)
    thread.start()
    return thread


def load(path: Path, model_class, config) -> tuple[nn.Module, dict[str, int]] | None:
    """The quantised model from `path`, or None if it is not there or does not fit this model."""
    from safetensors import safe_open

    from .quant import QuantEmbedding, QuantLinear, Rotation, WeightFormat

    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata()
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        modules, formats = json.loads(meta["modules"]), json.loads(meta["formats"])
        with torch.device("meta"):
            model = model_class(config, torch.float32)
        model.to_empty(device="cpu")   # the others get their values below; the quantised ones are replaced
        rest = {k.removeprefix("rest/"): v for k, v in tensors.items() if k.startswith("rest/")}
        own = dict(model.named_parameters()) | dict(model.named_buffers())
        if set(rest) - set(own):
            raise ValueError(f"tensors the model lacks: {sorted(set(rest) - set(own))[:3]}")
        with torch.no_grad():
            for name, value in rest.items():
                own[name].copy_(value)
        rotations: dict[int, Rotation] = {}
        for name, fmt in modules.items():
            parts = {k.split("/", 1)[1]: v for k, v in tensors.items() if k.split("/", 1)[0] == name}
            new = (QuantEmbedding.from_parts(parts) if fmt == "embedding"
                   else QuantLinear.from_parts(WeightFormat(fmt), parts, rotations))
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, new)
        return model.eval(), formats
    except Exception as e:   # damaged, or another structure: quantise again (and write a new one)
        log.warning("cached quantised weights in %s do not load (%s); quantising again", path, e)
        path.unlink(missing_ok=True)
        return None
