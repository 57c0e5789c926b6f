"""The torch.distributed runtime: one two-rank process group per (prefill, decode) pair, gloo on the
CPU and NCCL on CUDA, built without a global `init_process_group` (an engine talks to many peers).

    decode (sink, rank 1)                             prefill (source, rank 0)
    TCPStore (master) on a free port
    ProcessGroup(store, 1, 2)   ---control "connect" {pair, host, port}-->  ProcessGroup(store, 0, 2)
    ...once per pair; then per transfer:
    work = recv(buf, src=0, tag)                      (staged buffer of the transfer id)
                                ---control "send" {transfer_id, pair, tag}-->  send(buf, dst=1, tag)
    work.wait(timeout)

The receive is posted before the send is asked for: a gloo send completes only once its receive is
posted. A pair that fails (a peer died, a timeout) is dropped; the next transfer builds a new one.
"""

from __future__ import annotations

import datetime
import itertools
import threading
import uuid

import torch
import torch.distributed as dist

from .runtime import Control, TransferTimeout


def _group(store: dist.Store, rank: int, timeout: float, device: torch.device):
    delta = datetime.timedelta(seconds=timeout)
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = delta
        return dist.ProcessGroupNCCL(store, rank, 2, opts)
    return dist.ProcessGroupGloo(store, rank, 2, delta)


def _failed(exc: Exception, what: str) -> Exception:
    text = str(exc)
    if "Timed out" in text or "timed out" in text:
        return TransferTimeout(f"{what} timed out: {text.splitlines()[0]}")
    return RuntimeError(f"{what} failed: {text.splitlines()[0] if text else type(exc).__name__}")


class TorchSource:
    def __init__(self, device: torch.device):
        self.device = device
        self._buffers: dict[str, torch.Tensor] = {}
        self._pairs: dict[str, object] = {}
        self._lock = threading.Lock()

    def offer(self, transfer_id: str, buffer: torch.Tensor) -> dict:
        with self._lock:
            self._buffers[transfer_id] = buffer
        return {}

    def handle(self, op: str, body: dict, timeout: float) -> dict:
        if op == "connect":
            store = dist.TCPStore(str(body["host"]), int(body["port"]), 2, False,
                                  timeout=datetime.timedelta(seconds=timeout))
            try:
                group = _group(store, 0, timeout, self.device)
            except Exception as exc:
                raise _failed(exc, "joining the transfer group") from None
            with self._lock:
                self._pairs[str(body["pair"])] = group
            return {}
        if op == "send":
            with self._lock:
                buffer = self._buffers.get(str(body["transfer_id"]))
                group = self._pairs.get(str(body["pair"]))
            if buffer is None:
                raise KeyError(f"no staged transfer {body['transfer_id']!r} (expired or released)")
            if group is None:
                raise KeyError(f"no transfer group {body['pair']!r} (this engine restarted?)")
            try:
                group.send([buffer], 1, int(body["tag"])).wait(datetime.timedelta(seconds=timeout))
            except Exception as exc:
                with self._lock:
                    self._pairs.pop(str(body["pair"]), None)
                raise _failed(exc, "sending KV") from None
            return {"bytes": buffer.numel()}
        raise ValueError(f"unknown transfer control operation {op!r}")

    def withdraw(self, transfer_id: str) -> None:
        with self._lock:
            self._buffers.pop(transfer_id, None)

    def close(self) -> None:
        with self._lock:
            self._buffers.clear()
            self._pairs.clear()


class TorchSink:
    def __init__(self, device: torch.device, host: str):
        self.device = device
        self.host = host                       # where sources reach this engine's stores
        self._pairs: dict[str, tuple[str, object]] = {}   # source engine id -> (pair id, group)
        self._tags = itertools.count(1)
        self._lock = threading.Lock()

    def _pair(self, source: str, timeout: float, control: Control) -> tuple[str, object]:
        with self._lock:
            if source in self._pairs:
                return self._pairs[source]
        pair = uuid.uuid4().hex
        store = dist.TCPStore(self.host, 0, 2, True, timeout=datetime.timedelta(seconds=timeout),
                              wait_for_workers=False)
        box: list = [None, None]

        def build() -> None:
            try:
                box[0] = _group(store, 1, timeout, self.device)
            except Exception as exc:   # reported below
                box[1] = exc

        builder = threading.Thread(target=build, name="gemmaserve-kv-pair", daemon=True)
        builder.start()
        control("connect", {"pair": pair, "host": self.host, "port": store.port})
        builder.join(timeout)
        if box[0] is None:
            raise _failed(box[1] or TimeoutError("timed out"), "building the transfer group")
        with self._lock:
            self._pairs[source] = (pair, box[0])
        return pair, box[0]

    def receive(self, source: dict, transfer_id: str, nbytes: int, device: torch.device, timeout: float,
                control: Control) -> torch.Tensor:
        engine = str(source["engine"])
        pair, group = self._pair(engine, timeout, control)
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        tag = next(self._tags)
        try:
            work = group.recv([buffer], 0, tag)
            control("send", {"transfer_id": transfer_id, "pair": pair, "tag": tag})
            work.wait(datetime.timedelta(seconds=timeout))
        except Exception as exc:
            with self._lock:
                if self._pairs.get(engine, (None,))[0] == pair:
                    del self._pairs[engine]
            if isinstance(exc, TransferTimeout):
                raise
            raise _failed(exc, "receiving KV") from None
        return buffer.to(device)

    def close(self) -> None:
        with self._lock:
            self._pairs.clear()
