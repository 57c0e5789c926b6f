"""LoRA on the GPU (`python -m benchmarks.gpu_lora [sections] [--shapes a,b]`): what serving adapters
through the segment kernels (models/lora_triton.py) costs against the base model alone. Sections (default: all):

  check       tiny random Gemma 3 (fused 3-part qkv) and Gemma 4 E2B-like (KV-shared layers: rows narrowed
              mid-model) checkpoints, fp32 on CUDA: a mixed batch of two adapters and the base gives the same
              greedy tokens through the stacked slots and Triton kernels (decode steps in CUDA graphs) as
              through the grouped reference (`_lora_add` over the host layout, eager, on the same GPU)
  kernels     one projection's delta alone at gemma3-4b's shapes, bf16, decode (64 rows) and prefill (8192 rows)
              with 1, 4, 16 adapters: the segment kernels, the grouped reference and the projection itself (ms)
  throughput  random bf16 weights at real shapes (gemma3-4b, gemma4-31b; the 31B cut to its first 30 of 60
              layers on a card of under 120 GiB: 60 GB of weights and 30 GB of KV do not fit 80 GB), a batch of
              `--batch` requests (`--prompt` prompt tokens, `--new` new tokens each): the base alone (decode
              steps through CUDA graphs, and all eager), then 1, 4 and 16 random rank-16 adapters in PEFT's
              format (bench/lora.py) round robin over the batch. Each configuration: one warm-up run (kernel
              compiles, slot loads), then `--repeat` timed runs (the median), and one run of 1 new token (the
              prefill's share). Rows give tokens/s and their ratio to the base (graphs) of the same run.

Decode steps with adapter rows replay CUDA graphs of their own (cuda_graphs.py); the "base eager" row shows
what the graphs save the base. Prefix caching is off (every run repeats its prompts).

Writes $OUT/gpu_lora.json (or bench-out/) after every configuration: a timeout keeps what finished.
`--device cpu --tiny`: the throughput section's plumbing on a tiny random model on the CPU (the host layout
and its C++ op there, no Triton), for a test.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from gemmaserve.bench.lora import write_random_adapter
from gemmaserve.bench.sections import exit_status, run_sections

GiB = 1 << 30
SHAPES = ("gemma3-4b", "gemma4-31b")


def _free(device: torch.device) -> None:
    """Give what the caller deleted back to the GPU (on the CPU reference counts already did: a full collection
    there only costs time, seconds inside a test suite's heap)."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[2] + [rng.randrange(3, vocab) for _ in range(length - 1)] for _ in range(n)]


def _run(llm, prompts: list[list[int]], new_tokens: int, loras: list[str | None]) -> float:
    """Wall seconds to complete every prompt (prefill included), each with its adapter."""
    from gemmaserve.engine.sampling_params import SamplingParams

    eng = llm.engine
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True, temperature=0)
    device = torch.device(eng.info.device)
    _sync(device)
    start = time.perf_counter()
    for p, name in zip(prompts, loras):
        eng.add_request("", params, prompt_ids=p, lora=name)
    while eng.has_unfinished_requests():
        eng.step()
    _sync(device)
    return time.perf_counter() - start


# -- check -------------------------------------------------------------------------------------------------
def section_check(res: dict, save: Callable[[], None]) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from helpers import save_checkpoint, tiny_gemma4_hf, tiny_hf_model

    from gemmaserve.config.engine import EngineConfig
    from gemmaserve.engine.llm import LLM
    from gemmaserve.engine.lora import RunnerLoRA
    from gemmaserve.engine.sampling_params import SamplingParams

    rows = res["check"] = []
    params = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0)
    prompts = ["abcdefghij klmnop qrstuv " * 4, "zyxw vuts " * 3, "hello", "the cat sat on the mat " * 2, "q"]
    names = ["a", None, "b", "a", "b"]
    for variant in ("gemma3", "e2b"):
        seed = int(time.time()) % 10000
        hf = tiny_hf_model(seed) if variant == "gemma3" else tiny_gemma4_hf(seed, variant)
        tmp = Path(tempfile.mkdtemp())
        path = save_checkpoint(hf, tmp / variant)
        config = EngineConfig(model=str(path), device="cuda", dtype="float32", page_size=16, kv_cache_memory=GiB,
                              max_loras=2, max_lora_rank=8, max_num_batched_tokens=32)
        stacked = LLM.from_config(config)
        host = LLM.from_config(config, stacked)
        host_parts, stacked_parts = host.engine.internals(), stacked.engine.internals()
        runner = host_parts.runner   # the grouped reference on the GPU: a runner of the host layout, before any load
        runner.lora = RunnerLoRA(host_parts.model, runner.device, 2, 8, 2, stacked=False)
        for i, name in enumerate(("a", "b")):
            write_random_adapter(stacked_parts.model, tmp / name, rank=4 * (i + 1), seed=seed + i)
        out = {}
        for layout, llm in (("stacked", stacked), ("host", host)):
            for name in ("a", "b"):
                llm.add_lora(name, str(tmp / name))
            got = llm.generate(prompts, params, lora=names, use_tqdm=False)
            out[layout] = [o.outputs[0].token_ids for o in got]
        weights = stacked_parts.runner.lora.weights   # the path under test did run: stacked, no host slots
        assert weights.stacked and not weights.by_module, "the CUDA runner did not stack its slots"
        assert runner.lora.weights.by_module and not runner.lora.weights.stacked
        base = [o.outputs[0].token_ids for o in host.generate(prompts, params, use_tqdm=False)]
        rows.append({"variant": variant, "tokens_equal": out["stacked"] == out["host"],
                     "lora_graph_sizes": stacked_parts.runner.graphs.lora_sizes,   # decode steps replayed them
                     "adapter_changes_tokens": sum(b != s for b, s, n in zip(base, out["stacked"], names) if n)})
        print("check", rows[-1], flush=True)
        save()
        del stacked, host, runner, host_parts, stacked_parts, weights
        _free(torch.device("cuda"))


# -- kernels -----------------------------------------------------------------------------------------------
def section_kernels(res: dict, save: Callable[[], None], rank: int) -> None:
    """One projection's LoRA delta alone, bf16, at gemma3-4b's projection shapes: the segment kernels against the
    grouped reference (`_lora_add`: per adapter a gather, two cuBLAS products, a scatter-add) and against the
    projection itself (one cuBLAS product), for a decode batch (64 rows round robin over the adapters) and a
    prefill chunk (8192 rows, one segment per adapter). GPU milliseconds (triton.testing.do_bench)."""
    from triton.testing import do_bench

    from gemmaserve.models import lora_triton
    from gemmaserve.models.lora import _lora_add

    dev, dt = torch.device("cuda"), torch.bfloat16
    rows_out = res["kernels"] = []
    shapes = {"qkv": (2560, (2048, 1024, 1024)), "o": (2048, (2560,)), "gate_up": (2560, (10240, 10240)),
              "down": (10240, (2560,))}   # gemma3-4b: in, fused parts
    gen = torch.Generator(device=dev).manual_seed(0)
    for proj, (k, parts) in shapes.items():
        n_out, allot = sum(parts), rank * len(parts)
        a = torch.randn(16, allot, k, device=dev, dtype=dt, generator=gen) * k ** -0.5
        bt = torch.randn(16, allot, n_out, device=dev, dtype=dt, generator=gen) * 0.01
        w = torch.randn(n_out, k, device=dev, dtype=dt, generator=gen) * k ** -0.5
        for m in (64, 8192):
            x = torch.randn(m, k, device=dev, dtype=dt, generator=gen)
            y = torch.randn(m, n_out, device=dev, dtype=dt, generator=gen)
            for n in (1, 4, 16):
                slot_of = [i % n for i in range(m)] if m == 64 else [i * n // m for i in range(m)]
                slots = torch.tensor(slot_of, dtype=torch.int32, device=dev)
                order = lora_triton.slot_order(slots)   # once per forward in the engine, not per projection
                groups = [torch.tensor([i for i, s in enumerate(slot_of) if s == j], device=dev) for j in range(n)]
                ms_kernels = do_bench(lambda: lora_triton.lora_add(y, x, a, bt, slots, order), warmup=5, rep=30)
                ms_grouped = do_bench(lambda: _lora_add(y, x, groups, list(a[:n]), list(bt[:n])), warmup=5, rep=30)
                ms_base = do_bench(lambda: torch.nn.functional.linear(x, w), warmup=5, rep=30)
                rows_out.append({"proj": proj, "rows": m, "adapters": n, "kernels_ms": round(ms_kernels, 4),
                                 "grouped_ms": round(ms_grouped, 4), "projection_ms": round(ms_base, 4)})
                print("kernels", rows_out[-1], flush=True)
        save()


# -- throughput --------------------------------------------------------------------------------------------
def _tiny_loaded(device: torch.device):
    """A tiny random Gemma 3 (2 layers, fused 3-part qkv) for the CPU mode."""
    from gemmaserve.models.gemma3 import Gemma3Config
    from gemmaserve.models.layers import RopeParams
    from gemmaserve.testing.synthetic import random_model

    cfg = Gemma3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                       layer_types=("sliding_attention", "full_attention"), sliding_window=16,
                       query_pre_attn_scalar=16, rope_global=RopeParams(1e6), rope_local=RopeParams(1e4),
                       max_position_embeddings=4096)
    return random_model("tiny-gemma3", torch.float32, device, config=cfg)


def _shape_loaded(name: str, device: torch.device):
    """`name` at its real shape with random bf16 weights, and the layers kept (the 31B cut where it cannot fit)."""
    from gemmaserve.testing.synthetic import model_config, random_model

    layers = model_config(name).num_hidden_layers
    if name == "gemma4-31b" and torch.cuda.get_device_properties(device).total_memory < 120 * GiB:
        layers = 30
    return random_model(name, torch.bfloat16, device, config=model_config(name, layers)), layers


def section_throughput(res: dict, save: Callable[[], None], args: argparse.Namespace) -> None:
    from gemmaserve.config.engine import EngineConfig
    from gemmaserve.engine.llm import LLM
    from gemmaserve.testing.synthetic import model_config

    device = torch.device(args.device)
    counts = [int(c) for c in args.adapters.split(",") if c]
    rows = res["throughput"] = []
    shapes = ["tiny-gemma3"] if args.tiny else [s for s in args.shapes.split(",") if s]
    for name in shapes:
        if args.tiny:
            loaded, layers = _tiny_loaded(device), 2
        else:
            loaded, layers = _shape_loaded(name, device)
        model = loaded.model
        full_layers = layers if args.tiny else model_config(name).num_hidden_layers
        tokens = args.batch * (args.prompt + args.new)
        kv_bytes = int(sum(s.bytes_per_token() for s in model.kv_layer_specs(model.model.embed_tokens.dtype))
                       * tokens * 1.25) + 64 * 2**20
        # No prefix caching: every run repeats the same prompts, and a cached prefill measures nothing.
        common = dict(model=name, device=args.device, dtype="float32" if args.tiny else "bfloat16",
                      kv_cache_memory=kv_bytes, max_num_seqs=args.batch, max_num_batched_tokens=8192,
                      enable_prefix_caching=False,
                      max_loras=max(counts + [1]), max_lora_rank=args.rank, max_cpu_loras=max(counts + [1]))
        if device.type == "cpu":
            common["cpu_compile"] = "off"
        prompts = _prompts(args.batch, args.prompt, model.vocab_size, seed=1)
        base = {}

        def measure(llm, label: str, loras: list[str | None]) -> None:
            _run(llm, prompts, args.new, loras)   # warm-up: kernel compiles, adapter slot loads
            secs = statistics.median(_run(llm, prompts, args.new, loras) for _ in range(args.repeat))
            prefill = _run(llm, prompts, 1, loras)
            n = len({x for x in loras if x is not None})
            row = {"shape": name, "layers": f"{layers} of {full_layers}", "config": label, "adapters": n,
                   "rank": args.rank if n else None, "seconds": round(secs, 3), "prefill_s": round(prefill, 3),
                   "decode_s": round(secs - prefill, 3), "out_tok_s": round(args.batch * args.new / secs, 1),
                   "total_tok_s": round(tokens / secs, 1)}
            graphs = llm.engine.internals().runner.graphs
            if graphs is not None:   # which decode steps replayed graphs (LoRA steps: graphs of their own)
                row["lora_graph_sizes"] = graphs.lora_sizes
            if label == "base":   # unrounded: the base's own ratios are exactly 1
                base.update(seconds=secs, decode=secs - prefill)
            if base:
                row["ratio"] = round(base["seconds"] / secs, 3)
                row["decode_ratio"] = round(base["decode"] / max(secs - prefill, 1e-9), 3)
            rows.append(row)
            print("throughput", json.dumps(row), flush=True)
            save()

        llm = LLM.from_config(EngineConfig(**common), loaded)
        res.setdefault("engine", {})[name] = str(llm.engine.info)
        measure(llm, "base", [None] * args.batch)
        with tempfile.TemporaryDirectory(prefix="gemmaserve-lora-") as tmp:
            names = []
            for i in range(max(counts + [0])):   # written and registered once; the runs use the first n
                write_random_adapter(model, Path(tmp) / f"r{args.rank}-{i}", args.rank, seed=1000 + i)
                names.append(f"r{args.rank}-{i}")
                llm.add_lora(names[-1], str(Path(tmp) / names[-1]))
            for n in counts:
                if n:
                    measure(llm, f"{n} adapters", [names[i % n] for i in range(args.batch)])
            if device.type == "cuda":
                res.setdefault("lora_stack_MiB", {})[name] = round(llm.engine.internals().runner.lora.weights.nbytes / 2**20, 1)
        del llm
        _free(device)
        if device.type == "cuda" and args.eager_base:   # the graphs' share, apart from the kernels'
            llm = LLM.from_config(EngineConfig(**common, enforce_eager=True), loaded)
            measure(llm, "base eager", [None] * args.batch)
            del llm
            _free(device)
        del loaded, model
        _free(device)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("sections", nargs="*", default=["check", "kernels", "throughput"])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a tiny random model (with --device cpu: for tests)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens per request")
    parser.add_argument("--new", type=int, default=64, help="new tokens per request")
    parser.add_argument("--adapters", default="1,4,16", help="adapter counts (comma separated; the base always runs)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=1, help="timed runs per configuration (median)")
    parser.add_argument("--no-eager-base", dest="eager_base", action="store_false",
                        help="skip the base run without CUDA graphs")
    args = parser.parse_args(argv)
    out = Path(os.environ.get("OUT", "bench-out")) / "gpu_lora.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    res: dict = {"benchmark": "gpu_lora", "device": torch.cuda.get_device_name(device) if device.type == "cuda"
                 else "cpu", "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "batch": args.batch,
                 "prompt": args.prompt, "new": args.new, "rank": args.rank}

    def save() -> None:
        out.write_text(json.dumps(res, indent=2, default=str))

    run_sections(res, args.sections, {
        "check": lambda: section_check(res, save),
        "kernels": lambda: section_kernels(res, save, args.rank),
        "throughput": lambda: section_throughput(res, save, args),
    }, out)
    print(summary(res))
    return exit_status(res, CHECKS)


# Rows that pass or fail (bench/sections.py): the exit status is 1 if one fails or a section raised.
CHECKS = {"check": lambda r: r["tokens_equal"] and r["lora_graph_sizes"]}


def summary(res: dict) -> str:
    lines = [f"{res['device']}  batch {res['batch']} x ({res['prompt']} prompt + {res['new']} new), "
             f"rank {res['rank']}"]
    for r in res.get("check", []):
        lines.append(f"check     {r['variant']:<8} equal={r['tokens_equal']}  adapter rows that changed tokens: "
                     f"{r['adapter_changes_tokens']}")
    for r in res.get("kernels", []):
        lines.append(f"kernels   {r['proj']:<8} rows {r['rows']:5d} adapters {r['adapters']:2d}: segment kernels "
                     f"{r['kernels_ms']:.4f} ms, grouped {r['grouped_ms']:.4f} ms, "
                     f"the projection {r['projection_ms']:.4f} ms")
    for r in res.get("throughput", []):
        lines.append(f"thruput   {r['shape']:<12} ({r['layers']} layers) {r['config']:<12} {r['out_tok_s']:9.1f} "
                     f"out tok/s ratio {r.get('ratio', '-'):>6}  prefill {r['prefill_s']:6.2f} s  "
                     f"decode {r['decode_s']:6.2f} s (ratio {r.get('decode_ratio', '-')})")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
