"""The NIXL runtime: the decode engine READs the prefill engine's staged buffer, one-sided, through
NIXL agents (UCX backend: DRAM on the CPU, VRAM on GPUs).

    prefill (source)                                  decode (sink)
    register_memory(staged buffer)
    offer -> {agent name, partial agent metadata (this buffer's registration + connection info),
              buffer descriptors}  (travels in the transfer descriptor)
                                                      add_remote_agent(metadata)      per transfer: adds its region
                                                      register_memory(receive buffer)
                                                      initialize_xfer("READ", local, remote) + transfer
                                                      poll check_xfer_state: DONE / ERR / timeout
    withdraw: deregister_memory                       deregister_memory

Agents are not thread-safe in NIXL's default sync mode: every call holds the runtime's lock (the
polling loop releases it between polls, so transfers overlap).
"""

from __future__ import annotations

import base64
import threading
import time
import uuid

import torch

from .runtime import Control, TransferTimeout, import_nixl


def _agent(role: str):
    nixl = import_nixl()
    name = f"gemmaserve-{role}-{uuid.uuid4().hex[:12]}"   # unique: a restarted engine is a new peer
    return name, nixl.nixl_agent(name, nixl.nixl_agent_config(backends=["UCX"]))


class NixlSource:
    def __init__(self) -> None:
        self.name, self.agent = _agent("prefill")
        self._regs: dict[str, tuple[torch.Tensor, object]] = {}
        self._lock = threading.Lock()

    def offer(self, transfer_id: str, buffer: torch.Tensor) -> dict:
        with self._lock:
            reg_descs = self.agent.get_reg_descs(buffer)
            reg = self.agent.register_memory(reg_descs)
            self._regs[transfer_id] = (buffer, reg)
            descs = self.agent.get_serialized_descs(self.agent.get_xfer_descs(buffer))
            # This buffer's registration (and how to connect): a sink that knows this agent from an
            # earlier transfer only learns the new region this way (else NIXL_ERR_NOT_FOUND).
            meta = self.agent.get_partial_agent_metadata(reg_descs, inc_conn_info=True)
        return {"agent": self.name, "metadata": base64.b64encode(meta).decode(),
                "descs": base64.b64encode(descs).decode()}

    def handle(self, op: str, body: dict, timeout: float) -> dict:
        raise ValueError(f"the nixl runtime is one-sided: no control operation {op!r}")

    def withdraw(self, transfer_id: str) -> None:
        with self._lock:
            entry = self._regs.pop(transfer_id, None)
            if entry is not None:
                self.agent.deregister_memory(entry[1])

    def close(self) -> None:
        for tid in list(self._regs):
            self.withdraw(tid)


class NixlSink:
    def __init__(self) -> None:
        self.name, self.agent = _agent("decode")
        self._remotes: set[str] = set()
        self._abandoned: list[tuple[torch.Tensor, object]] = []   # buffers of transfers NIXL would not release
        self._lock = threading.Lock()

    def receive(self, source: dict, transfer_id: str, nbytes: int, device: torch.device, timeout: float,
                control: Control) -> torch.Tensor:
        deadline = time.monotonic() + timeout
        remote = str(source["agent"])
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        with self._lock:
            self.agent.add_remote_agent(base64.b64decode(source["metadata"]))   # adds this transfer's region
            self._remotes.add(remote)
            reg = self.agent.register_memory(self.agent.get_reg_descs(buffer))
            handle = None
        try:
            with self._lock:
                handle = self.agent.initialize_xfer("READ", self.agent.get_xfer_descs(buffer),
                                                    self.agent.deserialize_descs(base64.b64decode(source["descs"])),
                                                    remote, transfer_id.encode())
                state = self.agent.transfer(handle)
            pause = 0.0002
            while state != "DONE":
                if state == "ERR":
                    self._forget(remote)
                    raise RuntimeError(f"NIXL READ of transfer {transfer_id} failed (the prefill engine died?)")
                if time.monotonic() > deadline:
                    self._forget(remote)
                    raise TransferTimeout(f"NIXL READ of transfer {transfer_id} did not complete in {timeout:g}s")
                time.sleep(pause)
                pause = min(2 * pause, 0.01)
                with self._lock:
                    state = self.agent.check_xfer_state(handle)
        finally:
            with self._lock:
                try:
                    if handle is not None:
                        self.agent.release_xfer_handle(handle)
                    self.agent.deregister_memory(reg)
                except Exception:   # still in flight: the buffer must outlive whatever UCX may write
                    self._abandoned.append((buffer, reg))
        return buffer

    def _forget(self, remote: str) -> None:
        """Drop a peer that failed: a restarted one comes back under a new agent name."""
        with self._lock:
            if remote in self._remotes:
                self._remotes.discard(remote)
                try:
                    self.agent.remove_remote_agent(remote)
                except Exception:
                    pass

    def close(self) -> None:
        with self._lock:
            self._remotes.clear()
