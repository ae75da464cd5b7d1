"""bitsandbytes' 8-bit linear layers (LLM.int8(): ``Linear8bitLt``), computed on a rank's rows or columns.

A layer stores, as transformers saves ``load_in_8bit`` models::

    weight  int8     (out_r, in_r)   this rank's values (a cut like any weight's)
    SCB     float32  (out_r,)        each row's absolute maximum: W[i, j] = weight[i, j] * SCB[i] / 127

and computes as bitsandbytes' inference product does, with ``t`` the outlier threshold (``llm_int8_threshold``)::

    A = x in float16                     (tokens, in)
    O = {j : |A[t, j]| >= t for a token}  the outlier columns; their entries >= t are set to 0 in A
    s_t = max_j |A[t, j]|                 each token's maximum, float32
    P = round(A * 127 / s_t) @ weight.T   int8 products summed in int32 (outlier columns of the input 0)
    y = P * s_t * SCB / 127^2 + b  +  x[:, O] @ (weight[:, O] * SCB / 127).T

A column-parallel layer computes this on its rows (no communication). A row-parallel one
(:class:`RowParallelLLMInt8Linear`) holds some of the input features: each token's maximum is gathered from every
rank (an all-gather of a float a token), the outlier columns are a rank's own, and the integer products and the
outlier products are summed over the ranks in one all-reduce (float64, exact for the integers), the scaling and the
bias applied once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tpcore.cut.split import Split
from tpcore.parallel.comm import all_gather, all_reduce
from tpcore.parallel.quantized_linear import QuantizedLinear

__all__ = ["LLMInt8Linear", "RowParallelLLMInt8Linear"]

#: bitsandbytes' constants: 1 / 127^2 (products to values) and 1 / 127 (values to weights)
_PRODUCT_SCALE = 6.200124e-05
_VALUE_SCALE = 7.874015718698502e-3


class LLMInt8Linear(QuantizedLinear):
    """``nn.Linear`` holding bitsandbytes' 8-bit ``weight`` and ``SCB`` (module docstring); made from an
    ``nn.Linear`` in place by :meth:`hold`."""

    #: a model-wide cast casts the bias, as transformers does; the values stay int8 and ``SCB`` float32
    keeps_stored_dtypes = ("SCB",)
    #: inputs of at least this magnitude are computed in the input's dtype (``llm_int8_threshold``; 0: none)
    threshold: float = 6.0
    SCB: nn.Parameter

    @classmethod
    def hold(cls, linear: nn.Linear, threshold: float) -> LLMInt8Linear:
        """Make ``linear`` (its tensors on meta) hold an int8 ``weight`` and a float32 ``SCB``, in place."""
        linear.__class__ = cls
        assert isinstance(linear, LLMInt8Linear)
        linear.threshold = float(threshold)
        linear.weight = _frozen(torch.empty(linear.out_features, linear.in_features, dtype=torch.int8, device="meta"))
        linear.SCB = _frozen(torch.empty(linear.out_features, dtype=torch.float32, device="meta"))
        return linear

    def follower_cuts(self, split: Split, weight: str = "weight") -> dict[str, Split]:
        """``SCB`` follows the weight's rows; a cut of the columns leaves it whole."""
        return {"SCB": split} if split.dim == 0 else {}

    def token_maxima(self, inputs: torch.Tensor) -> torch.Tensor:
        """``s_t`` of the module docstring, ``(tokens,)`` float32, from the float16 inputs with outliers at 0."""
        return inputs.abs().amax(dim=1).float()

    def parts(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """``(P, s, (x[:, O], O))`` of the module docstring for ``x (..., in_r)``, over this rank's features:
        ``P (tokens, out_r)`` int32, ``s (tokens,)`` float32, the outlier inputs and a mask of their columns."""
        inputs = x.reshape(-1, x.shape[-1])
        halves = inputs.to(torch.float16)
        if self.threshold > 0:
            large = halves.abs() >= self.threshold
            outliers = large.any(dim=0)
            halves = halves.masked_fill(large, 0)
        else:
            outliers = torch.zeros(halves.shape[1], dtype=torch.bool, device=x.device)
        maxima = self.token_maxima(halves)
        values = torch.round(halves * (127.0 / maxima.unsqueeze(-1))).to(torch.int8)
        values[:, outliers] = 0
        return _integer_products(values, self.weight), maxima, (inputs[:, outliers], outliers)

    def scaled(self, products: torch.Tensor, maxima: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``P * s_t * SCB / 127^2 + b`` in ``dtype``."""
        out = products * (maxima.unsqueeze(-1) * self.SCB.unsqueeze(0)) * _PRODUCT_SCALE
        if self.bias is not None:
            out = out + self.bias.to(dtype)
        return out.to(dtype)

    def outlier_weight(self, outliers: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The outlier columns' weights ``(len(O), out_r)`` in ``dtype``, as bitsandbytes dequantizes them."""
        return (self.weight[:, outliers] * self.SCB.view(-1, 1) * _VALUE_SCALE).to(dtype).t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        products, maxima, (outlier_inputs, outliers) = self.parts(x)
        out = self.scaled(products, maxima, x.dtype)
        if outlier_inputs.shape[1]:
            out = out.addmm(outlier_inputs, self.outlier_weight(outliers, x.dtype))
        return out.reshape(*x.shape[:-1], -1)


class RowParallelLLMInt8Linear(LLMInt8Linear):
    """:class:`LLMInt8Linear` holding a shard of the input features (module docstring): the maxima gathered, the
    integer and outlier products all-reduced together, the bias added once."""

    tp_group = None

    def token_maxima(self, inputs: torch.Tensor) -> torch.Tensor:
        gathered = all_gather(inputs.abs().amax(dim=1, keepdim=True), self.tp_group)
        return gathered.amax(dim=1).float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        products, maxima, (outlier_inputs, outliers) = self.parts(x)
        # in float32, as the whole layer's fused product accumulates before its one rounding to x's dtype
        outlier_products = outlier_inputs.float() @ self.outlier_weight(outliers, x.dtype).float()
        out_features = products.shape[1]
        summed = all_reduce(torch.cat([products.double(), outlier_products.double()], dim=1), self.tp_group)
        out = self.scaled(summed[:, :out_features].float(), maxima, x.dtype).float() + summed[:, out_features:]
        return out.to(x.dtype).reshape(*x.shape[:-1], -1)


LLMInt8Linear.row_parallel_class = RowParallelLLMInt8Linear


def _integer_products(values: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``values @ weight.T`` of int8 ``(tokens, in)`` and ``(out, in)``, summed exactly in int32: ``torch._int_mm``
    on an AVX-512 CPU (bitsandbytes' product there), else a float64 product (exact for any layer a model has; torch's
    integer product is a slow scalar loop on other CPUs, and needs 17 rows or more on CUDA)."""
    if values.device.type == "cpu" and torch.backends.cpu.get_cpu_capability() == "AVX512":
        return torch._int_mm(values, weight.t())
    return F.linear(values.double(), weight.double()).to(torch.int32)


def _frozen(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)
