"""Compiled CPU decode steps over an engine's life: loaded from the cache directory if they are there,
else built by a background process (build_job.py, aot_builder.py) while the engine steps eagerly, and switched to
between two steps once built (`poll`). `state` is what `EngineInfo.cpu_compile` reports: off,
unavailable, building, ready or failed (eager).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ...config.engine import EngineConfig
from ...errors import UserInputError
from .build_job import BuildJob

if TYPE_CHECKING:   # the parts the engine assembled (factory.py, above this room)
    from ..factory import EngineParts

log = logging.getLogger(__name__)

# The options a compiled decode step depends on, which a background build is given (build_job.py, aot_builder.py).
# The options that decide the packages' key (the model, its weights' formats, the KV layout): the builder process
# gets these, and must compute the same key.
_BUILD_FIELDS = ("model", "dtype", "quantization", "kv_cache_dtype", "kv_cache_manager", "page_size",
                 "swa_scratch_reuse", "attention_backend", "max_model_len")


def build_fields(config: EngineConfig) -> dict:
    """What the builder process is started with (aot_builder.py: `--config`)."""
    return {k: getattr(config, k) for k in _BUILD_FIELDS}


class CompiledDecodeSteps:
    def __init__(self, config: EngineConfig, parts: EngineParts):
        self.config = config
        self.device, self.model, self.runner, self.kv = parts.device, parts.loaded.model, parts.runner, parts.kv
        self.specs, self.loaded, self.weights = parts.specs, parts.loaded, parts.info.weights
        self.state = "off"
        self._build: BuildJob | None = None   # a background build, until it ends

    def layout_and_key(self) -> "tuple[object, dict] | str":
        """The KV layout a compiled decode step reads (a DecodeLayout) and the key of its packages
        (aot_decode.py), or why this engine's steps cannot be exported."""
        from ...attention.traced import DecodeLayout
        from ...models.quant import Int8Matmul
        from . import aot_decode

        if self.device.type != "cpu" or self.config.tensor_parallel_size > 1:
            return "only single-process CPU engines compile their decode steps"
        spec = self.config.speculative_config
        if spec is not None and spec.method == "draft_model":   # the build process lays out the target's KV alone
            return "a draft model's KV layers are not in the packages' layout yet"
        if any(isinstance(v, Int8Matmul) and v._packed is not None for m in self.model.modules() for v in vars(m).values()):
            # every CPU class packs into tensors (models/quant.py); PyTorch without that op leaves Python objects
            return ("fbgemm's packed weights (no tensor-packed op in this PyTorch) are Python objects, "
                    "which an export cannot hold")
        layout = DecodeLayout.of(self.specs, self.runner.kv_cache, self.kv.layer_slot, self.kv.layout.tokens_per_page,
                                 self.kv.layout.num_pages)
        if isinstance(layout, str):
            return layout
        return layout, aot_decode.artifact_key(self.loaded.source.path, self.weights, layout)

    def store(self) -> "Path | None":
        """Where this engine's compiled decode packages live (or would), None if it has none."""
        from . import aot_decode

        found = self.layout_and_key()
        return None if isinstance(found, str) else aot_decode.store_dir(found[1])

    def set_up(self, mode: str) -> None:
        """`mode` (EngineConfig.cpu_compile_mode): "off"; "background": load the packages if the cache
        has them, else start their build and step eagerly until it is done; "now": load or build them
        before returning (compiled_decode.py's torch.compile where they cannot be exported)."""
        from . import aot_decode
        from .compiled_decode import unavailable

        if mode == "off":
            return
        why = unavailable()
        found = why or self.layout_and_key()
        if isinstance(found, str):
            if mode == "now" and why is None:
                log.info("compiling CPU decode steps in this process (packages cannot be built here: %s)", found)
                self.runner.compile_decode(required=True)
                self.state = "ready"
            elif mode == "now":
                raise UserInputError(f"--cpu-compile on: {why}")
            else:
                log.info("CPU decode steps stay eager: %s", found)
                self.state = "unavailable"
            return
        layout, key = found
        directory = aot_decode.store_dir(key)
        if (directory / "manifest.json").is_file() and self._load_compiled(layout, directory):
            return
        if mode == "now":
            log.info("building compiled CPU decode steps into %s (minutes the first time on a small CPU)", directory)
            aot_decode.build(self.model, layout, key, directory)
            if not self._load_compiled(layout, directory):
                raise RuntimeError(f"the compiled decode steps just built in {directory} do not load")
            return
        if os.environ.get("GEMMASERVE_BACKGROUND_COMPILE", "1") == "0":
            log.info("no compiled CPU decode steps in the cache, and GEMMASERVE_BACKGROUND_COMPILE=0: steps stay eager")
            self.state = "off"
            return
        self._build = BuildJob.start(build_fields(self.config), directory)
        who = f"pid {self._build.process.pid}" if self._build.process else "another process, already running"
        log.info("compiled CPU decode steps: building in the background (%s; log %s): a few minutes the first "
                 "time on a small CPU, after which this and every later start use them; eager steps meanwhile",
                 who, self._build.log_path)
        self.state = "building"

    def _load_compiled(self, layout, directory: Path) -> bool:
        from . import aot_decode

        try:
            compiled = aot_decode.AotDecode(self.model, layout, directory, self.runner.max_decode_rows)
        except Exception as e:   # stale or damaged packages: build again
            log.warning("compiled decode steps in %s do not load (%s); building them again", directory, e)
            shutil.rmtree(directory, ignore_errors=True)
            return False
        self.runner.use_compiled(compiled)
        log.info("compiled CPU decode steps: loaded from %s in %.2f s", directory, compiled.load_seconds)
        self.state = "ready"
        return True

    @property
    def build(self) -> "BuildJob | None":
        """The background build of compiled decode steps the engine waits for, if any."""
        return self._build

    def poll(self) -> bool:
        """If a background build just finished, switch to its steps (between two steps). True while a
        build is still running."""
        if self._build is None:
            return False
        outcome = self._build.poll()
        if outcome is None:
            return True
        build, self._build = self._build, None
        if outcome:
            log.warning("compiled CPU decode steps: the build failed, steps stay eager: %s", outcome)
            self.state = "failed"
            return False
        found = self.layout_and_key()
        if not isinstance(found, str) and self._load_compiled(found[0], build.directory):
            log.info("compiled CPU decode steps ready %.0f s after the engine started building them",
                     time.perf_counter() - build.started)
        else:
            self.state = "failed"
        return False
