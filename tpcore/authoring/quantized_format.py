"""``QuantizedFormat``: how tpcore splits checkpoints stored in one quantized format, as a plugin adds one.

A checkpoint declares its format in ``config.json``'s ``quantization_config`` (``quant_method``). A format
object answers two questions before any weight is read:

- :meth:`QuantizedFormat.check`: does tpcore split this variant of the format (block sizes, activation
  scheme, bit width)? A variant it does not split is refused, naming the checkpoint, before any rank starts.
- :meth:`QuantizedFormat.hold`: the model built empty from the config holds plain float weights; make it
  hold what the files store (a layer at a time, as a quantized layer class of
  :mod:`tpcore.parallel.quantized_linear`), so that the plan counts bytes as stored and each rank reads only its
  part of the quantized tensors.
- :meth:`QuantizedFormat.adopt` (optional): the same for a model object transformers loaded, its tensors kept.

tpcore ships block FP8, compressed-tensors and torchao (:mod:`tpcore.load.quantized_formats`); a plugin returns
more from ``tpcore_register_quantized_formats``, one object per ``quant_method``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from tpcore.errors import ShardingError

__all__ = ["FP8_VALUES", "QuantizedFormat", "refuse_untaken"]

#: the dtypes FP8 checkpoints store their values in
FP8_VALUES = (torch.float8_e4m3fn,)


class QuantizedFormat:
    """One quantized checkpoint format (module docstring). Subclasses set :attr:`quant_method` and
    :attr:`description` and implement :meth:`hold` (and :meth:`check` where some variants do not split)."""

    #: the ``quantization_config.quant_method`` this format reads
    quant_method: ClassVar[str] = ""
    #: what the format stores, for messages and ``tpcore plugins``
    description: ClassVar[str] = ""
    #: the modules a rank imports to compute the format's layers (a kernel library): imported while the ranks start,
    #: beside the caller's planning, so that their first forward does not wait for them
    rank_modules: ClassVar[tuple[str, ...]] = ()

    def check(self, quantization: dict[str, Any], where: str) -> None:
        """Raise :class:`~tpcore.ShardingError` naming ``where`` for a variant of the format that is not split."""

    def adopt(self, model: nn.Module, quantization: dict[str, Any]) -> int:
        """Make a model object that transformers loaded in this format hold its quantized layers as tpcore's, in
        place, with their own tensors; the number of layers made. The default makes none: a model whose weights
        are still quantized is then refused."""
        return 0

    def hold(self, model: nn.Module, checkpoint: Any, quantization: dict[str, Any]) -> int:
        """Make the meta ``model`` hold the tensors ``checkpoint`` (a :class:`~tpcore.load.checkpoint.Checkpoint`)
        stores in this format; the number of layers made. Raise :class:`~tpcore.ShardingError` naming a stored
        tensor that no layer takes."""
        raise NotImplementedError(f"{type(self).__name__} holds no layers")


def refuse_untaken(keys: set[str], verb: str, form: str) -> None:
    """Raise :class:`ShardingError` naming the first of the stored ``keys`` no layer took."""
    if keys:
        first = min(keys)
        raise ShardingError(
            f"{first!r} {verb} a tensor that tpcore does not split in {form} yet (only linear layers' weights; "
            f"{len(keys)} such tensors)"
        )
