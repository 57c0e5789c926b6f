"""Host-to-device copies that never wait for the device.

A plain `torch.tensor(data, device="cuda")` copies from pageable memory and synchronises the stream
first, so preparing step N+1 would wait for step N to finish. Staging through pinned memory with a
non-blocking copy queues the transfer behind step N instead (PyTorch's pinned allocator keeps the
buffer alive until the copy has run).
"""

from __future__ import annotations

import numpy as np
import torch


def to_device(data, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A list, numpy array or CPU tensor on `device`, queued without a host synchronisation."""
    host = torch.from_numpy(data).to(dtype) if isinstance(data, np.ndarray) else torch.as_tensor(data, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
