"""Linear weights laid out for the CPU's matrix product: ``W [out, in]`` kept as the transpose of a contiguous
``[in, out]`` tensor (the same shape and values, strides ``(1, out)``), in place, so a rank holds the same bytes.

``F.linear(x, W)`` computes ``x @ W.T``. With ``W`` row-major the CPU GEMM (MKL's ``sgemm``) repacks the whole
weight on every call; with ``W.T`` contiguous it streams the weight as it lies. Repacking costs most where the
product is short, the rows of a decode step: ``[8, 576] x [576, 1536]`` takes 0.2 ms instead of 0.4-0.5 ms on
one core of the bench machine, 1 row or a prefill's hundreds about the same either way (``bench/time_breakdown.py``
measures the whole model). The values are the same; a sum may round differently in its last bit, as with any
other GEMM (tokens equal in fp32, logits within tpcore's tolerance: ``tests/parallel/test_cpu_layout.py``).

Only float32 weights of modules whose forward is ``F.linear`` of their ``weight`` (``nn.Linear``, the row-parallel
linear and the vocab-parallel head) are laid out so; a weight tied to an embedding changes for it too (its lookup
reads rows of the transposed table: a gather of a few rows, no product).
"""

from __future__ import annotations

import torch
from torch import nn

from tpcore.parallel.layers import RowParallelLinear, VocabParallelLMHead

__all__ = ["lay_out", "linear_weight_names", "transpose_linear_weights"]

#: forwards that use ``weight`` only as ``F.linear`` does (subclasses with a forward of their own are left alone)
_LINEAR_FORWARDS = (nn.Linear.forward, RowParallelLinear.forward, VocabParallelLMHead.forward)


def linear_weight_names(model: nn.Module) -> set[str]:
    """The names of ``model``'s weights that modules use only as ``F.linear`` does: those :func:`lay_out` may be
    given as they are read (each still checked there)."""
    return {
        f"{name}.weight" if name else "weight"
        for name, module in model.named_modules()
        if type(module).forward in _LINEAR_FORWARDS
    }


def lay_out(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[out, in]`` as the transpose of a contiguous ``[in, out]`` tensor where it is a float32 matrix
    on the CPU, contiguous, neither side 1; else ``weight`` itself."""
    if (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and weight.is_contiguous()
        and min(weight.shape) > 1
    ):
        return weight.t().contiguous().t()
    return weight


def transpose_linear_weights(model: nn.Module) -> int:
    """Lay out ``model``'s float32 linear weights on the CPU as the module docstring says; the number laid out."""
    count = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if type(module).forward in _LINEAR_FORWARDS and isinstance(weight, torch.Tensor):
            data = weight.data
            laid_out = lay_out(data)
            if laid_out is not data:
                weight.data = laid_out  # the same Parameter: ties to it hold
                count += 1
    return count
