"""The CPU ops' C shims (models/cpu_shims.py): an AOTInductor package calls every op that can have one
directly, with no proxy-executor call left, and gets the bits the ops give eagerly; where the shims'
build fails the package is compiled with the proxy executor instead, still exact, and says so."""

import pytest
import torch

from gemmaserve.engine.compile import aot_decode
from gemmaserve.models import cpu_library, cpu_products, cpu_shims
from gemmaserve.models.cpu_kernels import OPS
from gemmaserve.models.quant import FbgemmTensors, Int8Kernel, Int8Matmul, Rotation, int8_rows

pytestmark = pytest.mark.skipif(cpu_library.load() is not None, reason=f"no C++ library: {cpu_library.load()}")

ops = torch.ops.gemmaserve


class EveryOp(torch.nn.Module):
    """One call of each shimmed op (both forms of an optional tensor), on the shapes the 270M's steps use."""

    def __init__(self, gen: torch.Generator):
        super().__init__()
        w = torch.randn(96, 64, generator=gen)
        self.w, self.norm = w, torch.randn(64, generator=gen)
        self.packed = cpu_products.pack_int4(torch.randint(0, 16, (96, 64), generator=gen, dtype=torch.uint8))
        self.scale, self.minus = torch.rand(96, 2, generator=gen) / 8, torch.rand(96, 2, generator=gen) / 4
        self.q8, self.s8 = int8_rows(w)
        self.experts, self.ends = torch.randn(3, 96, 64, generator=gen), torch.tensor([1, 1, 3], dtype=torch.int32)
        self.inv_freq = torch.rand(16, generator=gen)
        self.lin = Int8Matmul(*int8_rows(torch.randn(96, 640, generator=gen)), Int8Kernel.FBGEMM_DYNAMIC,
                              Rotation.for_width(640), keep_rows=False) if FbgemmTensors.available() else None

    def forward(self, x: torch.Tensor, x640: torch.Tensor, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                seen: torch.Tensor) -> list[torch.Tensor]:
        out = [ops.rms_norm(x, self.norm, 1e-6, 1.0), ops.rms_norm(x, None, 1e-6, 0.0)]
        out += ops.add_rms_norm(x, out[0], self.norm, self.norm, 1e-6, 1.0, None)
        out += ops.add_rms_norm(x, out[1], self.norm, None, 1e-6, 0.0, self.scale[0, :1])[:1]
        out += [ops.linear(x, self.w), ops.int4_mm(x, self.packed, self.scale, self.minus), ops.int8_mm(x, self.q8, self.s8),
                ops.grouped_linear(x, self.experts, self.ends)]
        out += [ops.gelu_mul(out[-1], 48), ops.softcap(out[-2], 30.0), *ops.rope_tables(positions, self.inv_freq)]
        out += [ops.rows_dot(x, self.experts[:, :5]), ops.attend(q, k, k * 0.5, seen, 0.125)]
        # the same keys as a cache of token rows, each row's last key its new token
        cache = torch.stack((k, k * 0.5), 2).reshape(-1, 2, *k.shape[2:])
        rows = torch.arange(cache.shape[0]).view(k.shape[0], k.shape[1])
        state = seen.squeeze(1).to(torch.int8)
        state[:, -1] = 2
        out += [ops.attend_paged(q, cache, rows, cache[rows[:, -1]], state, 0.125)]
        if self.lin is not None:
            t, r = self.lin._tensors, self.lin.rotation
            out += [ops.int8_linear(x640, r.a_t, r.block, t.shape, t.packed, t.col_offsets, t.bias, t.scales,
                                    self.lin.row_sums, t.guard),
                    ops.fbgemm_int8_linear(x640.clamp(0, 1), t.shape, t.packed, t.col_offsets, t.bias),
                    *ops.row_affine(x640, r.a_t, r.block)]
        return out


@pytest.fixture(scope="module")
def exported():
    gen = torch.Generator().manual_seed(3)
    module = EveryOp(gen)
    args = (torch.randn(3, 64, generator=gen), torch.randn(3, 640, generator=gen), torch.arange(5, 8),
            torch.randn(3, 1, 4, 16, generator=gen), torch.randn(3, 32, 2, 16, generator=gen),
            torch.rand(3, 1, 32, generator=gen) > 0.3)
    with torch.inference_mode():
        ep = torch.export.export(module, args, strict=False)
        want = module(*args)
    return ep, args, want, module


def _load(ep, package, module: torch.nn.Module):
    """The package with its constants bound to the module's own tensors, as engine/compile/aot_decode.py binds them."""
    live = aot_decode.tensor_paths(module)
    runner = torch._inductor.aoti_load_package(str(package))
    runner.load_constants({fqn: live[path] for fqn, path in aot_decode._constant_paths(ep, package, module).items()},
                          check_full_update=True, user_managed=True)
    return runner


def test_every_op_with_plain_arguments_has_a_shim():
    """All ops but lora_add (its tensor lists keep the proxy executor) get one, named as inductor calls it."""
    assert {s.op for s in cpu_shims.shims(OPS)} == set(OPS) - {"lora_add"}
    shim = next(s for s in cpu_shims.shims(OPS) if s.op == "add_rms_norm")
    assert shim.declaration == ("AOTITorchError aoti_torch_cpu_add_rms_norm(AtenTensorHandle a0, AtenTensorHandle a1, "
                                "AtenTensorHandle a2, AtenTensorHandle* a3, double a4, double a5, AtenTensorHandle* a6, "
                                "AtenTensorHandle* ret0, AtenTensorHandle* ret1)")


@pytest.mark.skipif(not aot_decode.shim_configs(), reason="this torch has no aot_inductor.custom_ops_to_c_shims")
def test_a_package_calls_the_shims_and_gives_the_eager_bits(exported, tmp_path):
    ep, args, want, module = exported
    package = tmp_path / "shims.pt2"
    assert aot_decode._compile(ep, package, aot_decode.shim_configs())
    assert aot_decode._proxy_calls(package) == 0
    got = _load(ep, package, module)(*args)
    assert len(got) == len(want) and all(torch.equal(g, w) for g, w in zip(got, want))


def test_a_failed_shim_build_falls_back_to_the_proxy_executor(exported, tmp_path, caplog):
    """A declaration that does not match inductor's call (as a torch of another convention would write)
    does not compile: the package is built without shims, logged, and still exact."""
    ep, args, want, module = exported
    broken = {getattr(ops, op).default: [f"AOTITorchError {cpu_shims.shim_name(op)}(void)"] for op in ("rms_norm", "linear")}
    package = tmp_path / "proxy.pt2"
    assert not aot_decode._compile(ep, package, {"aot_inductor.custom_ops_to_c_shims": broken})
    assert "compiling with the proxy executor" in caplog.text
    calls = sum(n.op == "call_function" and str(n.target).startswith("gemmaserve.") for n in ep.graph.nodes)
    assert calls >= 13 and aot_decode._proxy_calls(package) == calls   # every op call
    got = _load(ep, package, module)(*args)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("capability", [None, "avx2", "default"])
def test_the_library_is_built_for_the_isa_inductor_would_probe_for(capability, monkeypatch):
    """The library's flags are read from the CPU's (no probe programs: ~12 s of a first start); they must be
    those of the ISA inductor's probing `pick_vec_isa` chooses, ATEN_CPU_CAPABILITY (the avx2 class) included."""
    from torch._inductor import cpu_vec_isa

    if capability is None:
        monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    else:
        monkeypatch.setenv("ATEN_CPU_CAPABILITY", capability)
    flags = cpu_library._isa_flags()
    if flags is None:
        pytest.skip("not an x86 CPU: inductor probes")
    isa = cpu_vec_isa.pick_vec_isa()
    expected = (*isa.build_arch_flags().split(), *(f"-D{m}" for m in getattr(isa, "_macro", ()))) if isa else ()
    assert flags == expected


def test_the_librarys_isa_flags_run_no_probe_programs(monkeypatch):
    """Reading the flags must not ask an ISA for its truth value: that compiles and runs inductor's probe programs
    (~4 s of a first start, found in `if not isa`)."""
    from torch._inductor import cpu_vec_isa

    def probe(self):
        raise AssertionError(f"{self} probed")

    for isa in cpu_vec_isa.supported_vec_isa_list:
        monkeypatch.setattr(type(isa), "__bool__", probe)
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    flags = cpu_library._isa_flags()
    if flags is None:
        pytest.skip("not an x86 CPU: inductor probes")
    assert flags and any(f.startswith("-m") for f in flags)
