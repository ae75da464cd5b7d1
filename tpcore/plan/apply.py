"""Applying a plan: a copy of the model becomes one rank's shard, in place.

Here the plan's styles become modules: a ``ROW`` module takes the row-parallel class of its type
(:func:`~tpcore.parallel.layers.row_parallel_class`), a ``NORM`` module the column-split norm
(:func:`~tpcore.parallel.layers.column_split_norm_class`), a vocabulary module its vocab-parallel class.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tpcore.authoring import NORM, ROW, Style
from tpcore.cut.shares import resolve
from tpcore.errors import ShardingError
from tpcore.load.skeleton import named_tensors
from tpcore.parallel.layers import column_split_norm_class, make_vocab_parallel, row_parallel_class, set_layer_size
from tpcore.parallel.quantized_linear import QuantizedLayer
from tpcore.plan.paths import join, set_path
from tpcore.plan.shard_plan import Replacement, ShardPlan

__all__ = ["apply_plan", "class_for"]

#: the module class each style that changes its module gives (the others change only its tensors)
_STYLE_CLASSES = {ROW: row_parallel_class, NORM: column_split_norm_class}


def class_for(module: nn.Module | None, rule: Replacement) -> type[nn.Module] | None:
    """The class ``rule`` gives ``module``: its style's parallel module (``ROW``, ``NORM``), the class it
    names, or what a function of the module gives (``None``: leave the module as it is; a function is
    given ``None`` where the layer has no such module)."""
    if isinstance(rule, Style):
        if module is None or rule not in _STYLE_CLASSES:
            raise ShardingError(f"a {rule} style gives no module class to {module!r}")
        return _STYLE_CLASSES[rule](module)
    if isinstance(rule, type):
        return rule
    return rule(module)


def apply_plan(
    plan: ShardPlan, model: nn.Module, rank: int, tp_group: Any = None, *, gather_logits: bool = True
) -> nn.Module:
    """Make ``model`` (a copy of the one ``plan`` was built from) rank ``rank``'s shard, in place.

    Tensors are sliced (a meta tensor only changes shape; ties stay ties), module sizes follow them,
    attributes take the rank's values, modules their new classes (one declaring ``tp_group`` gets
    ``tp_group``), vocabulary-parallel modules their rows. Returns ``model``.
    """
    if not 0 <= rank < plan.world_size:
        raise ValueError(f"rank {rank} is outside a world of {plan.world_size}")
    _slice_tensors(plan, model, rank)
    _tell_quantized_cuts(plan, model)
    for path in plan.resized:
        set_layer_size(model.get_submodule(path))
    for path, value in plan.attributes.items():
        set_path(model, path, resolve(value, rank))
    for path, rule in plan.replacements.items():
        module = model.get_submodule(path)
        new_class = class_for(module, rule)
        if new_class is not None:
            module.__class__ = new_class
            if hasattr(new_class, "tp_group"):
                module.tp_group = tp_group
    for path, vocab_size in plan.vocab.items():
        module = model.get_submodule(path)
        rows = int(module.weight.shape[0])  # type: ignore[index]
        make_vocab_parallel(module, tp_group, rank * rows, vocab_size, gather_logits)
    return model


def _tell_quantized_cuts(plan: ShardPlan, model: nn.Module) -> None:
    """Give each quantized layer the cuts of its own tensors (the same on every rank), so that a rank finds what
    its shard needs beside it, such as scale blocks (:func:`~tpcore.parallel.quantized_linear.localize_quantized`)."""
    for path, module in model.named_modules():
        if isinstance(module, QuantizedLayer):
            own = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
            cut = {name: join(path, name) for name, _ in own if join(path, name) in plan.splits}
            module.cuts = {name: plan.splits[full].resolved(len(plan.shapes[full])) for name, full in cut.items()}


def _slice_tensors(plan: ShardPlan, model: nn.Module, rank: int) -> None:
    """Replace every cut tensor's data with rank ``rank``'s slice (identity and ties kept)."""
    tensors = named_tensors(model)
    for name, split in plan.splits.items():
        tensor = tensors.get(name)
        if tensor is None or tuple(tensor.shape) != plan.shapes[name]:
            found = "missing" if tensor is None else f"of shape {tuple(tensor.shape)}"
            raise ValueError(
                f"this plan of {plan.model_name} cuts {name!r} of shape {plan.shapes[name]}, "
                f"which the model it is applied to has {found}"
            )
        with torch.no_grad():
            tensor.data = split.shard(tensor.data, rank, plan.world_size)
