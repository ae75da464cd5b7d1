"""Parallel layers: the "how" of row-parallel modules, and keeping module metadata true to shards.

Column-parallel modules need no new class: a ``Linear`` whose weight holds this rank's rows just
computes its slice of the output features. Row-parallel modules hold a slice of the input
features, so every rank computes a partial sum that must be all-reduced::

    y = x @ W.T + b = sum_r x_r @ W_r.T + b        x_r: [..., in / N],  W_r: [out, in / N]

The classes here subclass the original module type and are set on the instance
(``module.__class__``), so ``.weight`` and ``.bias`` stay where model code reads them; the bias is
kept whole and added once, after the all-reduce. Over more than two ranks, half-precision partial
sums are summed in fp32 and rounded once (:func:`reduce_partial_sums`); over two, a half-precision
sum already rounds once, so they travel as they are.

Vocab-parallel modules hold ``V_r = ceil(V / N)`` rows of a ``(V, H)`` table, rank ``r`` the rows from
``vocab_start = r * V_r`` (zero rows pad the last ranks, see :mod:`tpcore.slicer`)::

    embedding:  E[ids] = sum_r  mask_r(ids) * E_r[ids - vocab_start_r]      one all-reduce
    LM head:    x @ W.T = concat_r (x @ W_r.T)[..., :V]                     one all-gather
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tpcore.comm import all_gather, all_reduce, group_rank, group_size
from tpcore.policy import ShardingError

__all__ = [
    "RowParallelConv1D",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "VocabParallelLMHead",
    "bind_group",
    "make_row_parallel",
    "make_vocab_parallel",
    "reduce_partial_sums",
    "row_parallel_class",
    "set_layer_size",
]


_HALF_DTYPES = (torch.float16, torch.bfloat16)


def reduce_partial_sums(partial: torch.Tensor, group) -> torch.Tensor:
    """``sum_r partial_r`` over ``group``, rounded once: fp16/bf16 partials of more than two ranks are summed
    in fp32 (twice the bytes; a sum of two halves is rounded once anyway)."""
    if partial.dtype in _HALF_DTYPES and group_size(group) > 2:
        return all_reduce(partial.float(), group).to(partial.dtype)
    return all_reduce(partial, group)


class RowParallelLinear(nn.Linear):
    """``nn.Linear`` holding an input-feature shard ``W_r: [out, in / N]``; output all-reduced."""

    tp_group = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = reduce_partial_sums(F.linear(x, self.weight), self.tp_group)
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """``nn.Embedding`` holding rows ``[vocab_start, vocab_start + V_r)``; looks up the ids it holds,
    zeros the others and all-reduces: ``ids [...] -> [..., H]``, equal to the whole table's lookup.

    An id outside the whole vocabulary fails as with the whole table: ``IndexError`` on the CPU (one
    host read per forward); on a GPU a device-side assert, so that the check costs no host sync.
    """

    tp_group = None
    vocab_start = 0
    vocab_size = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self._check_range(ids)
        local = ids - self.vocab_start
        elsewhere = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(elsewhere, 0), self.weight)
        return all_reduce(out.masked_fill_(elsewhere.unsqueeze(-1), 0), self.tp_group)

    def _check_range(self, ids: torch.Tensor) -> None:
        if not ids.numel():
            return
        low, high = torch.aminmax(ids)
        inside = (low >= 0) & (high < self.vocab_size)
        if ids.device.type != "cpu" and hasattr(torch, "_assert_async"):
            torch._assert_async(inside, "index out of range in self")
        elif not inside.item():
            raise IndexError("index out of range in self")


class VocabParallelLMHead(nn.Linear):
    """``nn.Linear`` holding rows ``[vocab_start, vocab_start + V_r)`` of an output embedding ``(V, H)``:
    ``x [..., H] -> logits [..., V]`` gathered from every rank, or this rank's ``[..., V_r]`` when
    ``gather_output`` is false (columns past ``V`` on the last ranks are padding)."""

    tp_group = None
    vocab_start = 0
    vocab_size = None
    gather_output = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.weight, self.bias)
        if not self.gather_output:
            return logits
        return all_gather(logits, self.tp_group)[..., : self.vocab_size]


def vocab_parallel_class(module: nn.Module) -> type[nn.Module] | None:  # interim: the layers branch replaces it
    if type(module) is nn.Embedding and module.max_norm is None:
        return VocabParallelEmbedding
    if type(module) is nn.Linear:
        return VocabParallelLMHead
    return None


def make_vocab_parallel(module: nn.Module, group, vocab_start: int, vocab_size: int, gather_output: bool = True):
    """Turn an ``nn.Embedding`` or ``nn.Linear`` (already holding its rows) into its vocab-parallel class."""
    if type(module) is nn.Embedding:
        module.__class__ = VocabParallelEmbedding
    elif type(module) is nn.Linear:
        module.__class__ = VocabParallelLMHead
        module.gather_output = gather_output
    else:
        raise ShardingError(f"no vocab-parallel layer for a {type(module).__qualname__}")
    module.tp_group = group
    module.vocab_start = vocab_start
    module.vocab_size = vocab_size
    set_layer_size(module)
    return module


def _conv1d_class() -> type[nn.Module] | None:
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # transformers absent: nothing of that type can exist
        return None
    return Conv1D


_Conv1D = _conv1d_class()

if _Conv1D is not None:

    class RowParallelConv1D(_Conv1D):
        """HF ``Conv1D`` (weight ``(in, out)``) holding an input shard ``W_r: [in / N, out]``."""

        tp_group = None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            size_out = x.shape[:-1] + (self.nf,)
            out = reduce_partial_sums(x.reshape(-1, x.shape[-1]) @ self.weight, self.tp_group)
            return (out + self.bias).view(size_out)

else:  # pragma: no cover - transformers is a dependency
    RowParallelConv1D = None


def row_parallel_class(module: nn.Module) -> type[nn.Module]:
    if type(module) is nn.Linear:
        return RowParallelLinear
    if _Conv1D is not None and type(module) is _Conv1D:
        return RowParallelConv1D
    raise ShardingError(
        f"no row-parallel layer for a {type(module).__qualname__}; give the policy's Layer a replace= class"
    )


def make_row_parallel(module: nn.Module, group, replace: type[nn.Module] | None = None) -> nn.Module:
    """Turn ``module`` (already holding its shard) into its row-parallel class, in place."""
    module.__class__ = replace or row_parallel_class(module)
    module.tp_group = group
    return module


def set_layer_size(module: nn.Module) -> None:
    """Make the size attributes of ``module`` match its (sliced) weight."""
    weight = getattr(module, "weight", None)
    if weight is None:
        return
    if isinstance(module, nn.Linear):
        module.out_features, module.in_features = weight.shape
    elif _Conv1D is not None and isinstance(module, _Conv1D):
        module.nx, module.nf = weight.shape
    elif isinstance(module, nn.Embedding):
        module.num_embeddings, module.embedding_dim = weight.shape


def bind_group(model: nn.Module, group) -> None:
    """Give the parallel modules of a model split elsewhere (a skeleton sent to a rank) this rank's
    group, and the vocab-parallel ones this rank's first row (every rank holds ``V_r`` rows)."""
    rank = group_rank(group)
    for module in model.modules():
        if hasattr(module, "tp_group"):
            module.tp_group = group
        if isinstance(module, VocabParallelEmbedding):
            module.vocab_start = rank * module.num_embeddings
        elif isinstance(module, VocabParallelLMHead):
            module.vocab_start = rank * module.out_features
