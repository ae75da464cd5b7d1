"""Linear layers whose weight is int8 with a float scale per output row, computed on a rank's rows or columns.

:class:`Int8Linear` holds torchao's ``Int8WeightOnlyConfig`` weights (per row, symmetric), as transformers saves them::

    _weight_qdata       int8  (out_r, in_r)   this rank's values (also ``weight``; a cut like any weight's)
    _weight_scale       S     (out_r, 1)      cut with the rows; whole on every rank where the columns are cut
    _weight_zero_point  int8  (out_r, 1)      zeros (symmetric), cut as the scales
    y = (x @ q_r.T) * scale + b

computed as torchao's ``Int8Tensor`` computes its per-row weight-only product: the int8 values widened to the
input's dtype, one matrix product, the output columns scaled, the bias added. A row-parallel layer
(:class:`RowParallelInt8Linear`) all-reduces the unscaled partial products first, then scales once: every rank
keeps one byte a weight.

:class:`TokenInt8Linear` holds compressed-tensors' ``W8A8`` (``int-quantized``: an int8 ``weight`` and its
``weight_scale (out, 1)``) and computes as compressed-tensors decompresses and fake-quantizes: ``W_r = q_r * scale``
in the scale's dtype, each token's input rounded through int8 (:mod:`tpcore.parallel.token_rounding`), then the
product.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tpcore.cut.split import Split
from tpcore.parallel.layers import reduce_partial_sums
from tpcore.parallel.quantized_linear import QuantizedLinear, RowParallelQuantized
from tpcore.parallel.token_rounding import GatheredTokenMaxima, TokenRoundedInputs

__all__ = ["Int8Linear", "RowParallelInt8Linear", "RowParallelTokenInt8Linear", "TokenInt8Linear"]


class Int8Linear(QuantizedLinear):
    """``nn.Linear`` whose ``weight`` is int8 with a scale per row (module docstring); made from an ``nn.Linear`` in
    place by :meth:`hold`."""

    #: a model-wide cast casts the scales (and bias), as transformers does; the values stay int8
    keeps_stored_dtypes = False
    _weight_qdata: nn.Parameter
    _weight_scale: nn.Parameter
    _weight_zero_point: nn.Parameter

    @classmethod
    def hold(cls, linear: nn.Linear, scale_dtype: torch.dtype) -> Int8Linear:
        """Make the meta ``linear`` hold int8 values in place: ``_weight_qdata`` (also its ``weight``), a
        ``_weight_scale`` of ``scale_dtype`` and an int8 ``_weight_zero_point``, one a row."""
        out_features, in_features = linear.out_features, linear.in_features
        linear.__class__ = cls
        assert isinstance(linear, Int8Linear)
        linear._parameters.pop("weight", None)
        linear._weight_qdata = _frozen(torch.empty(out_features, in_features, dtype=torch.int8, device="meta"))
        linear.weight = linear._weight_qdata  # the name policies cut; the stored name comes first
        linear._weight_scale = _frozen(torch.empty(out_features, 1, dtype=scale_dtype, device="meta"))
        linear._weight_zero_point = _frozen(torch.empty(out_features, 1, dtype=torch.int8, device="meta"))
        return linear

    def follower_cuts(self, split: Split, weight: str = "weight") -> dict[str, Split]:
        """The scales and zero points follow the weight's rows; a cut of the columns leaves them whole."""
        return {"_weight_scale": split, "_weight_zero_point": split} if split.dim == 0 else {}

    def localize(self, rank: int, world_size: int) -> None:
        """Refuse zero points other than zeros: the product (as torchao's) reads the values as symmetric."""
        if self._weight_zero_point.any():
            raise ValueError("int8 weights with nonzero zero points (asymmetric): tpcore splits symmetric ones")

    def scaled(self, products: torch.Tensor) -> torch.Tensor:
        """``products * scale + b``: the whole layer's output from ``x @ q.T``."""
        out = products * self._weight_scale.to(products.dtype).flatten()
        return out if self.bias is None else out + self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scaled(F.linear(x, self._weight_qdata.to(x.dtype))).to(x.dtype)


class RowParallelInt8Linear(Int8Linear):
    """:class:`Int8Linear` holding a shard of the input features: the partial products all-reduced, then scaled
    and the bias added once."""

    tp_group = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        products = reduce_partial_sums(F.linear(x, self._weight_qdata.to(x.dtype)), self.tp_group)
        return self.scaled(products).to(x.dtype)


Int8Linear.row_parallel_class = RowParallelInt8Linear


class TokenInt8Linear(TokenRoundedInputs, QuantizedLinear):
    """``nn.Linear`` whose ``weight`` is int8 with a ``weight_scale`` per row, its input rounded per token through
    int8 (module docstring); made from an ``nn.Linear`` in place by :meth:`hold`."""

    #: a model-wide cast casts the scales (and bias), as transformers does; the values stay int8
    keeps_stored_dtypes = False
    token_values = "int8"
    weight_scale: nn.Parameter

    @classmethod
    def hold(cls, linear: nn.Linear, scale_dtype: torch.dtype) -> TokenInt8Linear:
        """Make the meta ``linear`` hold an int8 ``weight`` and a ``weight_scale`` ``(out, 1)`` of ``scale_dtype``."""
        linear.__class__ = cls
        assert isinstance(linear, TokenInt8Linear)
        linear.weight = _frozen(torch.empty(linear.out_features, linear.in_features, dtype=torch.int8, device="meta"))
        linear.weight_scale = _frozen(torch.empty(linear.out_features, 1, dtype=scale_dtype, device="meta"))
        return linear

    def follower_cuts(self, split: Split, weight: str = "weight") -> dict[str, Split]:
        """The scales follow the weight's rows; a cut of the columns leaves them whole."""
        return {"weight_scale": split} if split.dim == 0 else {}

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """``q_r * scale`` in the scale's dtype, then ``dtype``."""
        scale = self.weight_scale
        return (self.weight.to(scale.dtype) * scale).to(dtype)


class RowParallelTokenInt8Linear(RowParallelQuantized, GatheredTokenMaxima, TokenInt8Linear):
    """:class:`TokenInt8Linear` holding a shard of the input features: each token's maximum gathered from every
    rank, the output all-reduced, the bias added once."""


TokenInt8Linear.row_parallel_class = RowParallelTokenInt8Linear


def _frozen(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)
