"""A tensor-parallel rank's slices of a quantised checkpoint's tensors (compressed-tensors): the slice of each weight
that `ShardPlan.slice_for` gives, carried to the tensors the checkpoint saves for it, or a UserInputError naming the
tensor where a rank's share would cut through one of its packed elements.

`slice_for` speaks in weight rows (column parallel: q/k/v, gate/up) and columns (row parallel: o_proj, down_proj).
A quantised module's tensors hold several of those per element (quantization/linear.element_span):

    tensor                                column parallel (rows)            row parallel (columns)
    weight_packed      int32 [N, K/8]     rows                              words: a multiple of 8 columns
    weight_scale       [N, K/g]           rows                              groups: a multiple of g
    weight_zero_point  int32 [N/8, K/g]   8 rows a word: a multiple of 8    groups: a multiple of g
    weight (fp8)       [N, K]             rows                              columns
    weight_scale       [N, 1]             rows                              whole, on every rank
    weight_scale       [N/bn, K/bk]       blocks: a multiple of bn          blocks: a multiple of bk

(A share may also end where the tensor ends: N or K not a multiple of the element, its last one partial.)

The weights are then exactly the tp=1 weights' slices, and the products are exact sums of the slices' products:
y = sum_r x_r (s * q_r)^T for a row scale s, and per group or block the same, since each group lies in one rank's
slice. The activations of FP8 row-parallel modules are the exception: the scheme quantises a token's activations
per token (per channel) over all of K, but a rank sees only its K slice, so each rank quantises its own slice per
token (as vLLM does; an exact scale would cost a collective of the tokens' amax before every o_proj and down_proj).
Per-channel FP8 at tp = N is therefore the scheme with activations in N groups of K/N columns: each group's scale
is at most the whole row's, so its rounding is no coarser, but the logits differ from tp = 1 by fp8 rounding
(tests/test_quantized_tp.py bounds it). Block FP8 quantises activations in groups of bk columns, which the bk
alignment above keeps inside one rank: exact.
"""

from __future__ import annotations

from torch import nn

from ..errors import UserInputError
from ..quantization.compressed_tensors import ModuleQuant
from ..quantization.linear import element_span
from ..quantization.schemes import Scheme
from .quantized import PlannedModule, TensorInfo, our_module
from .tensor_parallel import ShardPlan, Slice

# What a share of a tensor must not cut through, by tensor (for messages).
_ELEMENTS = {"weight_packed": "int32 words of eight 4-bit values", "weight_zero_point": "zero points packed eight "
             "rows per int32", "weight_scale": "scale groups"}


def quantized_slices(model: nn.Module, planned: dict[str, PlannedModule], plan: ShardPlan,
                     index: dict[str, TensorInfo]) -> dict[str, Slice | None]:
    """Our tensor name -> this rank's slice of it (None: read whole), for every checkpoint tensor of a planned
    (quantised) module; `index`: the checkpoint's tensors by their own names. Raises before anything is read."""
    out: dict[str, Slice | None] = {}
    for raw in index:
        ours = model.checkpoint_name(raw)
        if ours is None or ours.endswith(".weight_shape"):   # weight_shape is checked whole, then dropped
            continue
        entry = planned.get(our_module(model, ours)[0])
        if entry is None:
            continue
        part = plan.slice_for(ours)
        out[ours] = None if part is None else _leaf_slice(raw, part, entry.quant, index, plan)
    return out


def _leaf_slice(raw: str, part: Slice, quant: ModuleQuant, index: dict[str, TensorInfo], plan: ShardPlan
                ) -> Slice | None:
    module, _, leaf = raw.rpartition(".")
    span = element_span(quant, leaf)
    if span is None:
        return part   # not the format's: load_weights refuses it by name
    unit = span[part.dim]
    if unit is None:
        return None
    if unit == 1:
        return part
    extent = _weight_shape(module, quant, index)[part.dim]
    ranges = []
    for a, b in part.ranges:
        if a % unit or (b % unit and b != extent):
            what = ("rows", "columns")[part.dim]
            element = f"fp8 blocks of {quant.block[0]}x{quant.block[1]}" if quant.block is not None else \
                _ELEMENTS[leaf]
            raise UserInputError(
                f"checkpoint tensor {raw}: tensor-parallel rank {plan.shard.rank} of {plan.shard.world_size} would "
                f"hold its weight's {what} {a}..{b} of {extent}, which cuts through its {element} ({unit} {what} "
                f"each; {quant.label}, compressed-tensors): each rank's share must be a multiple of {unit} {what}; "
                "use a smaller tensor_parallel_size")
        ranges.append((a // unit, -(-b // unit)))
    return Slice(part.dim, tuple(ranges), part.pad_to)


def _weight_shape(module: str, quant: ModuleQuant, index: dict[str, TensorInfo]) -> tuple[int, int]:
    """A checkpoint module's (N, K), from its headers (plan_modules has checked that they exist)."""
    if quant.scheme is Scheme.W4A16:
        n, words = index[f"{module}.weight_packed"].shape
        return n, 8 * words
    n, k = index[f"{module}.weight"].shape
    return n, k
