"""Next-token choice from logits, on the device.

    raw logits -> log-probabilities reported to the user (logprobs)
               -> grammar masks (structured output: disallowed tokens -inf)
               -> penalties (repetition: HF semantics; presence / frequency: OpenAI semantics)
               -> greedy argmax, or temperature -> top-k -> top-p -> min-p -> draw

The runner keeps a `SamplingState` per request (its parameters, its seeded generator, token counts
for penalties, all on the device) from its first step until it finishes. Filtering is batched; the
draw runs per request with that request's own generator, so a seeded request gives the same tokens
whatever else is in the batch. Nothing here reads a value back to the host: `Sampled` holds device
tensors until someone asks for the ids (`Sampled.resolve`), so the next step can be queued first.

`row_by_row` (`--batch-invariant`): the filtering before a draw and the logprobs run on each row alone,
a [1, V] problem whatever the batch. torch picks reduction and scan kernels by shape: a sum's thread
layout follows the number of rows, and cumsum (top-p) takes CUB's scan for one row and another kernel
for several, so a row's probabilities could otherwise change in the last bit with its batch. Greedy
rows need nothing: the argmax is exact (first maximum on ties) whatever the order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..device import to_device
from ..rowops import row_argmax
from .request import TokenLogprob
from .sampling_params import SamplingParams
from .structured.structured_output import Grammars, GrammarState


@dataclass(eq=False)
class SamplingState:
    params: SamplingParams
    generator: torch.Generator
    prompt_token_ids: list[int]
    prompt_seen: torch.Tensor | None = None   # [V] bool: tokens of the prompt (repetition penalty)
    counts: torch.Tensor | None = None        # [V] float: times each token was generated
    grammar: GrammarState | None = None       # structured output: what may come next
    earlier: list[int] = field(default_factory=list)   # generated before this runner met the request
    draws_to_skip: int = 0   # the draws that produced `earlier` elsewhere: the generator replays them first

    def skip_draws(self, vocab: int, device: torch.device) -> None:
        """Advance the generator past the draws made for `earlier` by another engine, so a seeded
        request continues as if it had run here all along. torch's multinomial consumes randomness by
        the size of the distribution, not its values (tests/test_disagg_serving.py checks the outcome),
        so a draw from a uniform one of the same size stands in for each."""
        if self.draws_to_skip:
            uniform = torch.ones(vocab, device=device)
            for _ in range(self.draws_to_skip):
                torch.multinomial(uniform, 1, generator=self.generator)
            self.draws_to_skip = 0

    @classmethod
    def create(cls, params: SamplingParams, seed: int, prompt_token_ids: list[int], device: torch.device,
               grammars: Grammars | None = None, output_token_ids: list[int] = ()):
        """`output_token_ids`: tokens the request already generated elsewhere (disaggregated serving):
        its grammar accepts them and penalties count them."""
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)
        grammar = None
        if params.structured_output is not None:
            if grammars is None:
                raise ValueError("a structured request needs the engine's grammars")
            grammar = grammars.matcher(params.structured_output)
            for t in output_token_ids:
                grammar.accept(t)
        return cls(params, generator, list(prompt_token_ids), grammar=grammar, earlier=list(output_token_ids),
                   draws_to_skip=0 if params.greedy else len(output_token_ids))

    def penalty_tensors(self, vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self.counts is None:
            self.prompt_seen = torch.zeros(vocab, dtype=torch.bool, device=device)
            self.prompt_seen[to_device(self.prompt_token_ids, torch.long, device)] = True
            self.counts = torch.zeros(vocab, dtype=torch.float32, device=device)
            if self.earlier:
                self.counts.index_add_(0, to_device(self.earlier, torch.long, device),
                                       torch.ones(len(self.earlier), device=device))
        return self.prompt_seen, self.counts


@dataclass
class Sampled:
    """One step's draws, still on the device."""

    tokens: torch.Tensor                        # [N] int64
    logprob_rows: list[int]                     # rows that asked for logprobs
    picked: torch.Tensor | None = None          # [len(logprob_rows)] logprob of the chosen token
    top_v: torch.Tensor | None = None           # [len(logprob_rows), k]
    top_i: torch.Tensor | None = None
    top_n: list[int] | None = None              # per logprob row: alternatives asked for

    done: torch.cuda.Event | None = None      # recorded after the copies to the host below
    host: list[torch.Tensor] | None = None     # pinned copies of tokens, picked, top_v, top_i

    def to_host(self) -> None:
        """Queue the copies to (pinned) host memory behind the step; `resolve` waits for them only,
        not for whatever is queued later (the next step)."""
        if self.tokens.device.type != "cuda":
            return
        parts = [self.tokens] + ([self.picked, self.top_v, self.top_i] if self.logprob_rows else [])
        self.host = []
        for t in parts:
            pinned = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            pinned.copy_(t, non_blocking=True)
            self.host.append(pinned)
        self.done = torch.cuda.Event()
        self.done.record()

    def host_token(self, row: int) -> int:
        """One sampled id on the host: waits for this step's copies only."""
        if self.host is not None:
            self.done.synchronize()
            return int(self.host[0][row])
        return int(self.tokens[row])

    def resolve(self) -> tuple[list[int], list[TokenLogprob | None]]:
        """The ids (and logprob records) on the host: waits for the step that produced them."""
        if self.host is not None:
            self.done.synchronize()
            self.tokens = self.host[0]
            if self.logprob_rows:
                self.picked, self.top_v, self.top_i = self.host[1:]
        chosen = self.tokens.tolist()
        records: list[TokenLogprob | None] = [None] * len(chosen)
        if self.logprob_rows:
            picked, top_v, top_i = self.picked.tolist(), self.top_v.tolist(), self.top_i.tolist()
            for j, i in enumerate(self.logprob_rows):
                n = self.top_n[j]
                records[i] = TokenLogprob(chosen[i], picked[j], tuple(zip(top_i[j][:n], top_v[j][:n])))
        return chosen, records


def sample(logits: torch.Tensor, states: list[SamplingState], grammars: Grammars | None = None,
           row_by_row: bool = False) -> Sampled:
    """logits: [N, V] for N requests -> one token each (and logprob records where asked).
    `grammars`: needed when a state has a grammar (structured output). `row_by_row`: see the module
    docstring (batch invariance)."""
    raw = logits.float()
    logits = raw
    dev = raw.device
    constrained = [i for i, s in enumerate(states) if s.grammar is not None]
    if constrained:
        bitmask = grammars.bitmask(len(states))
        grammars.fill([states[i].grammar for i in constrained], bitmask, constrained)
        logits = raw.clone()
        grammars.apply(logits, bitmask, constrained)
    penalized = [i for i, s in enumerate(states) if s.params.has_penalties]
    if penalized:
        logits = raw.clone() if logits is raw else logits   # on top of the grammars' masks, not instead
        rows = to_device(penalized, torch.long, dev)
        logits[rows] = apply_penalties(logits[rows], [states[i] for i in penalized])
    tokens = row_argmax(logits)   # the first maximum on ties; through block maxima on the CPU (rowops.py)
    random_rows = [i for i, s in enumerate(states) if not s.params.greedy]
    if random_rows:
        rows = to_device(random_rows, torch.long, dev)
        params = [states[i].params for i in random_rows]

        def filtered(x: torch.Tensor, ps: list[SamplingParams]) -> torch.Tensor:
            return filtered_probs(
                x,
                to_device([p.temperature for p in ps], torch.float32, dev),
                [p.top_k for p in ps],
                to_device([p.top_p for p in ps], torch.float32, dev),
                to_device([p.min_p for p in ps], torch.float32, dev),
                any_top_p=any(p.top_p < 1.0 for p in ps), any_min_p=any(p.min_p > 0 for p in ps),
            )

        if row_by_row:
            probs = torch.cat([filtered(logits[i:i + 1], [p]) for i, p in zip(random_rows, params)])
        else:
            probs = filtered(logits[rows], params)
        for j, i in enumerate(random_rows):
            states[i].skip_draws(probs.shape[-1], dev)
            tokens[i] = torch.multinomial(probs[j], 1, generator=states[i].generator)[0]
    one = None
    for i in penalized:   # the drawn token counts from the next step on
        if one is None:
            one = torch.ones(1, device=dev)
        states[i].counts.index_add_(0, tokens[i:i + 1], one)
    out = Sampled(tokens, [i for i, s in enumerate(states) if s.params.logprobs is not None])
    for i in constrained:   # accepted by the grammar when its next mask is built
        states[i].grammar.sampled(out, i)
    if out.logprob_rows:
        want = to_device(out.logprob_rows, torch.long, dev)
        out.top_n = [states[i].params.logprobs for i in out.logprob_rows]
        k = max(1, max(out.top_n))
        if row_by_row:
            logp = torch.cat([torch.log_softmax(raw[i:i + 1], dim=-1) for i in out.logprob_rows])
            tops = [logp[j:j + 1].topk(k, dim=-1) for j in range(len(out.logprob_rows))]
            out.top_v, out.top_i = torch.cat([t.values for t in tops]), torch.cat([t.indices for t in tops])
        else:
            logp = torch.log_softmax(raw[want], dim=-1)
            out.top_v, out.top_i = logp.topk(k, dim=-1)
        out.picked = logp.gather(1, tokens[want][:, None])[:, 0]
    return out


def apply_penalties(logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    """Repetition penalty over prompt + output tokens (divide positive logits, multiply negative
    ones); presence and frequency penalties over output tokens (subtract p * [count > 0] + f * count)."""
    n, vocab = logits.shape
    dev = logits.device
    rep = to_device([s.params.repetition_penalty for s in states], torch.float32, dev)[:, None]
    presence = to_device([s.params.presence_penalty for s in states], torch.float32, dev)[:, None]
    frequency = to_device([s.params.frequency_penalty for s in states], torch.float32, dev)[:, None]
    tensors = [s.penalty_tensors(vocab, dev) for s in states]
    counts = torch.stack([c for _, c in tensors])
    seen = torch.stack([p for p, _ in tensors]) | (counts > 0)
    penalized = torch.where(logits < 0, logits * rep, logits / rep)
    logits = torch.where(seen, penalized, logits)
    return logits - presence * (counts > 0) - frequency * counts


def filtered_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: list[int],
                   top_p: torch.Tensor, min_p: torch.Tensor | None = None, *, any_top_p: bool | None = None,
                   any_min_p: bool | None = None) -> torch.Tensor:
    """Temperature, then top-k, then top-p (smallest set whose probability reaches top_p; the most
    likely token always stays), then min-p. Returns probabilities [N, V]. `any_top_p` / `any_min_p`:
    whether some row filters that way, when the caller knows (else read back from the tensors)."""
    logits = logits / temperature[:, None]
    vocab = logits.shape[-1]
    if any(0 < k < vocab for k in top_k):
        ks = [k if 0 < k < vocab else vocab for k in top_k]
        kth = logits.topk(max(ks), dim=-1).values.gather(1, to_device(ks, torch.long, logits.device)[:, None] - 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if any_top_p if any_top_p is not None else bool((top_p < 1.0).any()):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = mass_before >= top_p[:, None]
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(dim=-1)
    if min_p is not None and (any_min_p if any_min_p is not None else bool((min_p > 0).any())):
        keep = probs >= min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = torch.where(keep, probs, torch.zeros_like(probs))
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs
