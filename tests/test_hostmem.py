"""hostmem.release_freed_memory: freed heap pages that glibc would keep resident go back to the system."""

import sys

import pytest

from gemmaserve.hostmem import release_freed_memory


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; malloc_trim is glibc's")
def test_freed_pages_between_live_allocations_leave_the_resident_set():
    # ~160 MiB of small blocks on the heap, each written; one in 16 stays alive, so the freed ones
    # are ~60 KiB holes between live blocks: free() returns nothing of them (it trims only a heap's
    # top), wherever the heap stood before the test.
    blocks = [bytearray(4096) for _ in range(40_000)]
    live = blocks[::16]
    del blocks
    before = _rss_mib()
    if not release_freed_memory():
        pytest.skip("no malloc_trim in this C library")
    after = _rss_mib()
    assert before - after > 80, f"resident {before:.0f} -> {after:.0f} MiB"
    assert len(live) == 2500
