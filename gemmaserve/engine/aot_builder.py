"""The process that builds an engine configuration's ahead-of-time compiled decode steps:
`python -m gemmaserve.engine.aot_builder --config JSON --into DIR [--lock FILE]`.

Started by an engine that found no packages for its key (compile/build_job.py holds the engine's handle
on it). It assembles an engine of the same model and KV options (a small pool: the graphs take the pool's
size as an input), checks that it computes the same key, builds into the key's directory
(compile/aot_decode.py) and exits. It sits beside llm_engine.py, above the compile/ room it drives.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:   # (imported in main, after the priority is lowered: importing torch takes seconds of CPU)
    from ..config.engine import EngineConfig

log = logging.getLogger(__name__)

BUILD_KV_MEMORY = 64 << 20   # the builder's KV pool: any size serves (it is a graph input)


def builder_config(fields: dict) -> "EngineConfig":
    """The engine the builder assembles from the fields it was started with (compiled_steps.build_fields)."""
    from ..config.engine import EngineConfig

    return EngineConfig(**(fields | {"cpu_compile": "off", "kv_cache_memory": BUILD_KV_MEMORY}))


def idle_priority() -> None:
    """Run on CPU time nobody else wants: the engine's decode threads meet at a barrier every product, so a
    builder that takes a core from one of them for a moment stalls them all (at nice 10 a 270M step took 20x
    longer). SCHED_IDLE (Linux; inherited by inductor's compile workers) yields to any other task at once, but
    only within a scheduling group: the builder leads a session of its own (it outlives the command that
    started it), which Linux's autogroups schedule as a peer of the engine's session, half the CPU each
    whatever the nice values inside, so the group is lowered too. (Its thread count stays: inductor sizes the
    generated code's parallel loops by it.) Measured beside eager decoding of the 270M on 2 cores
    (benchmarks/background_build_cost.py): 3-10% slower with this, 14-19% at nice 19 alone, 40-54% at nice 10.
    The price: an engine that never idles leaves the build only the moments it waits (a step's Python, between
    requests). GEMMASERVE_BUILDER_PRIORITY=normal keeps the normal priority (tests that wait for a build)."""
    if os.environ.get("GEMMASERVE_BUILDER_PRIORITY", "idle") == "normal":
        return
    os.nice(19)
    try:
        Path("/proc/self/autogroup").write_text("19")
    except OSError:   # (no autogroups here: the policy below is enough)
        pass
    if hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_IDLE"):
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except OSError:   # (refused in some containers: nice 19 stays)
            pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="build the compiled CPU decode steps of one engine configuration")
    parser.add_argument("--config", required=True, help="the engine's options (JSON)")
    parser.add_argument("--into", required=True, help="the store directory its key names")
    parser.add_argument("--lock", help="the lock file to remove when done")
    args = parser.parse_args(argv)
    # Lowered here rather than in a preexec_fn (that would make the engine fork, copying its page tables: ENOMEM
    # for a large engine process under the kernel's overcommit heuristic), before torch is imported.
    idle_priority()
    from .compile import aot_decode
    from .llm_engine import LLMEngine

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        engine = LLMEngine(builder_config(json.loads(args.config)))
        directory = engine._compiled_steps.store()
        if directory is None or directory != Path(args.into):
            raise RuntimeError(f"this configuration's packages belong in {directory}, not {args.into}")
        layout, key = engine._compiled_steps.layout_and_key()
        aot_decode.build(engine._model, layout, key, directory)
        log.info("built the compiled decode steps into %s", directory)
        return 0
    except Exception:
        log.exception("building the compiled decode steps failed")
        return 1
    finally:
        if args.lock:
            Path(args.lock).unlink(missing_ok=True)


if __name__ == "__main__":
    sys.exit(main())
