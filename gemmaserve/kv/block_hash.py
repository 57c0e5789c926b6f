"""Content addresses for prefix caching: a hash chain over token ids.

    h_0 = H(salt)            h_k = H(h_{k-1} || tokens[(k-1)g : kg])     (g = hash granularity)

h_k names "these exact kg tokens, after this salt": two sequences share h_k iff they share the first
kg tokens (up to a 128-bit collision). A group block ending at token e is addressed by h_{e/g}.
The salt keeps caches of different tenants or adapters apart (empty by default).
"""

from __future__ import annotations

import hashlib
from array import array


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def chain_root(salt: str | bytes = b"") -> bytes:
    return _digest(b"gemmaserve-prefix\x00" + (salt.encode() if isinstance(salt, str) else salt))


class HashChain(list):
    """A request's chain that starts from its own root (a salted one: another adapter's KV is another chain)."""

    def __init__(self, root: bytes):
        super().__init__()
        self.root = root


def root_of(chain: list[bytes], default: bytes) -> bytes:
    return chain.root if isinstance(chain, HashChain) else default


def extend_chain(chain: list[bytes], token_ids: list[int], granularity: int, root: bytes,
                 limit: int | None = None) -> None:
    """Append h_k for every full step of `granularity` tokens (of the first `limit`, default all) not
    yet in `chain` (chain[k-1] = h_k). Only new steps are hashed: a chain kept with its sequence
    grows with it and is never rebuilt."""
    n = len(token_ids) if limit is None else min(limit, len(token_ids))
    k = len(chain)
    prev = chain[-1] if chain else root
    while (k + 1) * granularity <= n:
        block = array("q", token_ids[k * granularity:(k + 1) * granularity]).tobytes()
        prev = _digest(prev + block)
        chain.append(prev)
        k += 1
