"""Building and loading the C++ library that serves the CPU ops' kernels (cpu_kernels.py's source, with
cpu_products.py's products), once per process, before the first step.

The library also holds the ops' C shims (cpu_shims.py), the functions a compiled decode package calls
instead of going through its proxy executor; it is loaded RTLD_GLOBAL so that a package finds them.

The ops are declared (with their Python kernels) where they are used: cpu_kernels.py, cpu_products.py,
fused_ops.py, layers.py, lora.py, moe.py, quant.py and attention/blockwise.py. This module imports them
all, so the library registers a C++ kernel for each; none of them imports this one.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

from ..attention import blockwise  # noqa: F401  (declares gemmaserve::attend)
from . import cpu_products, cpu_shims
from . import fused_ops, layers, lora, moe, quant  # noqa: F401  (declare the other ops)
from .cpu_kernels import LORA_LOOP_RANK, OPS, SOURCE


@functools.cache   # once per process: the registration is the process's
def load() -> str | None:
    """Build (or find in inductor's cache) and load the kernels. None once they serve the ops' CPU
    calls, else why they do not (the Python kernels then serve, with the same results)."""
    try:
        from torch._inductor.codecache import CppCodeCache

        class _Build(CppCodeCache):   # a shared library that links PyTorch
            cache: dict = {}
            cpp_compile_command_flags = {"include_pytorch": True, "shared": True}

        lib = _Build.load(SOURCE.replace("@PRODUCTS@", cpu_products.SOURCE)
                          .replace("@LORA_LOOP_RANK@", str(LORA_LOOP_RANK)) + cpu_shims.source(OPS))
        # promoted to the global scope: a compiled decode package's `aoti_torch_cpu_*` calls resolve to it
        ctypes.CDLL(lib._name, mode=os.RTLD_NOW | os.RTLD_GLOBAL)
    except Exception as e:   # no compiler, no headers: the Python kernels stay
        return f"{type(e).__name__}: {e}"
    if not all(torch._C._dispatch_has_kernel_for_dispatch_key(f"gemmaserve::{op}", "CPU") for op in OPS):
        return "the library loaded without registering its kernels"
    return None
