"""`gemmaserve bench lora`: what serving LoRA adapters costs against the base model alone, in one run.

One batch of `--batch` requests (default 16) decodes `--tokens` tokens each on the model (default: the embedded
270M on its default CPU path) with 0 adapters (the base alone, the reference), then with 1, 4 and 16 adapters of
rank 8 and 64 spread round robin over the batch (every request with an adapter; --max-loras 16). Adapters are
random, in PEFT's format (adapter_config.json and adapter_model.safetensors over every attention and MLP
projection), written to a temporary directory. Each configuration is timed `--repeat` times after a warm-up,
its runs alternating with runs of the base alone (the median of each kept); a row reports its tokens/s, the
base's beside it and their ratio. Writes $OUT/lora.json (or bench-out/).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

HF_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def write_random_adapter(model, path: Path, rank: int, seed: int) -> None:
    """A PEFT LoRA adapter over every projection of `model`'s text layers (B small, so outputs stay sane)."""
    from safetensors.torch import save_file

    from ..models.lora import projections

    gen = torch.Generator().manual_seed(seed)
    tensors, targets = {}, set()
    for proj in projections(model).values():
        leaf = proj.path.rsplit(".", 1)[1]
        names = HF_PARTS.get(leaf, (leaf,))
        block = proj.path.rsplit(".", 2)[1]
        for name, rows in zip(names, proj.parts):
            key = f"base_model.model.model.layers.{proj.layer}.{block}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, proj.in_features, generator=gen) / proj.in_features ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(rows, rank, generator=gen) * 0.01
            targets.add(name)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / "adapter_model.safetensors")
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": sorted(targets), "bias": "none"}))


def _run(llm, prompts: list[str], params, loras: list[list[str | None]], repeat: int) -> list[tuple[float, int]]:
    """(median seconds, tokens) of each configuration in `loras`, their runs alternating (base, adapters, base,
    ...), so that a machine whose speed drifts (a shared VM) moves both alike."""
    for lora in loras:
        llm.generate(prompts, params, lora=lora, use_tqdm=False)   # warm-up (and the adapters' slot loads)
    times: list[list[float]] = [[] for _ in loras]
    tokens = [0] * len(loras)
    for _ in range(repeat):
        for i, lora in enumerate(loras):
            start = time.perf_counter()
            outs = llm.generate(prompts, params, lora=lora, use_tqdm=False)
            times[i].append(time.perf_counter() - start)
            tokens[i] = sum(len(o.outputs[0].token_ids) for o in outs)
    return [(statistics.median(t), n) for t, n in zip(times, tokens)]


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--batch", type=int, default=16, help="requests in the batch")
    ap.add_argument("--tokens", type=int, default=32, help="tokens each request decodes")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs of each configuration (median)")
    ap.add_argument("--adapters", default="1,4,16", help="adapter counts to run (comma separated)")
    ap.add_argument("--ranks", default="8,64", help="adapter ranks to run (comma separated)")


def run(args: argparse.Namespace) -> int:
    from ..config.engine import EngineConfig
    from ..config.options import from_namespace
    from ..engine.llm import LLM
    from ..engine.sampling_params import SamplingParams

    counts = [int(x) for x in args.adapters.split(",")]
    ranks = [int(x) for x in args.ranks.split(",")]
    # compiled decode steps built (or loaded) before any timed run: a background build would compete with them
    config = from_namespace(EngineConfig, args).steady_state()
    config = config.replace(max_loras=max(max(counts), config.max_loras), max_lora_rank=max(max(ranks), 8),
                            max_num_seqs=max(config.max_num_seqs, args.batch))
    llm = LLM.from_config(config)
    prompts = [f"Request {i}: write a short story about the number {i} and the sea." for i in range(args.batch)]
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True, temperature=0)
    base = [None] * args.batch
    rows = []
    with tempfile.TemporaryDirectory(prefix="gemmaserve-lora-") as tmp:
        for rank in ranks:
            for n in counts:
                names = []
                for i in range(n):
                    name = f"r{rank}-{i}"
                    write_random_adapter(llm.engine.internals().model, Path(tmp) / name, rank, seed=1000 * rank + i)
                    llm.add_lora(name, str(Path(tmp) / name))
                    names.append(name)
                (base_s, base_tokens), (s, tokens) = _run(
                    llm, prompts, params, [base, [names[i % n] for i in range(args.batch)]], args.repeat)
                row = {"adapters": n, "rank": rank, "seconds": round(s, 3), "tok_s": round(tokens / s, 1),
                       "base_seconds": round(base_s, 3), "base_tok_s": round(base_tokens / base_s, 1),
                       "ratio": round((tokens / s) / (base_tokens / base_s), 3)}
                rows.append(row)
                print(json.dumps(row), flush=True)
                for name in names:
                    llm.remove_lora(name)
    out = Path(os.environ.get("OUT", "bench-out")) / "lora.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "lora", "date": time.strftime("%Y-%m-%d"),
                               "machine": platform.processor() or platform.machine(), "model": config.model,
                               "engine": str(llm.engine.info), "batch": args.batch, "tokens": args.tokens,
                               "threads": torch.get_num_threads(), "rows": rows}, indent=1))
    return 0
