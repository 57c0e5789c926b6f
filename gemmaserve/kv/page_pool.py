"""A pool of equal-size KV pages, identified by integers 0..num_pages-1."""

from __future__ import annotations


class PagePool:
    """Hands out free page ids. All-or-nothing: a request for n pages gets n or none."""

    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"a page pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        # A stack, so the pages freed last are reused first (warm in cache).
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._is_free = [True] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._is_free[p] = False
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if self._is_free[p]:
                raise RuntimeError(f"page {p} freed twice")
            self._is_free[p] = True
            self._free.append(p)

    def is_free(self, page: int) -> bool:
        return self._is_free[page]
