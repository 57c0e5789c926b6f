"""The interface the scheduler and the model runner use, whatever the KV layout.

A manager hands out *pages* from one pool. Each request has, per *table*, a list of pages (its page
table): logical block i of the request lives in page table[i]. Attention layers read K/V through the
table of their group (`layer_table[layer]`). The manager never touches tensors: it only decides
which page holds which tokens; the attention backend owns the memory.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from .spec import LayerSpec


@dataclass(frozen=True)
class KVStats:
    num_pages: int
    pages_used: int
    pages_free: int
    page_size: int
    page_bytes: int


class KVCacheManager(ABC):
    def __init__(self, specs: list[LayerSpec], page_size: int, num_pages: int):
        if page_size < 1:
            raise ValueError(f"page size must be >= 1, got {page_size}")
        self.specs = list(specs)
        self.page_size = page_size
        self.num_pages = num_pages

    @property
    @abstractmethod
    def layer_table(self) -> list[int]:
        """For each layer, the index of the page table it reads through."""

    @property
    @abstractmethod
    def num_tables(self) -> int: ...

    @property
    @abstractmethod
    def page_bytes(self) -> int:
        """Bytes of KV memory one page stands for (over all layers that share it)."""

    @abstractmethod
    def pages_for(self, num_tokens: int) -> int:
        """Pages one sequence of `num_tokens` tokens holds at its peak."""

    @abstractmethod
    def allocate(self, seq_id: str, num_tokens: int) -> bool:
        """Make room for tokens [0, num_tokens) of a sequence. Atomic: False (and no change) if the
        pool cannot supply the pages."""

    @abstractmethod
    def free(self, seq_id: str) -> None:
        """Give back every page of a sequence (finished, aborted or preempted)."""

    @abstractmethod
    def page_table(self, seq_id: str, table: int = 0) -> list[int]: ...

    @property
    @abstractmethod
    def num_free_pages(self) -> int: ...

    @abstractmethod
    def stats(self) -> KVStats: ...

    @abstractmethod
    def check_integrity(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent."""

    def fits_ever(self, num_tokens: int) -> bool:
        return self.pages_for(num_tokens) <= self.num_pages
