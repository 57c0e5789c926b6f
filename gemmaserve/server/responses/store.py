"""Stored responses (`store: true`), held in memory for `previous_response_id`, GET and DELETE: bounded by count
and by bytes (the oldest go first) and expiring after a time to live. One store per server, owned by its
Responses endpoint; it is used from the event loop only, so it takes no lock."""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoredResponse:
    id: str
    body: dict                  # the Response object, as GET returns it
    conversation: tuple[dict, ...]   # chat messages through this response's output (a continuation's start)

    def size(self) -> int:
        """Bytes it holds, as JSON (images as their data URLs): what the byte bound counts."""
        return len(json.dumps(self.body, ensure_ascii=False)) + len(json.dumps(self.conversation, ensure_ascii=False))


@dataclass(frozen=True)
class StoreLimits:
    max_items: int
    max_bytes: int
    ttl: float   # seconds from storing


class ResponseStore:
    def __init__(self, limits: StoreLimits, clock: Callable[[], float] = time.monotonic):
        self.limits, self.clock = limits, clock
        # insertion order is expiry order (one TTL for all): the oldest are first to expire and to be evicted
        self._entries: OrderedDict[str, tuple[StoredResponse, int, float]] = OrderedDict()
        self.bytes = 0

    def put(self, entry: StoredResponse) -> bool:
        """Keep `entry`, evicting the oldest beyond the bounds; False if it alone exceeds the byte bound."""
        size = entry.size()
        if size > self.limits.max_bytes:
            log.warning("response %s (%d bytes) is larger than the store's bound of %d bytes: not stored", entry.id,
                        size, self.limits.max_bytes)
            return False
        self.delete(entry.id)
        self._expire()
        while self._entries and (len(self._entries) >= self.limits.max_items
                                 or self.bytes + size > self.limits.max_bytes):
            self._drop(next(iter(self._entries)))
        self._entries[entry.id] = (entry, size, self.clock() + self.limits.ttl)
        self.bytes += size
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        self._expire()
        found = self._entries.get(response_id)
        return found[0] if found is not None else None

    def delete(self, response_id: str) -> bool:
        self._expire()
        if response_id not in self._entries:
            return False
        self._drop(response_id)
        return True

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def _expire(self) -> None:
        now = self.clock()
        while self._entries:
            key, (_, _, expires) = next(iter(self._entries.items()))
            if expires > now:
                return
            self._drop(key)

    def _drop(self, response_id: str) -> None:
        _, size, _ = self._entries.pop(response_id)
        self.bytes -= size
