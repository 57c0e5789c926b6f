"""The start-up check: on this host, does every CPU kernel of a step give a row the same bits alone and in a batch?

The products sum in an order of our own (cpu_products.py), so with the C++ library built the answer is
yes by construction; the check is what tells a user when it is not: the library could not be built and
the Python kernels run on the host's BLAS (whose kernel choice follows the row count on some hosts), or
a kernel we take from a library (fbgemm's int8 x int8 product, ATen's gelu) behaves otherwise on this
CPU. Each kernel runs on random rows, alone and inside batches of several sizes, at the process's
thread count and at one thread; any bit of difference is reported by name. ~0.1 s, once per process.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

BATCHES = (2, 5, 8, 13, 16)   # row counts a row is checked in (13: where MKL broke on an AMX Xeon)


@dataclass(frozen=True)
class Finding:
    """A kernel whose row `row` of a `rows`-row call differs from that row computed alone."""

    kernel: str
    rows: int
    row: int
    threads: int

    def __str__(self) -> str:
        return f"{self.kernel}: row {self.row} of {self.rows} (on {self.threads} thread{'s' * (self.threads > 1)})"


def _kernels(gen: torch.Generator) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Name -> f(x [M, K]) -> [M, ...]: each CPU product of a step, on random weights of a Gemma-like width."""
    from . import cpu_head, cpu_products, fused_ops
    from .cpu_isa import cpu_class
    from .quant import FbgemmTensors, Int8Kernel, Int8Matmul, Rotation, int8_blocks, int8_rows

    k, n = 256, 96
    ops = torch.ops.gemmaserve
    w = torch.randn(n, k, generator=gen)
    q4 = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scale, minus = torch.rand(n, k // 32, generator=gen) / 8, torch.rand(n, k // 32, generator=gen) / 4
    packed = cpu_products.pack_int4(q4)
    q8, s8 = int8_rows(w)
    experts = torch.randn(3, n, k, generator=gen)
    kv = torch.randn(2, 192, 1, k // 4, generator=gen)   # 192 keys of one KV head, head dim 64
    cache = kv.permute(1, 0, 2, 3).contiguous()            # the same as a cache of token rows [192, 2, 1, 64]
    state = torch.tensor([1] * 191 + [2], dtype=torch.int8)   # seen, and the last key a row's new token
    rows = torch.randn(1, 40, k, generator=gen)
    table = int8_blocks(torch.randn(333, k, generator=gen) / 16)   # the output head's Q8_0 table and 4-bit copy
    scan = cpu_head.pack(*table)
    kernels: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "linear": lambda x: ops.linear(x, w),
        "int4_mm": lambda x: ops.int4_mm(x, packed, scale, minus),
        "int8_mm": lambda x: ops.int8_mm(x, q8, s8),
        # every row to the middle expert, so a row's expert block grows with the batch
        "grouped_linear": lambda x: ops.grouped_linear(
            x, experts, torch.tensor([0, len(x), len(x)], dtype=torch.int32)),
        "rows_dot": lambda x: ops.rows_dot(x, rows.expand(len(x), -1, -1)),
        "head_logits": lambda x: ops.head_logits(x, *scan, *table, 4.0),
        # a decode row per key set (4 query heads on 1 KV head), each set the same 192 keys
        "attend": lambda x: ops.attend(x.view(-1, 1, 4, k // 4), kv[0].expand(len(x), -1, -1, -1),
                                       kv[1].expand(len(x), -1, -1, -1), torch.ones(len(x), 1, 192, dtype=torch.bool),
                                       0.1).flatten(1),
        # the same keys read from a cache of token rows, each row's last key its own new token
        "attend_paged": lambda x: ops.attend_paged(
            x.view(-1, 1, 4, k // 4), cache, torch.arange(192).expand(len(x), -1),
            cache[191:192].expand(len(x), -1, -1, -1), state.expand(len(x), -1), 0.1).flatten(1),
        "gelu_mul": lambda x: fused_ops.gelu_mul(x, k // 2),
        "rms_norm": lambda x: fused_ops.rms_norm(x, w[0], fused_ops.NormKind(1e-6, 1.0)),
    }
    if cpu_class().fbgemm:   # the quantised layers' int8 x int8 product
        rot = Rotation.for_width(k)
        lin = Int8Matmul(*int8_rows(rot.apply(w)), Int8Kernel.FBGEMM_DYNAMIC, rot, keep_rows=False,
                         fbgemm_tensors=FbgemmTensors.available())
        kernels["fbgemm int8"] = lin
    return kernels


def findings(seed: int = 0, kernels: dict[str, Callable[[torch.Tensor], torch.Tensor]] | None = None) -> list[Finding]:
    """Every kernel and row count where a row's bits follow the batch (empty: none). `kernels`: others
    to judge than the step's (f(x [M, 256]) -> [M, ...])."""
    gen = torch.Generator().manual_seed(seed)
    kernels = _kernels(gen) if kernels is None else kernels
    x = torch.randn(max(BATCHES), 256, generator=gen) * 2
    found: list[Finding] = []
    threads = torch.get_num_threads()
    for n_threads in sorted({threads, 1}, reverse=True):
        torch.set_num_threads(n_threads)
        try:
            with torch.inference_mode():
                for name, f in kernels.items():
                    alone = [f(x[i:i + 1]) for i in range(len(x))]
                    for m in BATCHES:
                        got = f(x[:m])
                        bad = [i for i in range(m) if not torch.equal(got[i:i + 1], alone[i])]
                        if bad:
                            found.append(Finding(name, m, bad[0], n_threads))
                            break
        finally:
            torch.set_num_threads(threads)
    return found


@functools.cache   # a fact of the host and the process's kernels: once
def check() -> list[Finding]:
    """`findings()`, logged: a warning that names each kernel where this host breaks batch invariance."""
    found = findings()
    if found:
        log.warning("batch invariance does not hold on this host: a row's bits follow the rest of the batch in %s. "
                    "Greedy outputs may change with the batch (the C++ kernels give every row its own order: is a "
                    "C++ compiler installed?)", "; ".join(map(str, found)))
    else:
        log.info("batch invariance checked: every CPU kernel gives a row the same bits alone and in a batch")
    return found
