"""Handing freed host memory back to the operating system.

glibc keeps what a program frees in its arenas (one per thread that allocated) and returns it to the
system only from the top of one, unless asked. Loading a GGUF file frees about a gigabyte of fp32
temporaries (dequantised tensors, then the fp32 weights that quantisation replaces) in no fixed order
across threads, so how much of it stayed resident varied from run to run: the peak RSS of one
`gemmaserve generate` command read 1,883 or 2,159 MiB. `malloc_trim` hands back every free page of
every arena; called where loading has just freed a lot, the next allocations start from a resident
size that no longer depends on the run.
"""

from __future__ import annotations

import ctypes
import sys


def release_freed_memory() -> bool:
    """Return free heap pages to the system where the C library can (glibc); False where it cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):   # not glibc (musl has no malloc_trim)
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True


def available_host_memory() -> int | None:
    """Bytes the system can give a new allocation without swapping (Linux's MemAvailable), or None where it
    does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
