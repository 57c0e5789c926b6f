"""C entry points ("C shims") of the CPU ops, so AOTInductor's generated code calls their kernels directly.

An AOTInductor graph calls a custom op through its proxy executor: the arguments boxed into a stack,
the dispatcher, the op's autograd kernel (Python, for `torch.library.custom_op`), then ours: 8.5 us a
call under inference_mode (BENCHMARKS.md, issue 47), 185 calls a 270M decode step. Inductor instead
calls a C function `aoti_torch_cpu_<op>` for every op named in `aot_inductor.custom_ops_to_c_shims`
(declared there, resolved when the package loads). Each shim here unwraps the handles and calls the same C++ kernel the dispatcher
would reach (cpu_kernels.py's library), so a shimmed package gives the proxied one's bits.

The shims are written from the ops' schemas, in inductor's calling convention for a fallback kernel:

    Tensor -> AtenTensorHandle      Tensor? -> AtenTensorHandle* (nullptr: None)
    int, SymInt -> int64_t          float -> double
    each returned Tensor -> a trailing AtenTensorHandle* the shim fills

An op with any other argument (lists, Python objects, bools) keeps the proxy executor. The library is
loaded RTLD_GLOBAL (cpu_library.py) so that a package's undefined `aoti_torch_cpu_*` symbols resolve to it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

_ARG_TYPES = {   # schema type -> (C parameter type, the C++ kernel's argument made from parameter `p`)
    "Tensor": ("AtenTensorHandle", "*torch::aot_inductor::tensor_handle_to_tensor_pointer({p})"),
    "Optional[Tensor]": ("AtenTensorHandle*", "({p} ? std::optional<at::Tensor>("
                         "*torch::aot_inductor::tensor_handle_to_tensor_pointer(*{p})) : std::nullopt)"),
    "int": ("int64_t", "{p}"),
    "SymInt": ("int64_t", "{p}"),
    "float": ("double", "{p}"),
}


@dataclasses.dataclass(frozen=True)
class Shim:
    """One op's C entry point: what inductor's generated code is compiled against, and its body."""
    op: str             # the op's name in the gemmaserve namespace
    declaration: str    # the C prototype (inductor puts it in an extern "C" block of the wrapper)
    definition: str     # C++ for the library, after the op's kernel (same translation unit)


def shim_name(op: str) -> str:
    return f"aoti_torch_cpu_{op}"   # inductor's name for the C shim of `gemmaserve::<op>` on the CPU


def make_shim(op: str, schema: torch.FunctionSchema) -> Shim | None:
    """The shim of `gemmaserve::<op>` (calling the library's C++ function `<op>`), or None where a type of
    its schema has no shim convention here."""
    params, call = [], []
    for i, a in enumerate(schema.arguments):
        kind = _ARG_TYPES.get(str(a.type))
        if kind is None or a.kwarg_only:
            return None
        params.append(f"{kind[0]} a{i}")
        call.append(kind[1].format(p=f"a{i}"))
    returns = schema.returns
    if not returns or any(str(r.type) != "Tensor" for r in returns):
        return None
    params += [f"AtenTensorHandle* ret{j}" for j in range(len(returns))]
    declaration = f"AOTITorchError {shim_name(op)}({', '.join(params)})"
    if len(returns) == 1:
        store = "    *ret0 = torch::aot_inductor::new_tensor_handle(std::move(out));\n"
    else:
        store = "".join(f"    *ret{j} = torch::aot_inductor::new_tensor_handle(std::move(std::get<{j}>(out)));\n"
                        for j in range(len(returns)))
    definition = (f'extern "C" __attribute__((visibility("default"))) {declaration} {{\n'
                  f"  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({{\n"
                  f"    auto out = ::{op}(   // qualified: no argument-dependent lookup (at::linear)\n        "
                  f"{', '.join(call)});\n{store}"
                  f"  }});\n}}\n")
    return Shim(op, declaration, definition)


def shims(ops: tuple[str, ...]) -> list[Shim]:
    """The shims of those of `ops` (declared in the gemmaserve namespace) that can have one and whose name
    no ATen shim of this torch takes (its header is in the generated wrapper: a clash would not compile)."""
    taken = _aten_shim_names()
    out = []
    for op in ops:
        shim = make_shim(op, getattr(torch.ops.gemmaserve, op).default._schema)
        if shim is not None and shim_name(op) not in taken:
            out.append(shim)
    return out


def source(ops: tuple[str, ...]) -> str:
    """C++ appended to the library's source: the includes the shims need and every shim."""
    return ("\n#include <torch/csrc/inductor/aoti_torch/c/shim.h>\n"
            "#include <torch/csrc/inductor/aoti_torch/utils.h>\n\n"
            + "".join(s.definition for s in shims(ops)))


def inductor_configs(ops: tuple[str, ...]) -> dict:
    """`aot_inductor.custom_ops_to_c_shims` for every shim, or {} where this torch has no such option."""
    from torch._inductor import config

    if not hasattr(config.aot_inductor, "custom_ops_to_c_shims"):
        return {}
    return {"aot_inductor.custom_ops_to_c_shims": {getattr(torch.ops.gemmaserve, s.op).default: [s.declaration]
                                                   for s in shims(ops)}}


def _aten_shim_names() -> set[str]:
    """Every `aoti_torch_cpu_*` name this torch's generated C shim headers declare."""
    import re

    folder = Path(torch.__file__).parent / "include/torch/csrc/inductor/aoti_torch/generated"
    names: set[str] = set()
    for header in folder.glob("c_shim_*.h"):
        names.update(re.findall(r"\b(aoti_torch_cpu_\w+)\s*\(", header.read_text()))
    return names
