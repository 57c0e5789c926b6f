"""An engine's handle on the process that builds its ahead-of-time compiled decode steps (aot_decode.py).

An engine that finds no packages for its key starts the builder as a separate process (`python -m
gemmaserve.engine.aot_builder`, which assembles an engine of its own), at a lower priority, and keeps
serving with eager steps: tracing and compiling in the engine's own process would stall its steps
(tracing holds the GIL). The engine sees the build end between two steps (`BuildJob.poll`) and
switches. A lock file keeps two engines of one key (a server and a `generate`) from building twice;
the later one waits for the first one's build. The process outlives a one-shot `generate` that
started it, so the next start finds the packages.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

BUILDER = "gemmaserve.engine.aot_builder"   # the builder process's module (it imports the engine: this does not)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class BuildJob:
    """A build of one store directory, started by this process (`process`) or by another one."""

    directory: Path
    process: subprocess.Popen | None
    log_path: Path
    started: float

    @property
    def lock(self) -> Path:
        return self.directory.with_name(self.directory.name + ".lock")

    @classmethod
    def start(cls, config_fields: dict, directory: Path) -> "BuildJob":
        """Start the builder for `directory` (the key's), or follow the one another process runs."""
        directory.parent.mkdir(parents=True, exist_ok=True)
        log_path = directory.with_name(directory.name + ".log")
        lock = directory.with_name(directory.name + ".lock")
        for _ in range(2):
            try:
                fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                try:
                    pid = int(lock.read_text() or "0")
                except (OSError, ValueError):
                    pid = 0
                if pid and _alive(pid):
                    return cls(directory, None, log_path, time.perf_counter())
                lock.unlink(missing_ok=True)   # a builder that died: build again
                continue
            with open(log_path, "w") as out:
                process = subprocess.Popen(
                    [sys.executable, "-m", BUILDER, "--config", json.dumps(config_fields),
                     "--into", str(directory), "--lock", str(lock)],
                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            os.write(fd, str(process.pid).encode())
            os.close(fd)
            return cls(directory, process, log_path, time.perf_counter())
        raise RuntimeError(f"could not take the build lock {lock}")

    def poll(self) -> str | None:
        """None while the build runs; "" when its packages are in place; else why it failed."""
        if self.process is not None:
            code = self.process.poll()
            if code is None:
                return None
            if code == 0 and (self.directory / "manifest.json").is_file():
                return ""
            return f"the builder exited with {code} (its log: {self.log_path}): {self._last_line()}"
        if (self.directory / "manifest.json").is_file():
            return ""
        try:
            pid = int(self.lock.read_text() or "0")
        except (OSError, ValueError):
            pid = 0
        if pid and _alive(pid):
            return None
        return f"another process's build stopped without packages (its log: {self.log_path})"

    def _last_line(self) -> str:
        try:
            lines = [line for line in self.log_path.read_text().splitlines() if line.strip()]
        except OSError:
            return ""
        return lines[-1] if lines else ""
