"""Which class of CPU the quantised kernels are chosen for (quant.py), read once per process.

    VNNI      fbgemm's int8 x int8 product with 8-bit activations (AVX512-VNNI or AVX-VNNI: exact int32 sums)
    AVX2      fbgemm without VNNI: its kernel adds pairs of 8-bit x 8-bit products in int16 with saturation
              (vpmaddubsw), so activations get 7 bits (255 * 127 * 2 overflows int16, 128 * 127 * 2 does not)
    PORTABLE  no fbgemm (ARM: Apple Silicon, Graviton): the weight-only int8 and int4 products of
              cpu_products.py (fp32 activations; vector code written for AVX-512, AVX2, NEON or plain C)

`GEMMASERVE_CPU_ISA=auto|vnni|avx2|portable` forces a class (auto: the machine's). A forced class runs its
own code paths here: `avx2` also sets `FBGEMM_ENABLE_INSTRUCTIONS=AVX2` (unless set), so fbgemm itself takes
its AVX2 kernels, if nothing in the process called fbgemm yet; `ATEN_CPU_CAPABILITY=avx2|default` (set before
Python starts) does the same for PyTorch's own kernels and inductor's generated code. A class cannot be forced
above the machine's (`vnni` on a CPU without VNNI, or a fbgemm class where PyTorch has no fbgemm).
"""

from __future__ import annotations

import enum
import functools
import logging
import os
from pathlib import Path

import torch

from ..errors import UserInputError

log = logging.getLogger(__name__)

ENV = "GEMMASERVE_CPU_ISA"


class CpuClass(enum.Enum):
    VNNI = "vnni"
    AVX2 = "avx2"
    PORTABLE = "portable"

    @property
    def fbgemm(self) -> bool:
        return self is not CpuClass.PORTABLE


def machine_has_vnni(cpuinfo: str | None = None) -> bool:
    """Whether the CPU has 8-bit dot products with 32-bit sums (`cpuinfo`: /proc/cpuinfo's text)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    return "avx512_vnni" in cpuinfo or "avx_vnni" in cpuinfo


def machine_class(has_fbgemm: bool, has_vnni: bool) -> CpuClass:
    if not has_fbgemm:
        return CpuClass.PORTABLE
    return CpuClass.VNNI if has_vnni else CpuClass.AVX2


def resolve(forced: str, machine: CpuClass) -> CpuClass:
    """The class for `forced` (the variable's value; "" or "auto": the machine's) on a `machine` class CPU."""
    value = forced.strip().lower() or "auto"
    if value == "auto":
        return machine
    try:
        want = CpuClass(value)
    except ValueError:
        raise UserInputError(f"{ENV}={forced!r}: expected one of auto, "
                             + ", ".join(c.value for c in CpuClass)) from None
    rank = [CpuClass.PORTABLE, CpuClass.AVX2, CpuClass.VNNI]
    if rank.index(want) > rank.index(machine):
        raise UserInputError(f"{ENV}={value}: this CPU's class is {machine.value}; a class can be forced down, not up")
    return want


@functools.cache   # a fact of the process: every matrix of a model must take the same kernels
def cpu_class() -> CpuClass:
    """This process's class (`GEMMASERVE_CPU_ISA`, else the machine's), logged once with why."""
    machine = machine_class("fbgemm" in torch.backends.quantized.supported_engines, machine_has_vnni())
    forced = os.environ.get(ENV, "")
    chosen = resolve(forced, machine)
    if chosen is CpuClass.AVX2 and machine is CpuClass.VNNI:
        os.environ.setdefault("FBGEMM_ENABLE_INSTRUCTIONS", "AVX2")   # read by fbgemm at its first call
    why = f"forced by {ENV}={forced.strip()}" if chosen is not machine else "this CPU's"
    log.info("quantised CPU kernels for the %s class (%s; %s)", chosen.value, why, {
        CpuClass.VNNI: "fbgemm, 8-bit activations",
        CpuClass.AVX2: "fbgemm without VNNI, 7-bit activations",
        CpuClass.PORTABLE: "no fbgemm: weight-only int8/int4 kernels, fp32 activations"}[chosen])
    return chosen
