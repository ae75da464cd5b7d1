"""Parallel layers: the "how" of row-parallel modules, and keeping module metadata true to shards.

Column-parallel modules need no new class: a ``Linear`` whose weight holds this rank's rows just
computes its slice of the output features. Row-parallel modules hold a slice of the input
features, so every rank computes a partial sum that must be all-reduced::

    y = x @ W.T + b = sum_r x_r @ W_r.T + b        x_r: [..., in / N],  W_r: [out, in / N]

The classes here subclass the original module type and are set on the instance
(``module.__class__``), so ``.weight`` and ``.bias`` stay where model code reads them; the bias is
kept whole and added once, after the all-reduce.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tpcore.comm import all_reduce
from tpcore.policy import ShardingError

__all__ = ["RowParallelConv1D", "RowParallelLinear", "make_row_parallel", "row_parallel_class", "set_layer_size"]


class RowParallelLinear(nn.Linear):
    """``nn.Linear`` holding an input-feature shard ``W_r: [out, in / N]``; output all-reduced."""

    tp_group = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = all_reduce(F.linear(x, self.weight), self.tp_group)
        return out if self.bias is None else out + self.bias


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
            out = all_reduce(x.reshape(-1, x.shape[-1]) @ self.weight, self.tp_group)
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
