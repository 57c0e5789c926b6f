"""The section runner of the GPU benchmarks: each named section in turn; a section that raises is recorded
(`<name>_error`) without losing the others' figures, and the JSON is rewritten after every section, so a
command stopped at its time limit keeps what finished.

The exit status: a script declares which of its sections hold check rows and what makes a row pass
(`CHECKS`); `exit_status` prints one summary line and returns 1 if any such row fails or any section
raised, 0 otherwise. Timings are figures, never failures."""

from __future__ import annotations

import gc
import json
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any
from pathlib import Path


def run_sections(res: dict, names: list[str], sections: Mapping[str, Callable[[], None]], out: Path) -> None:
    unknown = [n for n in names if n not in sections]
    if unknown:
        raise ValueError(f"unknown section(s) {', '.join(unknown)}; known: {', '.join(sections)}")
    for name in names:
        start = time.perf_counter()
        try:
            sections[name]()
        except Exception as exc:   # keep the other sections' figures
            traceback.print_exc()
            res[f"{name}_error"] = repr(exc)
        res[f"{name}_seconds"] = round(time.perf_counter() - start, 1)
        held = release_device_memory()
        if held:   # what a section left allocated: the next one has that much less
            res[f"{name}_left_allocated_GB"] = round(held / 1e9, 2)
        out.write_text(json.dumps(res, indent=2, default=str))


def release_device_memory() -> int:
    """Collect garbage and return the CUDA caching allocator's free blocks to the device (a section's models,
    KV caches and graph pools are garbage once it returns); the bytes still allocated (0 without CUDA)."""
    gc.collect()
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return 0
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated()


Check = Callable[[dict[str, Any]], bool]


def check_failures(res: dict, checks: Mapping[str, Check]) -> list[str]:
    """One line per failing check row (a row missing the checked field fails) and per section that raised.
    A check section that did not run, or was skipped (a string instead of rows), has no rows to fail."""
    bad = []
    for section, passed in checks.items():
        rows = res.get(section)
        if not isinstance(rows, list):
            continue
        for row in rows:
            try:
                ok = bool(passed(row))
            except (KeyError, TypeError, ValueError):
                ok = False
            if not ok:
                shown = ", ".join(f"{k}={v}" for k, v in row.items())
                bad.append(f"{section}: {shown[:300]}")
    bad += [f"{key.removesuffix('_error')} raised: {str(value)[:300]}" for key, value in res.items()
            if key.endswith("_error")]
    return bad


def exit_status(res: dict, checks: Mapping[str, Check]) -> int:
    """Print each failure, then one summary line (last, where a tail sees it); the process exit status."""
    rows = sum(len(res[s]) for s in checks if isinstance(res.get(s), list))
    bad = check_failures(res, checks)
    if not bad:
        print(f"CHECKS PASSED: {rows} check rows, no section raised", flush=True)
        return 0
    for line in bad:
        print(f"FAIL {line}", flush=True)
    print(f"CHECKS FAILED: {len(bad)} failure(s) above ({rows} check rows)", flush=True)
    return 1
