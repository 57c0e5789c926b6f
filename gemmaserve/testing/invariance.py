"""Batch-invariance checks (`--batch-invariant`): one probe prompt's logits at every step it samples, run
alone, twice in one batch (the copies hit the prefix cache the first run left), and inside a mixed batch
whose other prompts change how its prompt is chunked and what shares its decode steps. Used by the tests
(CPU, Triton interpreter), `gpu_check` and `gpu_bench invariant` (CUDA).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def record_logits(engine) -> dict[str, list[torch.Tensor]]:
    """From now on, every logits row the engine's runner produces, by request id (copied at once: a
    CUDA graph's output buffer is overwritten by the next replay)."""
    runner = engine.internals().runner
    if hasattr(runner, "recorded_logits"):   # already recording
        return runner.recorded_logits
    seen: dict[str, list[torch.Tensor]] = {}
    runner.recorded_logits = seen
    run_model = runner.run_model

    def recording(seqs, *args, **kwargs):
        out = run_model(seqs, *args, **kwargs)
        if out[0] is not None:
            for row, s in enumerate([s for s in seqs if s.sample]):
                seen.setdefault(s.req_id, []).append(out[0][row].clone())
        return out

    runner.run_model = recording
    return seen


def run_recorded(engine, seen: dict[str, list[torch.Tensor]], prompts: Sequence[list[int]], max_tokens: int,
                 tag: str) -> list[list[torch.Tensor]]:
    """Greedy completions of `prompts` (token ids), all queued at once; each prompt's logits per step."""
    from ..engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    ids = [engine.add_request("", params, prompt_ids=list(p), request_id=f"{tag}{i}") for i, p in enumerate(prompts)]
    while engine.has_unfinished_requests():
        engine.step()
    return [seen.pop(i) for i in ids]


def same_bits(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Bitwise equal step by step (NaNs and the sign of zero included)."""
    def bits(t: torch.Tensor) -> torch.Tensor:
        return t.contiguous().view(-1).view(torch.uint8)

    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(bits(x), bits(y)) for x, y in zip(a, b))


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(((x.float() - y.float()).abs().max().item() for x, y in zip(a, b)), default=0.0)


def probe_checks(engine, probe: list[int], others: Sequence[list[int]], max_tokens: int,
                 duplicate: bool = True) -> dict:
    """The probe alone (cold prefix cache), twice in one batch (warm cache; `duplicate`), then with the
    cache reset among `others` (placed first and after it). Returns which runs gave the alone run's bits."""
    seen = record_logits(engine)
    alone = run_recorded(engine, seen, [probe], max_tokens, "alone")[0]
    dup = run_recorded(engine, seen, [probe, probe], max_tokens, "dup") if duplicate else []
    engine.reset_prefix_cache()
    mixed = run_recorded(engine, seen, [others[0], probe, *others[1:]], max_tokens, "mixed")[1]
    return {"steps": len(alone), "duplicate_equal": all(same_bits(alone, d) for d in dup),
            "mixed_equal": same_bits(alone, mixed), "mixed_max_abs_diff": max_diff(alone, mixed),
            "alone": alone}
