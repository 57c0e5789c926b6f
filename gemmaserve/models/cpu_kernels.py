"""The C++ kernel of `gemmaserve::fbgemm_int8_linear` (quant.py), for compiled decode graphs.

The op is defined in Python (`torch.library.custom_op`), so a compiled graph that calls it leaves
C++ for Python at every call (the GIL, the arguments converted and back), 45 times a step for the
270M: a batch-1 step took 12.09 ms with the Python kernel, 11.97 with this one. The kernel below does
what the Python one does (quant.py's `_fbgemm_int8_product`: PyTorch's fbgemm op, and the activations' rounding error
through it again where `two_pass`) and registers for the CPU dispatch key, which the dispatcher
prefers to the Python kernel's CompositeExplicitAutograd one. Built once with inductor's C++
toolchain (the one compiled graphs need anyway; its cache keeps the library), loaded on demand.
Where it cannot be built the Python kernel serves, as before."""

from __future__ import annotations

import functools

import torch

SOURCE = r"""
#include <ATen/ATen.h>
#include <torch/library.h>

namespace {
at::Tensor fbgemm_int8_linear(const at::Tensor& x, const at::Tensor& shape, const at::Tensor& packed,
                              const at::Tensor& col_offsets, const at::Tensor& bias, bool two_pass) {
  at::Tensor y = at::fbgemm_linear_int8_weight_fp32_activation(x, shape, packed, col_offsets, 1.0, 0, bias);
  if (two_pass) {
    at::Tensor rounded = at::quantize_per_tensor_dynamic(x, at::kQUInt8, false).dequantize();
    y.add_(at::fbgemm_linear_int8_weight_fp32_activation(x - rounded, shape, packed, col_offsets, 1.0, 0, bias));
  }
  return y;
}
}  // namespace

TORCH_LIBRARY_IMPL(gemmaserve, CPU, m) {
  m.impl("fbgemm_int8_linear", &fbgemm_int8_linear);
}
"""


@functools.cache   # once per process: the registration is the process's
def load() -> str | None:
    """Build (or find in inductor's cache) and load the kernel. None once it serves the op's CPU
    calls, else why it does not."""
    from . import quant

    if not quant.FbgemmTensors.available():
        return "the op is not used on this CPU (no fbgemm int8 op or no VNNI)"
    try:
        from torch._inductor.codecache import CppCodeCache

        class _Build(CppCodeCache):   # a shared library that links PyTorch
            cache: dict = {}
            cpp_compile_command_flags = {"include_pytorch": True, "shared": True}

        _Build.load(SOURCE)
    except Exception as e:   # no compiler, no headers: the Python kernel stays
        return f"{type(e).__name__}: {e}"
    if not torch._C._dispatch_has_kernel_for_dispatch_key("gemmaserve::fbgemm_int8_linear", "CPU"):
        return "the library loaded without registering its kernel"
    return None
