"""Fused MoE experts stored in MXFP4 (gpt-oss): a rank's shard of each expert's blocks, dequantized per forward.

MXFP4 keeps each expert's weight ``(out, in)`` in blocks of 32 values along ``in``, each block one e8m0 scale and 32
e2m1 codes two a byte (low nibble first)::

    {proj}_blocks  uint8  (E, out, in / 32, 16)    codes
    {proj}_scales  uint8  (E, out, in / 32)        exponents + 127
    W[e, o, 32 g + k] = FP4[code(e, o, g, k)] * 2 ** (scales[e, o, g] - 127)

and the plain experts module holds ``W`` transposed, ``gate_up_proj (E, H, 2I)`` and ``down_proj (E, I, H)``. A policy's
cut of those is a cut of the blocks: ``gate_up_proj``'s output features are the blocks' rows (dim 1, scales with them),
``down_proj``'s input features the blocks themselves (dim 2, whole blocks of 32: a rank's intermediate features come
in runs of 32, in ``gate_up_proj`` too). :class:`Mxfp4Experts` (a
:class:`~tpcore.parallel.quantized_experts.QuantizedExperts`) holds the codes in place of the plain weights (so a
policy's ``Layer(weight="gate_up_proj")`` names them) and, for each forward, dequantizes the experts the tokens are
routed to into the plain layout, in the model's dtype, as transformers does at load where it has no MXFP4 kernel (a
CPU): the same values, bit for bit.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from tpcore.cut.split import Split
from tpcore.parallel.quantized_experts import PROJECTIONS, QuantizedExperts

__all__ = ["FP4_VALUES", "MXFP4_BLOCK", "Mxfp4Experts", "dequantize_mxfp4"]

#: the e2m1 value of each 4-bit code (sign in the high bit)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
#: values a scale covers
MXFP4_BLOCK = 32


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(..., G, 16)`` codes and ``(..., G)`` exponents as ``(..., 32 G)`` values in ``dtype``: each byte's two values
    looked up at once (:func:`_byte_values`), times the block's power of two in float32 (exact), rounded once to
    ``dtype``: transformers' values (its ``ldexp`` in ``dtype`` promotes to float32 the same way), without ``ldexp``'s
    element-wise power."""
    pairs = _byte_values(blocks.device).index_select(0, blocks.reshape(-1).long())  # one 8-byte gather a byte
    values = pairs.view(torch.float32).view(*blocks.shape[:-1], 2 * blocks.shape[-1])
    powers = torch.exp2(scales.float() - 127).unsqueeze(-1)
    return values.mul_(powers).to(dtype).flatten(-2)


@functools.cache
def _byte_values(device: torch.device) -> torch.Tensor:
    """``(256,)`` int64: the two e2m1 values of each byte as float32, its low nibble's first, in one 8-byte word."""
    table = torch.tensor(FP4_VALUES)
    codes = torch.arange(256)
    pairs = torch.stack([table[codes & 0x0F], table[codes >> 4]], dim=-1)
    return pairs.contiguous().view(torch.int64).view(256).to(device)


class Mxfp4Experts(QuantizedExperts):
    """Mixin before a fused experts class (gpt-oss's ``GptOssExperts``): ``gate_up_proj`` and ``down_proj`` hold
    MXFP4 codes ``(E, out, in / 32, 16)`` beside ``{proj}_scales`` (module docstring); each forward runs the class's
    own forward on the routed experts' weights dequantized into ``(E, in, out)``, the others zeros."""

    keeps_stored_dtypes = tuple(name for projection in PROJECTIONS for name in (projection, f"{projection}_scales"))
    #: values one stored element holds along each dimension of the codes: a block of 32 along dim 2
    packing = (1, 1, MXFP4_BLOCK, 2)
    companions = tuple(f"{projection}_scales" for projection in PROJECTIONS)

    def hold(self, scale_shapes: dict[str, tuple[int, ...]], prefix: str) -> None:
        """Make the meta plain experts hold codes and scales in place of ``gate_up_proj`` and ``down_proj``, read from
        ``{prefix}{proj}_blocks`` and ``{prefix}{proj}_scales``."""
        self.stored_as = {projection: f"{prefix}{projection}_blocks" for projection in PROJECTIONS}
        for projection in PROJECTIONS:
            experts, in_features, out_features = getattr(self, projection).shape
            if in_features % MXFP4_BLOCK:
                raise ValueError(f"{projection}: {in_features} input features are not whole blocks of {MXFP4_BLOCK}")
            blocks = (experts, out_features, in_features // MXFP4_BLOCK)
            if tuple(scale_shapes[projection]) != blocks:
                raise ValueError(f"{projection}'s scales are {tuple(scale_shapes[projection])}, not {blocks}")
            codes = torch.empty(*blocks, MXFP4_BLOCK // 2, dtype=torch.uint8, device="meta")
            setattr(self, projection, nn.Parameter(codes, requires_grad=False))
            scales = torch.empty(blocks, dtype=torch.uint8, device="meta")
            setattr(self, f"{projection}_scales", nn.Parameter(scales, requires_grad=False))

    def stored_split(self, split: Split, weight: str = "weight") -> Split:
        """A cut of the plain ``(E, in, out)`` weight as a cut of its codes ``(E, out, in / 32, 16)``."""
        dim = split.resolved(3).dim
        return split._replace(dim=(0, 2, 1)[dim])

    def follower_cuts(self, split: Split, weight: str = "weight") -> dict[str, Split]:
        """A projection's scales ``(E, out, in / 32)`` are cut as its codes (their first three dims)."""
        return {f"{weight}_scales": split}

    def dequantized(self, projection: str, experts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The plain ``(n, in_r, out_r)`` weight of ``projection`` for the ``n`` ``experts``, in ``dtype``."""
        codes, scales = self._parameters[projection], self._parameters[f"{projection}_scales"]
        assert codes is not None and scales is not None
        return dequantize_mxfp4(codes[experts], scales[experts], dtype).transpose(1, 2).contiguous()
