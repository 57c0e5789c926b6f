"""An engine's lifetime on CUDA (`python -m benchmarks.gpu_lifetime`), as a notebook re-running its cell: a
Gemma 3 1B of random weights (testing/synthetic.py: no model package or download on the device) is built with the
default `--gpu-memory-utilization` (the KV cache takes most of the card), run,
and dropped with `del` (the garbage collector off, so only reference counts can free it), then with `close()`,
then in a `with` block, then with speculation and CUDA graphs on; after each the GPU's free memory must come
back to within 1 GiB of where it was before the first engine (torch's cache emptied first), a dropped engine must be
gone (a weak reference to it dead), and the next engine must start. Exit 1 otherwise.
Writes $OUT/gpu_lifetime.json."""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import weakref
from pathlib import Path

import torch

from gemmaserve.config.engine import EngineConfig
from gemmaserve.engine.llm import LLM
from gemmaserve.engine.sampling_params import SamplingParams
from gemmaserve.testing.synthetic import random_model

SLACK = 1 << 30
PROMPTS = ["w17 w300 w4000 w51", "w9 w8 w7"]   # the synthetic tokenizer's words


def _build(options: dict) -> LLM:
    """The engine alone holds the weights (nothing here keeps the loaded model)."""
    loaded = random_model("gemma3-1b", torch.bfloat16, torch.device("cuda"))
    return LLM.from_config(EngineConfig(model=loaded.source.name, device="cuda", **options), loaded)


def _free() -> int:
    """Free device memory as the driver sees it, after torch's caching allocator hands back its unused blocks
    (without empty_cache, memory a dropped engine freed stays reserved by torch and looks held)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0]


def main() -> int:
    out = Path(os.environ.get("OUT", "."))
    gc.disable()
    start = _free()
    rows, ok = [], True
    modes = [("del", {}), ("close", {}), ("with", {}), ("del", {"speculative_config": {"method": "ngram",
                                                                                      "num_speculative_tokens": 3}})]
    for how, options in modes:
        t0 = time.perf_counter()
        llm = _build(options)
        held = start - _free()
        tokens = len(llm.generate(PROMPTS, SamplingParams(max_tokens=16, ignore_eos=True))[0].outputs[0].token_ids)
        engine = weakref.ref(llm.engine)
        if how == "del":
            del llm
        elif how == "close":
            llm.close()
        else:
            with llm:
                pass
        back = _free()
        row = {"how": how, "options": options, "held_gib": round(held / 2**30, 2),
               "left_after_gib": round((start - back) / 2**30, 3), "seconds": round(time.perf_counter() - t0, 1),
               "tokens": tokens, "engine_alive": engine() is not None,
               "allocated_gib": round(torch.cuda.memory_allocated() / 2**30, 3)}
        row["ok"] = held > 10 * SLACK and start - back < SLACK and tokens == 16 and \
            (how != "del" or not row["engine_alive"])
        ok &= row["ok"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    gc.enable()
    (out / "gpu_lifetime.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows,
                                                        "ok": ok}, indent=1))
    print("ALL OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
