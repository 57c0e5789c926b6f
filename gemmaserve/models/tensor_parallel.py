"""Tensor parallelism inside a model: which slice of each weight a rank holds, and where ranks meet.

Sharding follows module roles (the building blocks of layers.py and moe.py), never model names, so
Gemma 3, Gemma 4 and their vision variants are covered without per-model code:

    role        this rank holds                                   partial results meet
    Attention   its q heads (column); its KV heads, or the one     o_proj (row parallel): all_reduce
                KV head its q heads read when ranks outnumber KV
                heads (replicated: Gemma 3 1B has one)
    GeGLU       its share of the intermediate: gate/up columns,   down_proj (row parallel): all_reduce
                down rows
    Experts     every expert's intermediate split the same way    the weighted expert sum: all_reduce
    Embedding   a block of vocabulary rows (vocab padded to a     lookup: all_reduce (other ranks add 0);
                multiple of N)                                    tied head: logits all_gathered
    the rest    replicated (norms, router, PLE projections, vision towers)

Embeddings are vocab-parallel, not replicated: Gemma ties the output head to the token table, which
is the largest tensor of the small models (60% of the 270M's bytes) and 1.4 GB of the 27B in bf16.
Sharding its rows divides that by N and makes the head vocab-parallel with no second copy; the price
is one all_reduce of [T, H] per step for the lookup, the size of each layer's two. Gemma 4's
per-layer table (262k x layers x 256 on E2B/E4B) is an `Embedding` too and is sharded the same way.
Final logit soft-capping is elementwise, so the model applies it to the gathered logits as before.

Three steps, so that loading and quantisation stay unaware of parallelism:
  1. `shard_model`: local shapes on the device (before any weight is read), and a `ShardPlan` that
     says which slice of each checkpoint tensor this rank reads (`Slice`).
  2. the loader reads only those slices and quantises as usual (a quantised checkpoint's packed tensors:
     their slices in packed units, quantized_shards.py).
  3. `parallelize`: wraps the row-parallel modules and embeddings (whatever their class after
     quantisation) with their collective.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from ..errors import UserInputError
from .layers import Attention, AttentionParams, Embedding, GeGLU, Linear
from .moe import Experts


class Communicator(Protocol):
    rank: int
    world_size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The elementwise sum over ranks (every rank gets the same bits)."""

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x, concatenated along the last dim in rank order."""

    def broadcast_first(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x on every rank (x: the same shape and dtype everywhere)."""


@dataclass(frozen=True)
class DistributedCommunicator:
    """torch.distributed collectives over one process group (NCCL or gloo)."""

    group: Any
    rank: int
    world_size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        x = x.contiguous()
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)

    def broadcast_first(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        x = x.contiguous()
        dist.broadcast(x, dist.get_global_rank(self.group, 0) if self.group is not None else 0, group=self.group)
        return x


@dataclass(frozen=True)
class TensorParallelShard:
    rank: int
    world_size: int
    comm: Communicator


# -- head and row arithmetic --------------------------------------------------------------------------
def local_kv_heads(kv_heads: int, tp: int) -> int:
    """KV heads a rank holds: its share, or the one its q heads read when ranks outnumber KV heads."""
    return kv_heads // tp if kv_heads % tp == 0 else 1


def first_kv_head(kv_heads: int, tp: int, rank: int) -> int:
    if kv_heads % tp == 0:
        return rank * (kv_heads // tp)
    return rank // (tp // kv_heads)   # tp / kv_heads consecutive ranks read one KV head


def vocab_rows(vocab: int, tp: int) -> int:
    """Rows of a vocab-parallel table per rank (the vocabulary padded up to a multiple of tp)."""
    return -(-vocab // tp)


def local_attention(p: AttentionParams, tp: int) -> AttentionParams:
    return dataclasses.replace(p, num_heads=p.num_heads // tp, num_kv_heads=local_kv_heads(p.num_kv_heads, tp))


def check_shardable(model: nn.Module, tp: int) -> None:
    """UserInputError naming the first module whose heads or widths `tp` does not divide."""
    for name, m in model.named_modules():
        if isinstance(m, Attention):
            p = m.p
            if p.num_heads % tp:
                raise UserInputError(f"tensor_parallel_size {tp} does not divide the {p.num_heads} attention heads "
                                     f"of {name}")
            if p.num_kv_heads % tp and tp % p.num_kv_heads:
                raise UserInputError(f"tensor_parallel_size {tp} and the {p.num_kv_heads} KV heads of {name}: one "
                                     "must divide the other (KV heads are split, or replicated across ranks)")
        elif isinstance(m, (GeGLU, Experts)) and m.intermediate % tp:
            raise UserInputError(f"tensor_parallel_size {tp} does not divide the intermediate size "
                                 f"{m.intermediate} of {name}")


# -- what each rank reads ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Slice:
    """A rank's part of a checkpoint tensor: the index ranges `ranges` of dim `dim`, concatenated,
    then zero-padded to `pad_to` along it (vocab-parallel tables whose last block is short)."""

    dim: int
    ranges: tuple[tuple[int, int], ...]
    pad_to: int | None = None

    def read(self, source) -> torch.Tensor:
        """`source`: a tensor, or a safetensors slice (read from the file range by range)."""
        parts = [source[(slice(None),) * self.dim + (slice(a, b),)] for a, b in self.ranges if b > a]
        t = parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.dim)
        if self.pad_to is not None and t.shape[self.dim] < self.pad_to:
            shape = list(t.shape)
            shape[self.dim] = self.pad_to - t.shape[self.dim]
            t = torch.cat([t, t.new_zeros(shape)], dim=self.dim)
        return t

    def read_int4(self, groups):
        """The same slice of a 2-D weight's exact 4-bit groups (`quant.Int4Groups`), or None where it
        cuts through a group of 32 inputs or needs padding (the weight is then quantised from floats)."""
        from .quant import GROUP, Int4Groups

        if self.pad_to is not None or self.dim > 1:
            return None
        if self.dim == 0:
            return Int4Groups(self.read(groups.q), self.read(groups.scale), self.read(groups.minus))
        if any(a % GROUP or b % GROUP for a, b in self.ranges):
            return None
        per_group = Slice(1, tuple((a // GROUP, b // GROUP) for a, b in self.ranges))
        return Int4Groups(self.read(groups.q), per_group.read(groups.scale), per_group.read(groups.minus))


@dataclass
class ShardPlan:
    """Built by `shard_model`: the full shapes of every sharded module (by its path), and the rank."""

    shard: TensorParallelShard
    stacked: dict[str, tuple[str, int]]
    attention: dict[str, AttentionParams] = field(default_factory=dict)   # full params
    mlp: dict[str, int] = field(default_factory=dict)                     # full intermediate (GeGLU)
    experts: dict[str, int] = field(default_factory=dict)                 # full intermediate (Experts)
    embeddings: dict[str, int] = field(default_factory=dict)              # full vocabulary

    def slice_for(self, name: str) -> Slice | None:
        """This rank's slice of the checkpoint tensor `name` (our naming, before q/k/v and gate/up are
        stacked), or None: the tensor is replicated, read whole."""
        prefix, leaf = name.rsplit(".", 1) if "." in name else ("", name)
        tp, r = self.shard.world_size, self.shard.rank
        if prefix in self.embeddings:
            rows = vocab_rows(self.embeddings[prefix], tp)
            return Slice(0, ((r * rows, min(self.embeddings[prefix], (r + 1) * rows)),), pad_to=rows)
        if prefix in self.experts:
            full = self.experts[prefix]
            n = full // tp
            if leaf == "gate_up_proj":
                return Slice(1, ((r * n, (r + 1) * n), (full + r * n, full + (r + 1) * n)))
            return Slice(2, ((r * n, (r + 1) * n),)) if leaf == "down_proj" else None
        owner, _, child = prefix.rpartition(".")
        fused, part = self.stacked.get(child, (child, None))
        if owner in self.attention:
            return self._attention_slice(self.attention[owner], fused, part)
        if owner in self.mlp:
            full = self.mlp[owner]
            n = full // tp
            rows = (r * n, (r + 1) * n)
            if fused == "down_proj":
                return Slice(1, (rows,))
            if fused == "gate_up_proj":
                return Slice(0, (rows,) if part is not None else (rows, (full + rows[0], full + rows[1])))
        return None

    def row_parallel(self) -> list[str]:
        """The row-parallel Linears (o_proj, down_proj): each rank holds a slice of their inputs (columns)."""
        return [f"{n}.o_proj" for n in self.attention] + [f"{n}.down_proj" for n in self.mlp]

    def _attention_slice(self, p: AttentionParams, fused: str, part: int | None) -> Slice | None:
        tp, r = self.shard.world_size, self.shard.rank
        local = local_attention(p, tp)
        q = (r * local.q_size, (r + 1) * local.q_size)
        if fused == "o_proj":
            return Slice(1, (q,))
        if fused != "qkv_proj":
            return None
        kv0 = first_kv_head(p.num_kv_heads, tp, r) * p.head_dim
        kv = (kv0, kv0 + local.kv_size)
        per_part = (q, kv, kv)[:len(p.qkv_sizes)]
        if part is not None:
            return Slice(0, (per_part[part],))
        offsets = [sum(p.qkv_sizes[:i]) for i in range(len(p.qkv_sizes))]
        return Slice(0, tuple((o + a, o + b) for o, (a, b) in zip(offsets, per_part)))


def shard_model(model: nn.Module, shard: TensorParallelShard, device: torch.device) -> ShardPlan:
    """Give every sharded module its local shape (fresh, unfilled tensors on `device`) and move the
    rest to `device`. Call before loading: the model may have been built with full shapes on the CPU,
    where untouched memory costs nothing."""
    tp = shard.world_size
    check_shardable(model, tp)
    plan = ShardPlan(shard, dict(getattr(model, "stacked", {})))
    with torch.device(device):
        for name, m in list(model.named_modules()):
            if isinstance(m, Attention):
                plan.attention[name] = m.p
                dtype = m.qkv_proj.weight.dtype
                m.p = local_attention(m.p, tp)
                m.qkv_proj = Linear(m.p.hidden_size, sum(m.p.qkv_sizes), dtype)
                m.o_proj = Linear(m.p.q_size, m.p.hidden_size, dtype)
            elif isinstance(m, GeGLU):
                plan.mlp[name] = m.intermediate
                dtype, hidden = m.down_proj.weight.dtype, m.down_proj.out_features
                m.intermediate //= tp
                m.gate_up_proj = Linear(hidden, 2 * m.intermediate, dtype)
                m.down_proj = Linear(m.intermediate, hidden, dtype)
            elif isinstance(m, Experts):
                plan.experts[name] = m.intermediate
                e, hidden, dtype = m.num_experts, m.down_proj.shape[1], m.down_proj.dtype
                m.intermediate //= tp
                m.gate_up_proj = nn.Parameter(torch.empty(e, 2 * m.intermediate, hidden, dtype=dtype),
                                              requires_grad=False)
                m.down_proj = nn.Parameter(torch.empty(e, hidden, m.intermediate, dtype=dtype), requires_grad=False)
            elif isinstance(m, Embedding):
                plan.embeddings[name] = m.num_embeddings
                _set(model, name, Embedding(vocab_rows(m.num_embeddings, tp), m.embedding_dim, m.dtype))
    model.to(device)
    return plan


def parallelize(model: nn.Module, plan: ShardPlan) -> None:
    """After loading (and quantisation): add the collectives where partial results meet."""
    comm = plan.shard.comm
    for name in plan.row_parallel():
        _set(model, name, AllReduceOutput(model.get_submodule(name), comm))
    for name in plan.experts:
        _set(model, name, AllReduceOutput(model.get_submodule(name), comm))
    for name, vocab in plan.embeddings.items():
        start = plan.shard.rank * vocab_rows(vocab, comm.world_size)
        _set(model, name, VocabParallelEmbedding(model.get_submodule(name), comm, start, vocab))


def _set(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, module)


def shard_attention_heads(model: nn.Module, shard: TensorParallelShard) -> None:
    """A loaded model whose attention reads KV that tensor parallelism split by heads (an MTP drafter reads
    the target's cache): each Attention keeps this rank's q heads (and its k/v rows where it owns KV), its
    o_proj the matching columns and the all_reduce. The rest stays replicated: a drafter's few small
    layers cost less computed whole than another collective per layer."""
    tp = shard.world_size
    plan = ShardPlan(shard, {})
    for name, m in list(model.named_modules()):
        if not isinstance(m, Attention):
            continue
        full = m.p
        if full.num_heads % tp or (full.num_kv_heads % tp and tp % full.num_kv_heads):
            raise UserInputError(f"tensor_parallel_size {tp} does not split the {full.num_heads} heads and "
                                 f"{full.num_kv_heads} KV heads of {name}")
        qkv = plan._attention_slice(full, "qkv_proj", None).read(m.qkv_proj.weight.data)
        o = plan._attention_slice(full, "o_proj", None).read(m.o_proj.weight.data)
        m.p = local_attention(full, tp)
        m.qkv_proj = Linear(m.p.hidden_size, sum(m.p.qkv_sizes), qkv.dtype)
        m.qkv_proj.weight.data = qkv.contiguous()
        local_o = Linear(m.p.q_size, m.p.hidden_size, o.dtype)
        local_o.weight.data = o.contiguous()
        m.o_proj = AllReduceOutput(local_o, shard.comm)


# -- the collectives, as wrappers ----------------------------------------------------------------------------
class AllReduceOutput(nn.Module):
    """A row-parallel module (this rank's share of a sum) followed by the sum over ranks."""

    def __init__(self, inner: nn.Module, comm: Communicator):
        super().__init__()
        self.inner = inner
        self.comm = comm

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(self.inner(*args))

    # What a LoRA delta joins (layers.project): this rank's share and the sum, apart.
    def partial(self, *args: torch.Tensor) -> torch.Tensor:
        return self.inner(*args)

    def reduce(self, y: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(y)


class VocabParallelEmbedding(nn.Module):
    """A block of vocabulary rows [start, start + rows) of an `Embedding` (or its quantised form):
    lookups of other ranks' ids read 0 here and the all_reduce fills them in; the tied head's logits
    are gathered to the full vocabulary (padding rows cut off), identical on every rank."""

    def __init__(self, local: nn.Module, comm: Communicator, start: int, vocab: int):
        super().__init__()
        self.local = local
        self.comm = comm
        self.start = start
        self.num_embeddings = vocab
        self.embedding_dim = local.embedding_dim

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local_ids = ids - self.start
        outside = (local_ids < 0) | (local_ids >= self.local.num_embeddings)
        rows = self.local(local_ids.masked_fill(outside, 0))
        return self.comm.all_reduce(rows.masked_fill(outside[..., None], 0))

    def as_head(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.comm.all_gather_last(self.local.as_head(hidden))
        if logits.shape[-1] == self.num_embeddings:
            return logits
        return logits[..., :self.num_embeddings].contiguous()
