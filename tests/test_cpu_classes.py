"""The quantised kernels' CPU classes (models/cpu_isa.py): each forced on this machine, in a process of its
own (tests/cpu_class_check.py) whose fbgemm and PyTorch run their AVX2 kernels. Without VNNI the steps still
export (fbgemm's tensor op, 7-bit activations by a guard row) and the portable class (no fbgemm: weight-only
kernels) too; in each class eager and compiled steps, alone and in any batch, give the same bits."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gemmaserve.engine.compile.compiled_decode import unavailable
from gemmaserve.errors import UserInputError
from gemmaserve.models.cpu_isa import CpuClass, machine_class, machine_has_vnni, resolve

HERE = Path(__file__).parent


def test_a_class_resolves_from_the_machine_and_can_be_forced_down_only():
    assert machine_has_vnni("flags : fpu avx2 avx512f avx512_vnni") and machine_has_vnni("flags : avx2 avx_vnni")
    assert not machine_has_vnni("flags : fpu avx2 avx512f avx512bw")
    assert machine_class(True, True) is CpuClass.VNNI and machine_class(True, False) is CpuClass.AVX2
    assert machine_class(False, True) is CpuClass.PORTABLE
    assert resolve("", CpuClass.VNNI) is CpuClass.VNNI and resolve(" Auto ", CpuClass.AVX2) is CpuClass.AVX2
    assert resolve("avx2", CpuClass.VNNI) is CpuClass.AVX2 and resolve("PORTABLE", CpuClass.AVX2) is CpuClass.PORTABLE
    with pytest.raises(UserInputError, match="forced down, not up"):
        resolve("vnni", CpuClass.AVX2)
    with pytest.raises(UserInputError, match="forced down, not up"):
        resolve("avx2", CpuClass.PORTABLE)
    with pytest.raises(UserInputError, match="expected one of auto, vnni, avx2, portable"):
        resolve("avx512", CpuClass.VNNI)


@pytest.fixture(scope="module")
def forced(tmp_path_factory):
    if unavailable() is not None or "fbgemm" not in torch.backends.quantized.supported_engines:
        pytest.skip("needs fbgemm and compiled steps")
    root = tmp_path_factory.mktemp("classes")
    env = dict(os.environ, FBGEMM_ENABLE_INSTRUCTIONS="AVX2", ATEN_CPU_CAPABILITY="avx2",
               GEMMASERVE_CPU_ISA="avx2", GEMMASERVE_BACKGROUND_COMPILE="0")
    done = subprocess.run([sys.executable, str(HERE / "cpu_class_check.py"), str(root), str(root / "out.json")],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((root / "out.json").read_text())


def test_the_forced_process_runs_avx2_kernels_and_seven_bit_products_do_not_saturate(forced):
    """fbgemm's AVX2 kernel saturates 8-bit pairs (so it is the one running); the guard row's 7 bits do not."""
    assert forced["fbgemm_isa"] == "AVX2" and forced["aten_isa"] == "AVX2"
    sat = forced["classes"]["avx2"]["saturation"]
    assert abs(sat["raw"] - sat["eight_bit"]) > 0.3 * sat["eight_bit"]   # saturated: about half
    assert sat["ours"] == pytest.approx(sat["seven_bit"], rel=1e-6)


@pytest.mark.parametrize("cls", ["avx2", "portable"])
def test_each_class_compiles_its_steps_with_the_eager_bits_in_any_batch(forced, cls):
    got = forced["classes"][cls]
    assert got["kernel"] == ("fbgemm" if cls == "avx2" else "weight-only")
    assert got["steps"] == "AotDecode"   # exported packages, not eager nor in-process torch.compile
    assert got["ran"] and all(n > 0 for n in got["ran"]) and 1 in got["ran"] and max(got["ran"]) >= 8, got["ran"]
    eager, compiled = got["eager"], got["compiled"]
    assert eager["batched"] == [eager["alone"]] * 3
    assert compiled == eager


def test_classes_have_packages_of_their_own(forced):
    stores = {c["store"] for c in forced["classes"].values()}
    assert len(stores) == 2 and None not in stores
    avx2, portable = forced["classes"]["avx2"], forced["classes"]["portable"]
    assert avx2["eager"]["alone"] != portable["eager"]["alone"]   # other kernels: other last bits


def test_the_avx2_class_gives_a_real_avx2_hosts_bits_on_any_fbgemm(forced):
    """Its products are exact integer sums, so fbgemm's AVX2 kernels (the forced process) and this process's
    (VNNI where the machine has it) give the same bits for the AVX2 class's 7-bit inputs."""
    from gemmaserve.models.quant import FbgemmTensors, Int8Kernel, Int8Matmul, Rotation, _guard_row, int8_rows

    gen = torch.Generator().manual_seed(5)
    w, x = torch.randn(96, 256, generator=gen), torch.randn(5, 256, generator=gen) * 3
    rot = Rotation.for_width(256)
    mat = Int8Matmul(*int8_rows(rot.apply(w)), Int8Kernel.FBGEMM_DYNAMIC, rot, keep_rows=False)
    if mat._tensors is None:
        pytest.skip("no fbgemm tensor op")
    t = mat._tensors
    y = torch.ops.gemmaserve.int8_linear(x, rot.a_t, rot.block, t.shape, t.packed, t.col_offsets, t.bias, t.scales,
                                         mat.row_sums, _guard_row(256, seven_bits=True))
    assert torch.equal(y, torch.tensor(forced["classes"]["avx2"]["product"]))
    assert isinstance(t, FbgemmTensors)


def test_the_head_gives_the_same_bits_on_the_avx2_branch(forced):
    """The 4-bit head's scan (integer dots, then the same float steps) on the forced process's AVX2 build and
    on this one's (AVX-512 with or without VNNI where the machine has them): the same logits."""
    import cpu_class_check
    from gemmaserve.models import cpu_library

    assert cpu_library.load() is None
    assert torch.equal(torch.tensor(cpu_class_check.head(6)), torch.tensor(forced["classes"]["avx2"]["head"]))
