"""Run by tests/test_cpu_classes.py in a process of its own, whose environment forces the AVX2 class
(`GEMMASERVE_CPU_ISA=avx2`, fbgemm's and PyTorch's AVX2 kernels): what each forced CPU class's kernels and
steps give, written as JSON to argv[2]. A process of its own because the class, fbgemm's instruction set
and PyTorch's are fixed once per process. The portable class runs after the AVX2 one in the same process
(it calls no fbgemm, so only our class needs re-reading)."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from gemmaserve import LLM, SamplingParams  # noqa: E402
from gemmaserve.config.engine import EngineConfig  # noqa: E402
from gemmaserve.engine.compile import aot_decode  # noqa: E402
from gemmaserve.models import cpu_isa, cpu_library  # noqa: E402
from gemmaserve.models.loader import load_model  # noqa: E402
from gemmaserve.models.quant import Int8Kernel, Int8Matmul, default_int8_kernel, quantize_model  # noqa: E402

from helpers import save_checkpoint, tiny_hf_model  # noqa: E402

PARAMS = SamplingParams(max_tokens=5, temperature=0, logprobs=2, ignore_eos=True)
PROBE = "the cat sat on the mat " * 2
OTHERS = [f"{w} " * (2 + i) for i, w in enumerate("a river ran by the old mill at dusk".split())]
LAYERS = ["sliding_attention", "full_attention", "sliding_attention"]


def saturation(k: int = 640) -> dict:
    """fbgemm's kernel here adds 8-bit pair products in int16 (the AVX2 one saturates at 255 * 127 * 2), and
    `Int8Matmul`'s 7-bit activations do not: weights all 127, inputs all 1 but one 0 (so each row spans [0, 1])."""
    q = torch.full((16, k), 127, dtype=torch.int8)
    x = torch.ones(2, k)
    x[:, 0] = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        raw = torch.fbgemm_linear_int8_weight_fp32_activation(
            x, torch.zeros(1, dtype=torch.int8).expand(16, k), torch.fbgemm_pack_quantized_matrix(q),
            q.sum(1, dtype=torch.int32), 1.0, 0, torch.zeros(16))
    ours = Int8Matmul(q, torch.ones(16, dtype=torch.bfloat16), Int8Kernel.FBGEMM_DYNAMIC)(x)
    step = torch.tensor(2.0, dtype=torch.float32) / 255
    seven_bit = float(torch.round(torch.tensor(1.0) / step)) * float(step) * 127 * (k - 1)
    return {"raw": raw[0, 0].item(), "eight_bit": 127.0 * (k - 1), "ours": ours[0, 0].item(),
            "seven_bit": seven_bit}


def product(seed: int) -> list:
    """A rotated int8 matrix's product (fixed weights and inputs): the parent compares its bits with its own."""
    from gemmaserve.models.quant import Rotation, int8_rows

    gen = torch.Generator().manual_seed(seed)
    w, x = torch.randn(96, 256, generator=gen), torch.randn(5, 256, generator=gen) * 3
    rot = Rotation.for_width(256)
    return Int8Matmul(*int8_rows(rot.apply(w)), Int8Kernel.FBGEMM_DYNAMIC, rot, keep_rows=False)(x).tolist()


def head(seed: int) -> list:
    """The 4-bit head's logits (cpu_head.py; fixed table and rows): its integer dots and float steps are the
    same on every vector branch, so the parent (another branch where its CPU has AVX-512) compares the bits."""
    from gemmaserve.models import cpu_head
    from gemmaserve.models.quant import int8_blocks

    gen = torch.Generator().manual_seed(seed)
    q8, s8 = int8_blocks(torch.randn(333, 64, generator=gen) * 0.05)
    h = torch.randn(9, 64, generator=gen) * 3
    return torch.ops.gemmaserve.head_logits(h, *cpu_head.pack(q8, s8), q8, s8, 2.0).tolist()


def rows(llm: LLM, prompts: list[str]) -> list:
    out = []
    for o in llm.generate(prompts, PARAMS):
        c = o.outputs[0]
        out.append([list(c.token_ids),
                    [[lp.token_id, lp.logprob, [list(t) for t in (lp.top or ())]] for lp in c.logprobs]])
    return out


def engines(root: Path, path: Path) -> dict:
    """Eager and compiled (packages built now, in this class) engines on the tiny model quantised for this
    class: the probe alone and at three places of a batch of 8, and which steps the packages ran."""
    loaded = load_model(str(path), torch.float32, torch.device("cpu"))
    loaded = dataclasses.replace(loaded, weight_formats=quantize_model(loaded.model, {}))
    config = EngineConfig(model=str(path), page_size=4, max_num_seqs=8, max_num_batched_tokens=32, cpu_compile="off")
    eager = LLM.from_config(config, loaded)
    compiled = LLM.from_config(config.replace(cpu_compile="on"), loaded)
    steps = compiled.engine._runner.compiled
    ran = []
    if isinstance(steps, aot_decode.AotDecode):
        run = steps.run

        def counted(ids, pos, md):
            out = run(ids, pos, md)
            ran.append(len(ids) if out is not None else -len(ids))
            return out
        steps.run = counted
    result = {"kernel": default_int8_kernel().value, "steps": type(steps).__name__,
              "store": str(compiled.engine._compiled_steps.store())}
    for name, llm in (("eager", eager), ("compiled", compiled)):
        result[name] = {"alone": rows(llm, [PROBE])[0],
                        "batched": [rows(llm, OTHERS[:at] + [PROBE] + OTHERS[at:7])[at] for at in (0, 3, 7)]}
    result["ran"] = ran
    return result


def main(root: Path, out: Path) -> None:
    os.environ["GEMMASERVE_CACHE_DIR"] = str(root / "cache")
    aot_decode.STATIC_SIZES = (1,)   # the 1-row graph and the dynamic one: one graph less to compile
    assert cpu_library.load() is None
    path = save_checkpoint(tiny_hf_model(11, hidden_size=64, intermediate_size=128, head_dim=32, sliding_window=6,
                                         num_key_value_heads=2, vocab_size=320, num_hidden_layers=3,
                                         layer_types=LAYERS), root / "tiny")
    found = {"fbgemm_isa": os.environ.get("FBGEMM_ENABLE_INSTRUCTIONS"),
             "aten_isa": torch.backends.cpu.get_cpu_capability(), "classes": {}}
    for forced in ("avx2", "portable"):
        os.environ[cpu_isa.ENV] = forced
        cpu_isa.cpu_class.cache_clear()
        assert cpu_isa.cpu_class().value == forced
        entry = found["classes"][forced] = engines(root, path)
        if forced == "avx2":
            entry["saturation"] = saturation()
            entry["product"] = product(5)
            entry["head"] = head(6)
    out.write_text(json.dumps(found))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
