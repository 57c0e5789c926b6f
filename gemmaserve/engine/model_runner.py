"""Runs one step description (`StepPlan`) on the device and samples: the only place tensors are built.

    seqs   a: 5 new tokens (prefill)   b: 1 (decode)   c: 1 (decode)
    input  [a0 a1 a2 a3 a4 | b7 | c3]        positions [0..4 | 7 | 3]
    sample rows: last token of every sequence the plan marks `sample`

Speculative sequences (`num_drafts` k) sample their last k + 1 rows, and spec_decode/verify.py keeps the
drafts the target agrees with. A drafter (spec_decode/drafters.py) fills a step's draft slots before the target's
forward (draft_model.py), or drafts after sampling for sequences that ask (`propose`; mtp.py, from the
hidden state of the row that chose their last token: eager steps, as graphs and compiled steps give
logits only).

The runner sees only plans: it keeps its own block tables (updated by the plan's deltas) and a
sampling state per request (from its `NewRequest` until it is `finished`), never a live Request.

Images and audio: a request's items arrive with its `NewRequest`; media/embedder.py puts their soft
tokens into the rows of the step's embeddings that their tokens take.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from ..attention.base import AttentionBackend, AttentionMetadata
from ..kv.base import KVLayout
from ..kv.connector import StagedRows
from ..kv.groups import KVGroup
from ..kv.spec import LayerSpec
from ..models.base import ModelInputs
from ..models.tensor_parallel import first_kv_head
from ..transfer.kv_io import assemble, gather_rows, scatter_rows
from .block_tables import BlockTables
from ..device import to_device
from .spec_decode.drafters import Drafter
from .connectors.host_kv_store import HostKVStore
from .lora import RunnerLoRA
from .media.embedder import RunnerMedia
from .sampler import Sampled, SamplingState, sample
from .spec_decode.grammar_cut import allowed_drafts, cut_to_grammars
from .spec_decode.verify import verify_step
from .structured.structured_output import Grammars
from .step import DEVICE_TOKEN, SeqStep, StepPlan, StepResult

log = logging.getLogger(__name__)


class Forward(NamedTuple):
    logits: torch.Tensor | None   # a row per sampled position, in order (`forward`)
    hidden: torch.Tensor | None   # their hidden states, where asked for
    seqs: list[SeqStep]           # the sequences as they ran (drafts a grammar forbids cut)


@dataclass(frozen=True)
class RunnerKV:
    """The KV cache the scheduler's manager laid out, which every rank's runner allocates the same way."""

    layout: KVLayout
    groups: tuple[KVGroup, ...]
    layer_slot: tuple[tuple[int, int], ...]   # layer -> (group, slot in the group's pages)
    specs: list[LayerSpec]
    host_kv_pages: int = 0   # pages of a host-memory tier that plans copy to and from (host_kv_store.py)


@dataclass(frozen=True)
class RunnerOptions:
    """How a runner runs its steps: plain values, the same on every tensor-parallel rank.

    `suppress_token_ids`: never sampled (their logits become -inf before the sampler). `cpu_compile`:
    decode steps through torch.compile (compiled_decode.py), compiled at construction: "required" raises
    if that fails, "try" warns and stays eager, "off" never compiles. `speculative_tokens`: drafts a step
    may verify for each of up to `speculative_batch` sequences (CUDA graphs replay such steps as decode
    rows: that many more rows, and keys per sliding table). `max_loras`: device slots for LoRA adapters,
    filled as plans say (`max_cpu_loras` kept read on the host)."""

    max_model_len: int = 0
    max_batch: int = 0
    cuda_graphs: bool = False
    cpu_compile: str = "off"
    encoder_cache_bytes: int = 256 * 2**20
    suppress_token_ids: tuple[int, ...] = ()
    speculative_tokens: int = 0
    speculative_batch: int = 0
    max_loras: int = 0
    max_lora_rank: int = 64
    max_cpu_loras: int = 1


class ModelRunner:
    def __init__(self, model: nn.Module, backend: AttentionBackend, device: torch.device, kv: RunnerKV,
                 options: RunnerOptions = RunnerOptions(), grammars: Grammars | None = None,
                 drafter: "Drafter | None" = None):
        """`grammars`: matchers for requests with structured output (each rank builds its own from its
        tokenizer). `drafter`: drafts for speculative steps (drafters.py; each rank's reads its own KV heads)."""
        layout, groups, layer_slot, specs = kv.layout, kv.groups, kv.layer_slot, kv.specs
        max_batch, max_model_len = options.max_batch, options.max_model_len
        self.model = model
        self.drafter = drafter
        self.backend = backend
        self.device = device
        self.layer_slot = layer_slot
        # One page more than the manager hands out: the null page that CUDA-graph padding rows use.
        self.kv_cache = backend.allocate_kv_cache(specs, dataclasses.replace(layout, num_pages=layout.num_pages + 1),
                                                  device)
        self.host_kv = HostKVStore(self.kv_cache, layout.page_bytes, kv.host_kv_pages) if kv.host_kv_pages else None
        tp_plan = getattr(model, "tensor_parallel_plan", None)
        self.shard = tp_plan.shard if tp_plan is not None and tp_plan.shard.world_size > 1 else None
        # Disaggregated handoffs (transfer/kv_io.py), on rank 0: wire buffers the next plan loads (decode), and
        # those a plan saved for the engine to take (prefill).
        self._staged_in: dict[str, torch.Tensor] = {}
        self._staged_out: dict[str, torch.Tensor] = {}
        self._saved_step = -1
        self.tables = BlockTables(groups, max(1, max_batch), max_model_len or 1,
                                  layout.num_pages + 1 if layout.identity_slots else None, device)
        suppressed = list(options.suppress_token_ids)
        self.suppressed = to_device(suppressed, torch.long, device) if suppressed else None
        self.grammars = grammars
        self.sampling: dict[str, SamplingState] = {}
        self._last_sampled: dict[str, tuple[torch.Tensor, int]] = {}   # request -> (ids of its last step, row)
        self._applied_step = -1
        # The most rows a decode batch given to graphs or compiled steps has: a verification step runs as one
        # decode row per token.
        verified = min(max_batch, options.speculative_batch) * (1 + options.speculative_tokens)
        self.max_decode_rows = max(max_batch, verified)
        self.media = RunnerMedia(options.encoder_cache_bytes, device,
                                 alone=backend.batch_invariant or device.type == "cpu")
        self.lora = (RunnerLoRA(model, device, options.max_loras, options.max_lora_rank, options.max_cpu_loras)
                     if options.max_loras else None)
        self.graphs = None
        if options.cuda_graphs:
            from .compile.cuda_graphs import DecodeGraphs

            extra = options.speculative_tokens + (drafter.lookback if drafter is not None else 0)
            self.graphs = DecodeGraphs(model, backend, self.kv_cache, layer_slot, groups, max_model_len,
                                       layout.num_pages, self.max_decode_rows, device, extra)
            self.graphs.capture_all()
        # Compiled decode steps (a CompiledDecode or an AotDecode: `run` gives a decode batch's logits, or
        # None to run it eagerly), set now or between steps by the engine (`use_compiled`).
        self.compiled = None
        self._kv = kv
        if options.cpu_compile != "off":
            self.compile_decode(required=options.cpu_compile == "required")

    def compile_decode(self, required: bool) -> None:
        """Compile decode steps in this process with torch.compile (compiled_decode.py), now. A failure
        raises where `required`, else leaves the steps eager with a warning."""
        from .compile.compiled_decode import CompiledDecode

        kv = self._kv
        self.compiled = CompiledDecode(self.model, self.backend, self.kv_cache, self.layer_slot, kv.groups,
                                       kv.layout.num_pages, max(1, self.max_decode_rows), kv.specs,
                                       kv.layout.tokens_per_page)
        try:
            self.compiled.compile()
        except RuntimeError as e:
            if required:
                raise
            log.warning("CPU decode steps stay eager: %s", e)

    def use_compiled(self, compiled) -> None:
        """Run decode batches through `compiled` from the next step on (the engine calls it between steps;
        its results are an eager step's bits, so a running request's tokens do not change)."""
        self.compiled = compiled

    # -- state the plans keep ---------------------------------------------------------------
    @torch.inference_mode()
    def apply(self, plan: StepPlan) -> None:
        """Take the plan's table and request changes (once per plan, however often it is executed)."""
        if plan.step == self._applied_step:
            return
        self._applied_step = plan.step
        if plan.kv_transfers.copies:   # first: a save reads device pages this step's forward may overwrite
            self.host_kv.execute(plan.kv_transfers)
        for rows in plan.kv_transfers.row_loads:
            self._load_rows(rows)
        for load in plan.lora_loads:
            try:
                self.lora.load(load)
            except Exception as exc:   # the rest of the plan still applies; only this adapter's rows fail
                self.lora.fail(load.slot, f"LoRA adapter {load.name!r} could not be loaded: {exc}")
        for req_id in plan.released + plan.finished:
            self.tables.release(req_id)
        for req_id in plan.finished:
            self.sampling.pop(req_id, None)
            self._last_sampled.pop(req_id, None)
            self.media.release(req_id)
        for new in plan.new_requests:
            self.sampling[new.req_id] = SamplingState.create(new.params, new.seed, new.prompt_token_ids, self.device,
                                                             self.grammars, new.output_token_ids)
            self.media.add(new.req_id, new.media)
        self.tables.update_slots(plan.slot_updates)
        for s in plan.seqs:
            self.tables.apply(s.req_id, s.deltas, s.new_table)

    # -- disaggregated handoffs: a transfer's token rows ---------------------------------------------
    def _first_head(self, heads: int, rank: int | None = None) -> int:
        if self.shard is None:
            return 0
        return first_kv_head(heads, self.shard.world_size, self.shard.rank if rank is None else rank)

    def _load_rows(self, rows: StagedRows) -> None:
        """Write a received transfer's rows into the pages the plan names (rank 0 was given the wire buffer;
        under tensor parallelism it sends it to every rank, each keeping its own heads)."""
        wire = self._staged_in.pop(rows.key, None)
        if self.shard is not None:
            if wire is None:
                wire = torch.empty(rows.nbytes, dtype=torch.uint8)
            wire = self.shard.comm.broadcast_first(wire.to(self.device))
        elif wire is None:
            raise RuntimeError(f"no transfer buffer was given for {rows.key}")
        scatter_rows(self.kv_cache, rows.spans, wire, self._first_head)

    def _save_rows(self, rows: StagedRows) -> None:
        """Copy a transfer's rows out of the pages the plan names, after the forward that computed them; rank 0
        keeps the wire buffer (every rank's heads) for the engine to take."""
        local = gather_rows(self.kv_cache, rows.spans)
        if self.shard is None:
            self._staged_out[rows.key] = local.cpu()
            return
        parts = self.shard.comm.all_gather_last(local).chunk(self.shard.world_size)
        if self.shard.rank == 0:
            self._staged_out[rows.key] = assemble(list(parts), rows.spans, self.kv_cache, self._first_head).cpu()

    def put_staged(self, key: str, wire: torch.Tensor) -> None:
        """A received transfer's wire buffer, for the plan that loads `key` (the engine gives it, on rank 0)."""
        self._staged_in[key] = wire

    def drop_staged(self, key: str) -> None:
        self._staged_in.pop(key, None)

    def take_staged(self, key: str) -> torch.Tensor | None:
        """The wire buffer a plan saved under `key` (None if none did)."""
        return self._staged_out.pop(key, None)

    # -- one step -----------------------------------------------------------------------------
    @torch.inference_mode()
    def build_inputs(self, seqs: list[SeqStep]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        ids: list[int] = []
        positions: list[int] = []
        from_device: list[tuple[int, str]] = []   # (row of input_ids, request): last step's sample
        for s in seqs:
            for j, t in enumerate(s.token_ids):
                if t == DEVICE_TOKEN:
                    from_device.append((len(ids) + j, s.req_id))
            ids.extend(s.token_ids)
            positions.extend(range(s.start, s.start + s.num_new_tokens))
        md = AttentionMetadata(
            query_lens=[s.num_new_tokens for s in seqs],
            seq_lens=[s.start + s.num_new_tokens for s in seqs],
            groups=self.tables.tables([s.req_id for s in seqs]),
            layer_slot=self.layer_slot,
        )
        if self.media:
            spans = [[(it.start, it.end) for it in self.media.covered(s) if it.bidirectional] for s in seqs]
            md.image_spans = spans if any(spans) else None
        input_ids = to_device(ids, torch.long, self.device)
        if from_device:   # sampled ids never went to the host: gather them on the device
            by_tensor: dict[int, tuple[torch.Tensor, list[int], list[int]]] = {}
            for row, req_id in from_device:
                tokens, index = self._last_sampled[req_id]
                _, rows, idx = by_tensor.setdefault(id(tokens), (tokens, [], []))
                rows.append(row)
                idx.append(index)
            for tokens, rows, idx in by_tensor.values():
                input_ids[to_device(rows, torch.long, self.device)] = tokens[to_device(idx, torch.long, self.device)]
        return input_ids, to_device(positions, torch.long, self.device), md

    @torch.inference_mode()
    def forward(self, seqs: list[SeqStep]) -> torch.Tensor | None:
        """Logits [N, V] for the N sequences with `sample` (in order; a speculative one's k + 1 rows
        consecutive), or None."""
        return self.run_model(seqs)[0]

    def run_model(self, seqs: list[SeqStep], want_hidden: bool = False, drafts: dict | None = None) -> Forward:
        """Logits as `forward` has them, their hidden states where `want_hidden` (else None), and the
        sequences as they ran (drafts a grammar forbids cut). `drafts` receives what the drafter put in
        the step's draft slots. Every step's forward passes here."""
        input_ids, positions, md = self.build_inputs(seqs)
        filled = self.drafter.in_step(self, seqs, input_ids, positions) if self.drafter is not None else None
        if self.grammars is not None and any(s.num_drafts for s in seqs):
            cut = cut_to_grammars(seqs, filled or {}, self.sampling)
            if cut is not None:
                seqs, filled = cut
                input_ids, positions, md = self.build_inputs(seqs)
        if filled and drafts is not None:
            drafts.update(filled)
        rows, sampled, end = [], [], 0
        for b, s in enumerate(seqs):
            end += s.num_new_tokens
            if s.sample:
                rows.extend(range(end - 1 - s.num_drafts, end))
                sampled.extend([b] * (s.num_drafts + 1))
        embeds = self.media.embeds(self.model, seqs, input_ids) if self.media else None
        lora = self.lora.batch(seqs) if self.lora is not None else None
        # Decode batches, and verification steps as one decode row per token, run through CUDA graphs (steps with
        # LoRA rows too, through the stacked slots' kernels, unless an adapter adapts MoE experts) or compiled CPU
        # steps (not those with LoRA rows) where the engine has them; everything else eagerly.
        eager = embeds is not None or (lora is not None and (self.graphs is None or lora.slots is None
                                                             or bool(lora.expert_slots)))
        as_decode = md if md.is_decode_only and not eager else None
        if as_decode is None and not eager and (self.graphs is not None or self.compiled is not None):
            as_decode = verification_as_decode(seqs, md)
        if self.graphs is not None and as_decode is not None and as_decode.num_seqs <= self.graphs.max_size:
            logits, hidden = self.graphs.run(input_ids, positions, as_decode, lora)   # a row per input row
            if len(rows) != as_decode.num_seqs:
                # A one-token row can be a prefill chunk that does not complete its prompt: no sample.
                if not rows:
                    return Forward(None, None, seqs)
                picked = to_device(rows, torch.long, self.device)
                logits, hidden = logits[picked], hidden[picked]
            return Forward(logits, hidden if want_hidden else None, seqs)
        if self.compiled is not None and as_decode is not None and len(rows) == as_decode.num_seqs:
            out = self.compiled.run(input_ids, positions, as_decode)
            if out is not None:
                return Forward(out[0], out[1] if want_hidden else None, seqs)
        attn = self.backend.begin_batch(md, self.kv_cache)
        inputs = ModelInputs(input_ids, positions, attn, inputs_embeds=embeds, lora=lora)
        # Prefill chunks: only the last row of completing sequences is sampled. A model may then skip
        # the other rows where no KV is written (ModelInputs), which assumes one row per sequence: with
        # drafts (several rows of a sequence) the rows are picked after the forward instead.
        pick_after = len(rows) != end and len(sampled) != len(set(sampled))
        if len(rows) != end and not pick_after:
            inputs.sample_rows = to_device(rows, torch.long, self.device)
            inputs.sample_seqs = sampled
        hidden = self.model(inputs)
        if not rows:
            return Forward(None, None, seqs)
        if pick_after:
            hidden = hidden[to_device(rows, torch.long, self.device)]
        return Forward(self.model.compute_logits(hidden), hidden if want_hidden else None, seqs)

    @torch.inference_mode()
    def launch(self, plan: StepPlan, only: list[int] | None = None) -> "PendingStep":
        """Queue the plan (or the sequences `only` of it) and its sampling on the device; nothing
        waits for the device. The ids reach the host when the result is resolved."""
        self.apply(plan)
        seqs = plan.seqs if only is None else [plan.seqs[i] for i in only]
        proposing = self.drafter is not None and any(s.propose for s in seqs if s.sample)
        filled: dict[str, list[int]] = {}
        logits, hidden, ran = self.run_model(seqs, proposing and self.drafter.wants_hidden, filled)
        if plan.kv_transfers.row_saves and self._saved_step != plan.step:   # once, whatever reruns a plan
            self._saved_step = plan.step
            for rows in plan.kv_transfers.row_saves:
                self._save_rows(rows)
        cut = ran is not seqs   # a grammar cut drafts before the forward
        planned = {s.req_id: s.num_drafts for s in seqs} if cut else None
        seqs = ran
        ids = [s.req_id for s in seqs if s.sample]
        if not ids:
            return PendingStep([], None)
        if self.suppressed is not None:
            logits.index_fill_(1, self.suppressed, float("-inf"))
        row_by_row = self.backend.batch_invariant or self.device.type == "cpu"
        sampling = [s for s in seqs if s.sample]
        if any(s.num_drafts for s in sampling):
            pending = self._verify(logits, sampling, row_by_row, filled)
            emitted = pending.result.by_request()
            counts = [len(emitted[s.req_id]) for s in sampling]
            tokens = to_device([emitted[s.req_id][-1][0] for s in sampling], torch.long, self.device)
        else:
            sampled = sample(logits, [self.sampling[i] for i in ids], self.grammars, row_by_row=row_by_row)
            for i, req_id in enumerate(ids):   # the next step may read these on the device
                self._last_sampled[req_id] = (sampled.tokens, i)
            sampled.to_host()
            pending, counts, tokens = PendingStep(ids, sampled), [1] * len(ids), sampled.tokens
        if proposing:
            pending.drafts = self.drafter.after_step(self, sampling, counts, hidden, tokens)
            pending.cut = lambda req_id, drafts: allowed_drafts(self.sampling.get(req_id), drafts)
        if planned is not None:
            pending.verified_drafts = {s.req_id: s.num_drafts for s in seqs if s.num_drafts != planned[s.req_id]}
        return pending

    def _verify(self, logits: torch.Tensor, seqs: list[SeqStep], row_by_row: bool,
                filled: dict[str, list[int]]) -> "PendingStep":
        """A step with drafts: each sequence's emitted tokens, read back now (spec_decode/verify.py)."""
        result = verify_step(logits, seqs, filled, self.sampling, self.grammars, row_by_row)
        for req_id, tokens in result.by_request().items():   # the next step may read the last one on the device
            self._last_sampled[req_id] = (to_device([tokens[-1][0]], torch.long, self.device), 0)
        return PendingStep([], None, result)

    def execute(self, plan: StepPlan, only: list[int] | None = None) -> StepResult:
        """Run the plan (or the sequences `only` of it) and sample. Returns a token per `sample` row."""
        return self.launch(plan, only).resolve()


def verification_as_decode(seqs: list[SeqStep], md: AttentionMetadata) -> AttentionMetadata | None:
    """A step whose sequences each run one token and their drafts, as a decode batch of one row per token
    (what a decode graph replays): row j of a sequence at `start` is a sequence of start + j + 1 keys over
    the same block tables. A layer writes every row's K/V before any row attends, so each row sees the rows
    before it, as in the multi-token step (a traced step, which writes after the graph, reads them from the
    step's new K/V: `new_before`). None if a sequence runs a prefill chunk or nothing is drafted."""
    if not any(s.num_drafts for s in seqs) or any(s.num_new_tokens != 1 + s.num_drafts for s in seqs):
        return None
    owner = [b for b, s in enumerate(seqs) for _ in range(s.num_new_tokens)]
    seq_lens = [s.start + j + 1 for s in seqs for j in range(s.num_new_tokens)]
    before = [j for s in seqs for j in range(s.num_new_tokens)]
    return AttentionMetadata([1] * len(owner), seq_lens, [g.select(owner) for g in md.groups], md.layer_slot,
                             new_before=before)


@dataclass
class PendingStep:
    """A launched step whose sampled ids are still on their way to the host."""

    req_ids: list[str]
    sampled: Sampled | None
    result: StepResult | None = None   # already on the host (a verified speculative step)
    drafts: tuple[list[str], list[int], torch.Tensor] | None = None   # the drafter's (ids, counts, [B, k])
    cut: Callable[[str, list[int]], list[int]] | None = None   # drafts of a request as its grammar allows them
    verified_drafts: dict[str, int] | None = None   # StepResult.verified_drafts

    def resolve(self) -> StepResult:
        if self.result is not None:
            result = self.result
        elif self.sampled is None:
            result = StepResult()
        else:
            tokens, records = self.sampled.resolve()
            result = StepResult(self.req_ids, tokens, records)
        if self.verified_drafts:
            result.verified_drafts.update(self.verified_drafts)
        if self.drafts is not None:
            ids, want, tokens = self.drafts
            cut = self.cut or (lambda _, drafts: drafts)
            result.drafts = {req_id: cut(req_id, row[:n]) for req_id, n, row in zip(ids, want, tokens.tolist())}
        return result
