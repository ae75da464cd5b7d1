"""I-BERT: QuantLinear layers, integer-mode row layers quantized by their range over every rank."""

from __future__ import annotations

import itertools

import torch
from torch import nn

from tp_bert.bert import BertPolicy
from tpcore import COLUMN, ROW, Layer, Style, all_gather, linear, reduce_partial_sums, subclassing, transformers_class


@subclassing("RowParallel")
def row_parallel_quant_linear(base: type) -> dict:
    """For I-BERT's ``QuantLinear`` as a row-parallel layer (it returns ``(output, scaling factor)``).
    Float mode: ``sum_r x_r W_r^T + b``. Integer mode: the weight's scale per output row comes from
    the row's minimum and maximum over all ranks' columns (so every rank quantizes as the unsplit
    layer), then ``(sum_r x_int,r W_int,r^T + b_int) * s_w * s_x``, the sum all-reduced."""
    from transformers.models.ibert.quant_modules import symmetric_linear_quantization_params

    def extreme(values: torch.Tensor, group, largest: bool) -> torch.Tensor:
        every = all_gather(values[None], group, dim=0)  # [ranks, rows]
        return every.amax(0) if largest else every.amin(0)

    def forward(self, x: torch.Tensor, prev_act_scaling_factor: torch.Tensor | None = None):
        if not self.quant_mode:
            out = reduce_partial_sums(nn.functional.linear(x, self.weight), self.tp_group)
            return (out if self.bias is None else out + self.bias), None
        weight = self.weight.detach()
        rows = (weight.amin(1), weight.amax(1)) if self.per_channel else (weight.min()[None], weight.max()[None])
        w_min, w_max = extreme(rows[0], self.tp_group, False), extreme(rows[1], self.tp_group, True)
        self.fc_scaling_factor = symmetric_linear_quantization_params(self.weight_bit, w_min, w_max, self.per_channel)
        self.weight_integer = self.weight_function(
            self.weight, self.weight_bit, self.percentile_mode, self.fc_scaling_factor
        )
        bias_scaling_factor = self.fc_scaling_factor * prev_act_scaling_factor
        x_int = x / prev_act_scaling_factor.view(1, -1)
        out = reduce_partial_sums(nn.functional.linear(x_int, self.weight_integer), self.tp_group)
        if self.bias is not None:
            self.bias_integer = self.weight_function(self.bias, self.bias_bit, False, bias_scaling_factor)
            out = out + self.bias_integer
        return out * bias_scaling_factor, bias_scaling_factor

    return {"forward": forward, "tp_group": None}


def _quant_linear(path: str, style: Style, **heads) -> list[Layer]:
    """A ``QuantLinear`` at ``path`` cut in ``style`` (``COLUMN`` or ``ROW``): its weight and bias, and the
    integer copies and scales it keeps beside them (recomputed by each integer-mode forward), cut alike."""
    if style is COLUMN:
        kept = [Layer(weight=f"{path}.{name}", style=COLUMN, **heads) for name in ("weight_integer", "bias_integer")]
        scales = Layer(weight=f"{path}.fc_scaling_factor", style=COLUMN, **heads)
        return [linear(path, style=COLUMN, **heads), *kept, scales]
    row = {"style": ROW, "replace": row_parallel_quant_linear, **heads}
    return [linear(path, **row), Layer(weight=f"{path}.weight_integer", **row)]


class IBertPolicy(BertPolicy):
    """I-BERT: BERT's layout in ``QuantLinear`` layers, in float or integer mode (``quant_mode``). Column
    layers quantize each output row by its own range, as unsplit; row layers take each row's range
    over every rank (:func:`row_parallel_quant_linear`). The activations' quantizers keep whole-tensor
    ranges, the integer GELU, softmax and layer norm see what they see unsplit."""

    layer_class = transformers_class("ibert", "IBertLayer")

    @classmethod
    def layers(cls):
        projections = [
            _quant_linear(f"attention.self.{name}", COLUMN, heads=cls.heads) for name in ("query", "key", "value")
        ]
        output = _quant_linear("attention.output.dense", ROW, heads=cls.heads)
        mlp = [*_quant_linear("intermediate.dense", COLUMN), *_quant_linear("output.dense", ROW)]
        return [*itertools.chain.from_iterable(projections), *output, *mlp]
