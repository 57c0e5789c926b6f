"""Speculative decoding on CUDA, correctness only (`python -m benchmarks.gpu_spec_check`): random
bf16 weights at the Gemma 3 1B shape (Triton attention; CUDA graphs and asynchronous scheduling on, then each
off) give the same greedy and seeded tokens with prompt-lookup drafts as without; then tiny random checkpoints
(written by transformers, as `bench spec-drafters` does) with a draft model and with a Gemma 4 MTP drafter,
the same. Exit 1 on any difference. Writes $OUT/gpu_spec_check.json."""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

import torch

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
         "disable_by_batch_size": 64}


def _generate(llm, prompts: list[list[int]], params) -> list[list[int]]:
    engine = llm.engine
    ids = [engine.add_request("", params, prompt_ids=p) for p in prompts]
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[i] for i in ids]


def _drafters(prompts: list[list[int]]) -> list[dict]:
    """draft_model and mtp on tiny checkpoints (bench/spec_drafters.py), CUDA graphs and async on."""
    import tempfile

    from gemmaserve.bench.spec_drafters import VOCAB, _checkpoints
    from gemmaserve.engine.llm import LLM
    from gemmaserve.engine.sampling_params import SamplingParams

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            paths = _checkpoints(Path(tmp))
        except (ImportError, AttributeError, ValueError) as exc:   # a transformers without Gemma 4 drafters
            print(f"drafter checks skipped: {exc}", flush=True)
            return [{"method": "draft_model/mtp", "same_tokens": True, "skipped": str(exc)}]
        tiny = [[t % VOCAB for t in p] for p in prompts]
        cases = [("gemma3", "draft_model", paths["gemma3_draft"], "bfloat16", False),
                 ("gemma3", "draft_model", paths["gemma3"], "bfloat16", False)]
        # Random Gemma 4 weights in bf16 turn a change of rounding order (a verification step's k + 1 rows
        # against a one-row graph) into other tokens: equal tokens need fp32 or --batch-invariant there.
        cases += [("gemma4", "mtp", paths["mtp"], dtype, inv) for dtype, inv in
                  (("bfloat16", False), ("float32", False), ("bfloat16", True))]
        for target, method, drafter, dtype, invariant in cases:
            base = LLM(model=paths[target], device="cuda", dtype=dtype, kv_cache_memory=1 << 30,
                       batch_invariant=invariant)
            spec = LLM.from_config(base.engine.config.replace(speculative_config={
                "method": method, "model": drafter, "num_speculative_tokens": 4, "disable_by_batch_size": 64}), base)
            params = SamplingParams(max_tokens=32, ignore_eos=True)
            want, got = _generate(base, tiny, params), _generate(spec, tiny, params)
            st = spec.engine.snapshot().spec
            row = {"target": target, "method": method, "dtype": dtype, "batch_invariant": invariant,
                   "self_draft": drafter == paths[target],
                   "same_tokens": got == want, "drafted": st.drafted, "accepted": st.accepted,
                   "cuda_graphs": spec.engine.info.cuda_graphs, "async": spec.engine.info.async_scheduling}
            print(row, flush=True)
            if dtype == "bfloat16" and target == "gemma4" and not invariant:
                row["same_tokens_expected"] = False   # reported, not a failure (see above)
            rows.append(row)
    return rows


def main(argv: list[str]) -> int:
    from gemmaserve.config.engine import EngineConfig
    from gemmaserve.engine.llm import LLM
    from gemmaserve.engine.sampling_params import SamplingParams
    from gemmaserve.testing.synthetic import random_model

    out = Path(os.environ.get("OUT", "bench-out")) / "gpu_spec_check.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    loaded = random_model("gemma3-1b", torch.bfloat16, torch.device("cuda"))
    rng = random.Random(0)
    vocab = loaded.model.config.vocab_size
    motifs = [[rng.randrange(3, vocab) for _ in range(n)] for n in (5, 9, 3, 17)]
    prompts = [[2] + m * (60 // len(m)) for m in motifs]   # repetitive: lookups find matches
    rows, ok = [], True
    for opts in ({}, {"enforce_eager": True}, {"async_scheduling": "off"}):
        config = EngineConfig(model="gemma3-1b", device="cuda", dtype="bfloat16", kv_cache_memory=2 << 30,
                              max_num_seqs=16, **opts)
        base = LLM.from_config(config, loaded)
        spec = LLM.from_config(config.replace(speculative_config=NGRAM), loaded)
        for params in (SamplingParams(max_tokens=48, ignore_eos=True),
                       SamplingParams(max_tokens=48, temperature=0.9, seed=4, top_p=0.9, ignore_eos=True)):
            want = _generate(base, prompts, params)
            got = _generate(spec, prompts, params)
            st = spec.engine.snapshot().spec
            row = {**opts, "greedy": params.greedy, "same_tokens": got == want, "drafted": st.drafted,
                   "accepted": st.accepted, "cuda_graphs": spec.engine.info.cuda_graphs,
                   "async": spec.engine.info.async_scheduling}
            ok &= row["same_tokens"]
            rows.append(row)
            print(row, flush=True)
        del base, spec
        torch.cuda.empty_cache()
    rows += _drafters(prompts)
    ok &= all(r["same_tokens"] or r.get("same_tokens_expected") is False for r in rows)
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows,
                               "ok": ok}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
