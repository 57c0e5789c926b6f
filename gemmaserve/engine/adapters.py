"""`Adapters`: the LoRA adapters an engine serves, as its users see them (`LLMEngine.adapters`).

Add and remove run on the thread that steps the engine (a server posts them); names, refs and `in` read a
snapshot of the registry and may run on any thread.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import UserInputError
from .lora import LoRARef, LoRARegistry, LoRASlots
from .request import Request


class Adapters:
    def __init__(self, registry: LoRARegistry, slots: LoRASlots | None, unfinished: dict[str, Request]):
        """`unfinished`: the engine's unfinished requests (read to refuse removing an adapter in use);
        plain data, not the engine, so no reference cycle runs through here."""
        self._registry, self._slots, self._unfinished = registry, slots, unfinished

    def add(self, name: str, path: str | Path) -> LoRARef:
        """Serve the PEFT adapter at `path` as `name` (read and checked now: a UserInputError says what is wrong).
        Under tensor parallelism each rank reads its slice when the scheduler first puts it into a slot."""
        return self._registry.add(name, path)

    def remove(self, name: str) -> None:
        """Stop serving adapter `name`; refused while unfinished requests use it."""
        ref = self._registry.get(name)
        users = sum(1 for r in self._unfinished.values() if r.lora is not None and r.lora.key == ref.key)
        if users:
            raise UserInputError(f"LoRA adapter {name!r} is in use by {users} unfinished request(s)")
        self._registry.remove(name)
        if self._slots is not None:
            self._slots.forget(ref)

    def get(self, name: str) -> LoRARef:
        """The adapter `name`, or a UserInputError naming those loaded."""
        return self._registry.get(name)

    def names(self) -> list[str]:
        return self._registry.names()

    def refs(self) -> list[LoRARef]:
        return self._registry.refs()

    def __contains__(self, name: str) -> bool:
        return name in self._registry

    def __len__(self) -> int:
        return len(self._registry.names())
