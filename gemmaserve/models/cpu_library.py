"""Building and loading the C++ library that serves the CPU ops' kernels (cpu_kernels.py's source, with
cpu_products.py's products), once per process, before the first step.

The library also holds the ops' C shims (cpu_shims.py), the functions a compiled decode package calls
instead of going through its proxy executor; it is loaded RTLD_GLOBAL so that a package finds them.

A first start compiles it (~15 s on 2 cores): `prepare()` starts the compiler on a thread and returns, so
that it runs while the model loads, and `load()` waits for it and registers the kernels on the caller's
thread. The instruction set it is compiled for is read from the CPU's flags, as
inductor's `pick_vec_isa` would choose it but without its probes (a test program compiled and run per
candidate: ~12 s of a first start); where that build fails, inductor's own probing path is tried.

The ops are declared (with their Python kernels) where they are used: cpu_kernels.py, cpu_products.py, cpu_head.py,
fused_ops.py, layers.py, lora.py, moe.py, quant.py and attention/blockwise.py. This module imports them
all, so the library registers a C++ kernel for each; none of them imports this one.
"""

from __future__ import annotations

import copy
import ctypes
import functools
import inspect
import os
import platform
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ..attention import blockwise  # noqa: F401  (declares gemmaserve::attend)
from . import cpu_head, cpu_products, cpu_shims
from . import fused_ops, layers, lora, moe, quant  # noqa: F401  (declare the other ops)
from .cpu_kernels import LORA_LOOP_RANK, OPS, SOURCE


def _source() -> str:
    products = cpu_products.SOURCE + cpu_head.SOURCE
    return (SOURCE.replace("@PRODUCTS@", products).replace("@LORA_LOOP_RANK@", str(LORA_LOOP_RANK))
            + cpu_shims.source(OPS))


def _build_class():
    from torch._inductor.codecache import CppCodeCache

    class _Build(CppCodeCache):   # a shared library that links PyTorch
        cache: dict = {}
        cpp_compile_command_flags = {"include_pytorch": True, "shared": True}

    return _Build


def _isa_flags() -> tuple[str, ...] | None:
    """The compiler flags of the vector ISA inductor's `pick_vec_isa` would pick on this x86 CPU (honouring
    ATEN_CPU_CAPABILITY, as it does), read from the CPU's flags alone; None elsewhere (inductor probes)."""
    from torch._inductor import cpu_vec_isa as v

    if platform.machine() not in ("x86_64", "AMD64") or v.config.cpp.simdlen is not None:
        return None
    have = v.x86_isa_checker()
    candidates = [isa for isa in v.supported_vec_isa_list if all(f in have for f in str(isa).split())]
    if not candidates:
        return ()
    isa = v.get_isa_from_cpu_capability(os.getenv("ATEN_CPU_CAPABILITY"), candidates, v.invalid_vec_isa)
    if isinstance(isa, v.InvalidVecISA):   # (not `not isa`: an ISA's truth value runs inductor's probe programs)
        return ()
    # the optional extensions its probes would find (they set these attributes), from the CPU's flags; on a copy
    chosen = copy.copy(isa)
    for extension in ("_is_avx512_bf16_supported", "_is_amx_fp16_supported"):   # attribute = torch.cpu's check
        if hasattr(chosen, extension) and hasattr(torch.cpu, extension):
            setattr(chosen, extension, bool(getattr(torch.cpu, extension)()))
    return (*chosen.build_arch_flags().split(), *(f"-D{m}" for m in getattr(chosen, "_macro", ())))


@dataclass
class _Pending:
    """The library's build, started: `loader` waits for the compiler (on `pool`'s thread) and loads it."""

    loader: Callable[[], object] | None
    error: Exception | None
    pool: ThreadPoolExecutor | None


@functools.cache   # once per process
def prepare() -> _Pending:
    """Start compiling the library (where inductor's cache lacks it) on a thread, and return at once."""
    try:
        build, source, flags = _build_class(), _source(), _isa_flags()
        if flags is not None and "needs_vec_isa" in inspect.signature(build.load_async).parameters:
            pool = ThreadPoolExecutor(1, thread_name_prefix="gemmaserve-cpu-library")
            return _Pending(build.load_async(source, submit_fn=pool.submit, needs_vec_isa=False, extra_flags=flags),
                            None, pool)
        return _Pending(functools.partial(build.load, source), None, None)
    except Exception as e:   # no compiler, no headers: reported by load()
        return _Pending(None, e, None)


def _loaded() -> object:
    pending = prepare()
    if pending.error is not None:
        raise pending.error
    try:
        return pending.loader()
    except Exception:   # a compiler without these flags: inductor's probes choose
        if pending.pool is None:
            raise
        build = _build_class()
        return build.load(_source())
    finally:
        if pending.pool is not None:
            pending.pool.shutdown(wait=False)


@functools.cache   # once per process: the registration is the process's
def load() -> str | None:
    """Build (or find in inductor's cache) and load the kernels. None once they serve the ops' CPU
    calls, else why they do not (the Python kernels then serve, with the same results)."""
    try:
        lib = _loaded()
        # promoted to the global scope: a compiled decode package's `aoti_torch_cpu_*` calls resolve to it
        ctypes.CDLL(lib._name, mode=os.RTLD_NOW | os.RTLD_GLOBAL)
    except Exception as e:   # no compiler, no headers: the Python kernels stay
        return f"{type(e).__name__}: {e}"
    if not all(torch._C._dispatch_has_kernel_for_dispatch_key(f"gemmaserve::{op}", "CPU") for op in OPS):
        return "the library loaded without registering its kernels"
    return None
