"""The section runner of the GPU benchmarks: each named section in turn; a section that raises is recorded
(`<name>_error`) without losing the others' figures, and the JSON is rewritten after every section, so a
command stopped at its time limit keeps what finished."""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import Callable, Mapping
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
        out.write_text(json.dumps(res, indent=2, default=str))
