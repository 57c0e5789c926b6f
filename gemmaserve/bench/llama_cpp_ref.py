"""llama.cpp on the same GGUF file, through `llama-cpp-python` (the optional `bench` extra): the engine
a CPU user would pick instead, measured in the same run as ours. Decode at batch B uses llama.cpp's own
multi-sequence batches (one `llama_decode` per step for all B sequences, as its batched bench does);
greedy is the argmax of its logits, so no sampler differs."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..testing.scoring import Scores, kl_from


class LlamaCppReference:
    def __init__(self, llama_cpp, path: Path, threads: int):
        self._lib = llama_cpp
        self.path, self.threads = path, threads
        self.version = f"llama-cpp-python {llama_cpp.__version__}"

    @classmethod
    def open(cls, path: Path, threads: int) -> "LlamaCppReference | None":
        """None when llama-cpp-python is not installed (the benchmark notes it and goes on)."""
        try:
            import llama_cpp
        except ImportError:
            return None
        return cls(llama_cpp, Path(path), threads)

    def _model(self, n_ctx: int, logits_all: bool = False):
        n_ctx = max(256, n_ctx)
        return self._lib.Llama(model_path=str(self.path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=min(n_ctx, 512),
                               n_threads=self.threads, n_threads_batch=self.threads, logits_all=logits_all,
                               verbose=False)

    def batch_context(self, n_ctx: int, n_seq: int) -> "_BatchContext":
        """A context for `n_seq` sequences sharing one KV cache of `n_ctx` tokens (the high-level
        `Llama` makes single-sequence contexts only)."""
        return _BatchContext(self, n_ctx, n_seq)

    def score(self, ids: list[int], reference: Scores | None = None) -> Scores:
        """Teacher-forced, as `scoring.score` (its KL from `reference`'s log-probabilities if given)."""
        llm = self._model(len(ids) + 8, logits_all=True)
        llm.eval(ids)
        logits = torch.from_numpy(np.array(llm.scores[:len(ids)], dtype=np.float32))
        target = torch.tensor(ids[1:])
        log_softmax = torch.log_softmax(logits[:-1], -1)
        lp = log_softmax.gather(1, target[:, None])[:, 0]
        two = logits[:-1].topk(2, dim=-1)
        kl = None if reference is None else kl_from(reference.full_logprobs, log_softmax)
        return Scores(lp, two.indices[:, 0], two.values[:, 0] - two.values[:, 1], kl)

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        llm = self._model(len(prompt) + n + 8)
        llm.eval(prompt)
        out = []
        for _ in range(n):   # the last row's logits (llama-cpp-python keeps `scores` only with logits_all)
            logits = np.ctypeslib.as_array(self._lib.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))
            out.append(int(np.argmax(logits)))
            llm.eval([out[-1]])
        return out

    def prefill_tok_s(self, prompt: list[int], repeats: int) -> float:
        llm = self._model(len(prompt) + 8)
        times = []
        for _ in range(repeats + 1):
            llm.reset()
            self._clear(llm)
            start = time.perf_counter()
            llm.eval(prompt)
            times.append(time.perf_counter() - start)
        return len(prompt) / float(np.median(times[1:]))

    def _clear(self, llm) -> None:
        self._lib.llama_memory_clear(self._lib.llama_get_memory(llm.ctx), True)

    def decode_tok_s(self, prompt: list[int], batch: int, new_tokens: int, ctx: "_BatchContext") -> float:
        """Tokens/s after the first token, `batch` greedy sequences of the same prompt decoded together."""
        timing = ctx.generate([prompt] * batch, new_tokens)
        return batch * (new_tokens - 1) / timing.decode_seconds

    def generate_batched(self, prompts: list[list[int]], new_tokens: int, batch: int) -> dict:
        """Every prompt completed greedily to `new_tokens`, `batch` at a time (static batches: each
        wave's prompts in one prefill call, then one decode call per step for the wave)."""
        start = time.perf_counter()
        for i in range(0, len(prompts), batch):
            wave = prompts[i:i + batch]
            ctx = self.batch_context(sum(len(p) for p in wave) + len(wave) * new_tokens + 16, len(wave))
            ctx.generate(wave, new_tokens)
        wall = time.perf_counter() - start
        tokens = len(prompts) * new_tokens
        return {"seconds": round(wall, 2), "output_tokens": tokens, "tok_s": round(tokens / wall, 2), "batch": batch}


@dataclass(frozen=True)
class _Timing:
    prefill_seconds: float
    decode_seconds: float


class _BatchContext:
    def __init__(self, ref: LlamaCppReference, n_ctx: int, n_seq: int):
        lib = ref._lib
        self._lib = lib
        self._owner = ref._model(256)            # holds the loaded model
        params = lib.llama_context_default_params()
        params.n_ctx = params.n_batch = max(256, n_ctx)
        params.n_ubatch = min(params.n_batch, 512)
        params.n_threads = params.n_threads_batch = ref.threads
        params.n_seq_max = n_seq
        params.kv_unified = True
        self.ptr = lib.llama_init_from_model(self._owner.model, params)
        if not self.ptr:
            raise RuntimeError("llama.cpp could not create a batched context")
        self.vocab = self._owner.n_vocab()

    def generate(self, prompts: list[list[int]], new_tokens: int) -> _Timing:
        """Greedy: all prompts in one prefill call (logits at each last token), then one call per step."""
        lib = self._lib
        lib.llama_memory_clear(lib.llama_get_memory(self.ptr), True)
        b = lib.llama_batch_init(max(sum(map(len, prompts)), len(prompts)), 0, len(prompts))
        try:
            def run(rows: list[tuple[int, int, int, bool]]) -> None:   # (token, pos, seq, wants logits)
                b.n_tokens = len(rows)
                for i, (tok, pos, seq, want) in enumerate(rows):
                    b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, want
                    b.seq_id[i][0] = seq
                if lib.llama_decode(self.ptr, b) != 0:
                    raise RuntimeError("llama_decode failed")

            def argmax(i: int) -> int:
                logits = np.ctypeslib.as_array(lib.llama_get_logits_ith(self.ptr, i), shape=(self.vocab,))
                return int(np.argmax(logits))

            start = time.perf_counter()
            rows = [(t, j, s, j == len(p) - 1) for s, p in enumerate(prompts) for j, t in enumerate(p)]
            run(rows)
            last = [i for i, r in enumerate(rows) if r[3]]
            toks = [argmax(i) for i in last]
            mid = time.perf_counter()
            for step in range(new_tokens - 1):
                run([(toks[s], len(p) + step, s, True) for s, p in enumerate(prompts)])
                toks = [argmax(s) for s in range(len(prompts))]
            return _Timing(mid - start, time.perf_counter() - mid)
        finally:
            lib.llama_batch_free(b)

    def __del__(self):
        if getattr(self, "ptr", None):
            self._lib.llama_free(self.ptr)
            self.ptr = None
