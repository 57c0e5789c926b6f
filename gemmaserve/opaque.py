"""Python objects that a compiled graph hands to custom ops without tracing into them.

torch.compile cannot trace some things a decode step needs: fbgemm's packed weights (a TorchScript
class with no fake implementation) and a batch's attention (Python plans built per step). Each is
wrapped in an opaque reference type and passed to a custom op: the compiler traces the op's fake
(shape-only) kernel, and the graph takes the object as an input, handing it over untouched when it
runs. Opaque objects need torch >= 2.10; `SUPPORTED` says whether this torch has them.
"""

from __future__ import annotations

try:
    from torch._library.opaque_object import register_opaque_type
    from torch._opaque_base import OpaqueBase
    SUPPORTED = True
except ImportError:   # an older torch: no compiled CPU decode, everything else unchanged
    OpaqueBase = object  # type: ignore[assignment,misc]
    register_opaque_type = None
    SUPPORTED = False


class OpaqueRef(OpaqueBase):
    """Base of our opaque reference types. The compile cache pickles the graph's inputs for its key:
    only `cache_key()` is pickled (an input is never baked into the graph, so its contents need not
    be hashed; fbgemm's packed qint8 weights cannot be)."""

    def cache_key(self) -> tuple:
        return (type(self).__name__,)

    def __getstate__(self) -> tuple:
        return self.cache_key()

    # A reference to a live object: copies share it (pickling above is for cache keys only).
    def __copy__(self) -> "OpaqueRef":
        return self

    def __deepcopy__(self, memo: dict) -> "OpaqueRef":
        return self


def opaque_reference(cls: type) -> type:
    """Class decorator: register a subclass of `OpaqueRef` as an opaque reference type (a no-op on a
    torch without opaque objects)."""
    if SUPPORTED:
        register_opaque_type(cls, typ="reference")
    return cls
