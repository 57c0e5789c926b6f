"""Gemma 4 on the GPU (`python -m benchmarks.gpu_gemma4 [sections] [--shapes a,b]`): random bf16
weights at the real shapes (E2B, E4B, 12B, 26B-A4B, 31B; testing/synthetic.py). Sections (default: all):

  check       tiny random Gemma 4 variants through the engine on CUDA: fp32 greedy tokens of the Triton
              backend (graphs and eager) equal the torch reference; bf16 graphs equal bf16 eager (MoE
              through grouped matmuls), and bf16 Triton logits near the torch backend's
  roofline    batch-1 decode step (graph replay and whole engine step) against the roofline: bytes read
              per step (weights a token touches: the active experts only for MoE, no per-layer-embedding
              table rows beyond one; KV of the context) over the HBM copy bandwidth measured in the run
  throughput  batch 64 (prompt 1024, 128 new tokens) against Hugging Face `generate` on the same weights
  pressure    seed 004's experiment: KV capped, long prompts; V1, V2, V2 + scratch, and V2 with the pool
              split at a pinned sliding:global ratio (the recipe's expected input length 8K, and a mis-guessed
              2K), scratch off and on; `--repeats N` times each (median)
  profile     (not in the default set) a batch-1 decode graph's kernels under torch's profiler: time per step by
              kernel name, launches per step, and the gaps between kernels

Writes $OUT/gpu_gemma4.json after every section (a timeout keeps what finished); a table last.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
from pathlib import Path

import torch

from benchmarks.gpu_bench import GiB, _engine, _prompts, _run_all, batch1_decode
from gemmaserve.bench.gpu_check import copy_bandwidth
from gemmaserve.bench.sections import exit_status, run_sections
from gemmaserve.testing.synthetic import GEMMA4_CONFIGS, random_model

SHAPES = tuple(GEMMA4_CONFIGS)


def _free() -> None:
    """Give the memory of what the caller just deleted back to the GPU (the caller must `del` its
    own names first: a model still named by a loop variable stays allocated)."""
    gc.collect()
    torch.cuda.empty_cache()


def decode_weight_bytes(model) -> int:
    """Weight bytes one decode token reads: every parameter once (the tied embedding as the output
    head), except the per-layer-embedding table (one row per token) and, for MoE, the experts a token
    is not routed to."""
    total = 0
    for name, p in model.named_parameters():
        nbytes = p.numel() * p.element_size()
        if name.endswith("embed_tokens_per_layer.weight"):
            nbytes = p.shape[1] * p.element_size()
        elif ".experts." in name:
            cfg = model.config
            nbytes = nbytes * cfg.top_k_experts // cfg.num_experts
        total += nbytes
    return total


# -- check -------------------------------------------------------------------------------------------
def section_check(res: dict, variants=("31b", "26b_a4b", "e2b", "12b_unified")) -> None:
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from helpers import save_checkpoint, tiny_gemma4_hf

    from gemmaserve.config.engine import EngineConfig
    from gemmaserve.engine.llm import LLM
    from gemmaserve.engine.sampling_params import SamplingParams
    from gemmaserve.models.moe import Experts

    rows = res["check"] = []   # filled as it goes: an error keeps what finished
    prompts = ["abcdefghij klmnop qrstuv " * 6, "zyxw vuts " * 3, "hello"]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    for variant in variants:
        path = save_checkpoint(tiny_gemma4_hf(int(time.time()) % 10000, variant, hidden_size=256, head_dim=128,
                                              global_head_dim=256), Path(tempfile.mkdtemp()) / variant)
        common = dict(model=str(path), device="cuda", page_size=16, kv_cache_memory=1 << 30)
        base = LLM(**common, dtype="float32", attention_backend="torch", kv_cache_manager="v1")
        fused, Experts.fused_decode = Experts.fused_decode, False   # the reference: MoE through the grouped path
        try:
            ref = [o.outputs[0].token_ids for o in base.generate(prompts, params, use_tqdm=False)]
        finally:
            Experts.fused_decode = fused
        for name, opts in (("triton graphs v2+scratch", {}), ("triton eager", dict(enforce_eager=True)),
                           ("triton graphs chunk 16", dict(max_num_batched_tokens=16))):
            llm = LLM.from_config(EngineConfig(**common, dtype="float32", attention_backend="triton", **opts), base)
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            rows.append({"variant": variant, "engine": f"fp32 {name}", "tokens_equal": got == ref,
                         "cuda_graphs": llm.engine.info.cuda_graphs})
            del llm
            _free()
        if any(isinstance(m, Experts) for m in base.engine.internals().runner.model.modules()):
            rows += _check_moe_decode(variant, common, base, prompts, params, ref)
        bf = {}
        for name, opts in (("graphs", {}), ("eager", dict(enforce_eager=True)), ("eager again", dict(enforce_eager=True))):
            llm = LLM(**common, dtype="bfloat16", attention_backend="triton", **opts)
            bf[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            if name == "eager":
                bf["logit_rel_err"] = _bf16_backend_gap(llm, common)
            del llm
            _free()
        rows.append({"variant": variant, "engine": "bf16 graphs vs eager", "tokens_equal": bf["graphs"] == bf["eager"],
                     "triton_vs_torch_logit_rel_err": bf["logit_rel_err"]})
        # bf16 MoE sums each token's experts with atomics (index_add_): is eager equal to itself?
        rows.append({"variant": variant, "engine": "bf16 eager vs eager", "tokens_equal": bf["eager"] == bf["eager again"]})
        del base
        _free()
        for r in rows[-4:]:
            print("check", r, flush=True)


def _check_moe_decode(variant: str, common: dict, base, prompts, params, ref) -> list[dict]:
    """moe_kernels.py's decode path (`Experts.fused_decode`): fp32 greedy tokens equal the grouped path's (`ref`),
    and in bf16 its graphs equal its eager steps."""
    from gemmaserve.config.engine import EngineConfig
    from gemmaserve.engine.llm import LLM
    from gemmaserve.models.moe import Experts

    rows, before = [], Experts.fused_decode
    Experts.fused_decode = True
    try:
        llm = LLM.from_config(EngineConfig(**common, dtype="float32", attention_backend="triton"), base)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        rows.append({"variant": variant, "engine": "fp32 MoE decode kernels vs grouped", "tokens_equal": got == ref})
        del llm
        _free()
        bf = {}
        for name, opts in (("graphs", {}), ("eager", dict(enforce_eager=True))):
            llm = LLM(**common, dtype="bfloat16", attention_backend="triton", **opts)
            bf[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            del llm
            _free()
        rows.append({"variant": variant, "engine": "bf16 MoE decode kernels, graphs vs eager",
                     "tokens_equal": bf["graphs"] == bf["eager"]})
    finally:
        Experts.fused_decode = before
    for r in rows:
        print("check", r, flush=True)
    return rows


def _bf16_backend_gap(llm, common) -> float:
    """Relative difference of the first-step logits, bf16: Triton kernels against the torch backend."""
    from gemmaserve.config.engine import EngineConfig
    from gemmaserve.engine.llm import LLM

    ids = _prompts(1, 200, 280, seed=9)[0]
    out = {}
    for backend in ("triton", "torch"):
        other = llm if backend == "triton" else LLM.from_config(
            EngineConfig(**common, dtype="bfloat16", attention_backend="torch"), llm)
        eng = other.engine
        from gemmaserve.engine.sampling_params import SamplingParams

        rid = eng.add_request("", SamplingParams(max_tokens=1), prompt_ids=ids)
        parts = eng.internals()
        plan = parts.scheduler.schedule()
        parts.runner.apply(plan)
        out[backend] = parts.runner.forward(plan.seqs).float()
        eng.abort_request(rid)
    return round(((out["triton"] - out["torch"]).norm() / out["torch"].norm()).item(), 5)


# -- roofline ------------------------------------------------------------------------------------------
def section_roofline(res: dict, hbm: float, shapes) -> None:
    rows = res["roofline"] = []
    for name in shapes:
        loaded = random_model(name, torch.bfloat16, torch.device("cuda"))
        llm = _engine(loaded, kv_cache_memory=8 * GiB, max_num_seqs=1)
        step_ms, graph_ms, kv_bytes = batch1_decode(llm, loaded.model)
        weights = decode_weight_bytes(loaded.model)
        roof_ms = (weights + kv_bytes) / (hbm * 1e9) * 1e3
        rows.append({"shape": name, "weight_read_GB": round(weights / 1e9, 2), "kv_read_MB": round(kv_bytes / 1e6, 1),
                     "roofline_ms": round(roof_ms, 3), "graph_ms": round(graph_ms, 3),
                     "engine_step_ms": round(step_ms, 3), "graph_over_roofline": round(graph_ms / roof_ms, 2),
                     "step_over_roofline": round(step_ms / roof_ms, 2)})
        print("roofline", rows[-1], flush=True)
        del llm, loaded
        _free()



def section_profile(res: dict, shapes, hbm: float, replays: int = 20) -> None:
    """Where a batch-1 decode step's GPU time goes: the captured graph replayed under torch's profiler, kernel
    time summed by kernel name per step (the top 30 and the rest), their sum against the replay's own time (the
    difference: gaps between kernels), and the graph against the roofline. A shape with experts runs twice on the
    same weights: moe_kernels.py's decode path, then the grouped one (`Experts.fused_decode` off)."""
    from gemmaserve.models.moe import Experts

    rows = res["profile"] = []
    for name in shapes:
        loaded = random_model(name, torch.bfloat16, torch.device("cuda"))
        has_experts = any(isinstance(m, Experts) for m in loaded.model.modules())
        for fused in (True, False) if has_experts else (True,):
            before, Experts.fused_decode = Experts.fused_decode, fused
            try:
                row = _profile_row(loaded, name, hbm, replays)
            finally:
                Experts.fused_decode = before
            row["experts"] = ("fused decode" if fused else "grouped") if has_experts else None
            rows.append(row)
            print("profile", {k: v for k, v in row.items() if k != "top"}, flush=True)
            for t in row["top"]:
                print(f"  {t['us']:9.1f} us {t['per_step']:6.1f}x  {t['kernel']}", flush=True)
            _free()
        del loaded
        _free()


def _profile_row(loaded, name: str, hbm: float, replays: int) -> dict:
    """One engine over `loaded`: its batch-1 decode graph under the profiler (the engine is garbage on return)."""
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.gpu_bench import replay_ms

    llm = _engine(loaded, kv_cache_memory=8 * GiB, max_num_seqs=1)
    _, _, kv_bytes = batch1_decode(llm, loaded.model, steps=20)
    graph = llm.engine.internals().runner.graphs.graph(1)
    graph_ms = replay_ms(graph, 50)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    by_name: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            by_name.setdefault(ev.name, []).append(ev.device_time_total)
    kernels = sorted(((sum(v) / replays, len(v) / replays, k) for k, v in by_name.items()), reverse=True)
    total_us = sum(us for us, _, _ in kernels)
    roof_ms = (decode_weight_bytes(loaded.model) + kv_bytes) / (hbm * 1e9) * 1e3
    return {"shape": name, "roofline_ms": round(roof_ms, 3), "graph_ms": round(graph_ms, 3),
            "graph_over_roofline": round(graph_ms / roof_ms, 2), "kernel_us_per_step": round(total_us, 1),
            "launches_per_step": round(sum(n for _, n, _ in kernels)),
            "gap_us_per_step": round(graph_ms * 1e3 - total_us, 1),
            "top": [{"us": round(us, 1), "per_step": round(n, 1), "kernel": k[:160]} for us, n, k in kernels[:30]],
            "rest_us": round(sum(us for us, _, _ in kernels[30:]), 1)}


# -- throughput -----------------------------------------------------------------------------------------
def section_throughput(res: dict, shapes, batch: int = 64) -> None:
    from gemmaserve.testing.hf_reference import build_hf_model

    rows = res["throughput"] = []
    for name in shapes:
        loaded = random_model(name, torch.bfloat16, torch.device("cuda"))
        vocab = loaded.model.vocab_size
        llm = _engine(loaded, kv_cache_memory=32 * GiB, max_num_seqs=batch)
        _run_all(llm, _prompts(batch, 1024, vocab, seed=batch + 1), 8)   # compile at the measured shapes
        secs = _run_all(llm, _prompts(batch, 1024, vocab, seed=batch), 128)
        row = {"shape": name, "batch": batch, "ours_tok_s": round(batch * 128 / secs, 1), "ours_s": round(secs, 2)}
        del llm
        _free()
        hf = build_hf_model(loaded.model, dtype=torch.bfloat16, device="cuda", share=True)
        ids = torch.tensor(_prompts(batch, 1024, vocab, seed=batch), device="cuda")
        with torch.no_grad():
            hf.generate(ids[:2, :64], max_new_tokens=4, do_sample=False, pad_token_id=0)   # warm-up
            torch.cuda.synchronize()
            start = time.perf_counter()
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=128, min_new_tokens=128,
                        do_sample=False, pad_token_id=0)
            torch.cuda.synchronize()
        hf_secs = time.perf_counter() - start
        row.update(hf_tok_s=round(batch * 128 / hf_secs, 1), hf_s=round(hf_secs, 2),
                   ratio=round(secs and hf_secs / secs, 2))
        rows.append(row)
        print("throughput", row, flush=True)
        del hf, ids, loaded
        _free()



# -- pressure (seed 004) ---------------------------------------------------------------------------------
PRESSURE_RUNS = (
    ("v1", dict(kv_cache_manager="v1")),
    ("v2", dict(kv_cache_manager="v2", swa_scratch_reuse="off")),
    ("v2+scratch", dict(kv_cache_manager="v2", swa_scratch_reuse="on")),
    ("pinned 8K", dict(kv_cache_manager="v2", swa_scratch_reuse="off", pin=8192)),
    ("pinned 8K+scratch", dict(kv_cache_manager="v2", swa_scratch_reuse="on", pin=8192)),
    ("pinned 2K+scratch", dict(kv_cache_manager="v2", swa_scratch_reuse="on", pin=2048)),
)


def pressure_budget(specs, tokens: int, seqs: int) -> int:
    """KV bytes for `seqs` sequences of `tokens` at the theoretical minimum (full layers every token,
    sliding layers their window): V2 fits about that many, V1 far fewer."""
    per_seq = sum(s.bytes_per_token() * (min(tokens, s.window) if s.window else tokens) for s in specs)
    return per_seq * seqs


def section_pressure(res: dict, shapes, num_prompts: int = 8, new_tokens: int = 32, repeats: int = 1) -> None:
    from gemmaserve.engine.sampling_params import SamplingParams
    from gemmaserve.errors import UserInputError
    from gemmaserve.kv.pinned_split import pinned_pool_split

    out = res["pressure"] = {}
    for name in shapes:
        loaded = random_model(name, torch.bfloat16, torch.device("cuda"))
        vocab = loaded.model.vocab_size
        rng = random.Random(4)
        prompts = [_prompts(1, rng.randrange(8192, 16384), vocab, seed=100 + i)[0] for i in range(num_prompts)]
        specs = loaded.model.kv_layer_specs(torch.bfloat16)
        budget = pressure_budget(specs, 16384, 3)
        rows = []
        for run, opts in PRESSURE_RUNS:
            opts = dict(opts)
            pin = opts.pop("pin", None)
            if pin is not None:
                opts["kv_pool_split"] = round(pinned_pool_split(specs, 16, pin), 4)
            llm = _engine(loaded, kv_cache_memory=budget, enable_prefix_caching=False, max_num_batched_tokens=8192,
                          max_num_seqs=16, **opts)
            row = {"kv": run, "pool_split": opts.get("kv_pool_split")}
            try:
                for p in prompts:   # V1 at a cap sized for V2 may not hold even one prompt: say so
                    llm.engine.validate(p, SamplingParams(max_tokens=new_tokens))
            except UserInputError as exc:
                rows.append({**row, "rejected": str(exc)})
                print("pressure", name, rows[-1], flush=True)
                del llm
                _free()
                continue
            _run_all(llm, _prompts(1, 512, vocab, seed=3), 4)   # warm-up
            pre = llm.engine.snapshot().preemptions
            runs = sorted(_run_all(llm, prompts, new_tokens) for _ in range(repeats))
            secs = runs[len(runs) // 2]   # the median run; all of them in "runs_s"
            rows.append({**row, "seconds": round(secs, 2), "out_tok_s": round(num_prompts * new_tokens / secs, 1),
                         "total_tok_s": round((sum(map(len, prompts)) + num_prompts * new_tokens) / secs),
                         "preemptions": (llm.engine.snapshot().preemptions - pre) // repeats,
                         "runs_s": [round(r, 3) for r in runs]})
            print("pressure", name, rows[-1], flush=True)
            del llm
            _free()
        best_pinned = max(r.get("total_tok_s", 0) for r in rows if r["kv"].startswith("pinned"))
        ours = next(r["total_tok_s"] for r in rows if r["kv"] == "v2+scratch")
        out[name] = {"kv_cache_bytes": budget, "prompts": num_prompts, "prompt_tokens": sum(map(len, prompts)),
                     "new_tokens": new_tokens, "rows": rows, "ours_over_best_pinned": round(ours / best_pinned, 3)}
        del loaded
        _free()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("sections", nargs="*", default=["check", "roofline", "throughput", "pressure"])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--variants", default="31b,26b_a4b,e2b,12b_unified", help="tiny variants the check runs")
    parser.add_argument("--repeats", type=int, default=1, help="pressure: timed runs per configuration (median)")
    args = parser.parse_args(argv)
    shapes = [s for s in args.shapes.split(",") if s]
    out = Path(os.environ.get("OUT", "bench-out")) / "gpu_gemma4.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    hbm = copy_bandwidth()
    res["hbm_copy_GB_s"] = round(hbm)
    run_sections(res, args.sections, {
        "check": lambda: section_check(res, [v for v in args.variants.split(",") if v]),
        "roofline": lambda: section_roofline(res, hbm, shapes),
        "throughput": lambda: section_throughput(res, shapes),
        "pressure": lambda: section_pressure(res, shapes, repeats=args.repeats),
        "profile": lambda: section_profile(res, shapes, hbm),
    }, out)
    print(json.dumps(res, indent=1))
    print(summary(res))
    return exit_status(res, CHECKS)


# Rows that pass or fail (bench/sections.py): the exit status is 1 if one fails or a section raised.
CHECKS = {"check": lambda r: r["tokens_equal"]}


def summary(res: dict) -> str:
    """The figures as a short table (the JSON has everything)."""
    lines = [f"{res['device']}  HBM copy {res['hbm_copy_GB_s']} GB/s"]
    for r in res.get("check", []):
        lines.append(f"check     {r['variant']:<12} {r['engine']:<26} equal={r['tokens_equal']}")
    for r in res.get("roofline", []):
        lines.append(f"roofline  {r['shape']:<15} roof {r['roofline_ms']:7.3f} ms  graph {r['graph_ms']:7.3f} "
                     f"({r['graph_over_roofline']}x)  step {r['engine_step_ms']:7.3f} ({r['step_over_roofline']}x)")
    for r in res.get("throughput", []):
        lines.append(f"thruput   {r['shape']:<15} ours {r['ours_tok_s']:8.1f}  HF {r.get('hf_tok_s', '-'):>8}  "
                     f"{r.get('ratio', '-')}x")
    for shape, p in res.get("pressure", {}).items():
        for r in p["rows"]:
            got = r.get("rejected", f"{r.get('total_tok_s')} tok/s, {r.get('preemptions')} preemptions")
            lines.append(f"pressure  {shape:<15} {r['kv']:<18} {got[:90]}")
        lines.append(f"pressure  {shape:<15} v2+scratch / best pinned = {p['ours_over_best_pinned']}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
