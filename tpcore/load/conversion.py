"""Which checkpoint keys make each model tensor: transformers' own checkpoint conversion, applied lazily.

transformers 5 saves some models under legacy key names and converts them on load
(``transformers.conversion_mapping``): renames (ViT's ``encoder.layer.0.attention.attention.query``
is the model's ``layers.0.attention.q_proj``), and converters that merge per-expert tensors into
fused ones. This module asks transformers which source keys make which model tensor, by which
operations, and describes each model tensor as a :class:`Sources` that a rank reads piece by piece.

The operations read lazily (only the pieces a rank's slice covers) are these, in this order::

    MergeModulelist(dim=s)   each source pattern's keys (in load order) stacked along a new dim s
    Concatenate(dim=c)       the source patterns' tensors concatenated along dim c

so a fused expert tensor is ``cat_c([stack_s(gate_0 .. gate_E), stack_s(up_0 .. up_E)])``: its
``(E, 2I, H)`` rows ``[a, b)`` are rows ``[a, b)`` of every gate or up source they fall in. Any other
operation is run by transformers' own converter on the whole sources (see :class:`Converted`).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

__all__ = ["Converted", "Sources", "TargetShapes", "combined_shape", "model_sources"]


class Converted(NamedTuple):
    """A model tensor that transformers' ``converter`` makes by operations tpcore does not read lazily:
    the rank reads the sources whole, runs the converter, and cuts the result."""

    converter: Any  # a transformers WeightConverter (pickled to the ranks)
    patterns: tuple[str, ...]  # the converter's source pattern of each group of keys
    layer_name: str  # the name transformers converts under (its first target)
    output: str  # this tensor's name among the converter's outputs
    config: Any  # the model config, for operations that read it
    target_shapes: tuple[tuple[str, tuple[int, ...]], ...]  # the whole model tensors, for operations that ask


class Sources(NamedTuple):
    """The checkpoint keys of one model tensor and how they combine (see the module docstring)."""

    keys: tuple[tuple[str, ...], ...]  # groups of keys, one group per source pattern, in load order
    stack_dim: int | None = None  # each group's tensors stacked along this new dim; None: one key per group
    cat_dim: int | None = None  # groups concatenated along this dim; None: one group
    converted: Converted | None = None  # set: read whole and converted by transformers (fallback)
    view: tuple[int, ...] | None = None  # set: the one stored tensor read as this shape (row-major, same elements)

    @property
    def all_keys(self) -> list[str]:
        return [key for group in self.keys for key in group]


def combined_shape(sources: Sources, shapes: Sequence[Sequence[Sequence[int]]]) -> tuple[int, ...]:
    """The shape of the tensor ``sources`` make from stored tensors of ``shapes`` (grouped as ``sources.keys``)."""
    if sources.view is not None:
        return tuple(sources.view)
    group_shapes = []
    for group in shapes:
        shape = list(group[0])
        if sources.stack_dim is not None:
            shape.insert(sources.stack_dim, len(group))
        group_shapes.append(shape)
    shape = group_shapes[0]
    if sources.cat_dim is not None:
        shape[sources.cat_dim] = sum(group[sources.cat_dim] for group in group_shapes)
    return tuple(shape)


def model_sources(model: nn.Module, stored: Iterable[str], aliases: Mapping[str, Any]) -> dict[str, Sources]:
    """The sources of every model tensor that the ``stored`` checkpoint keys make, by the model's name for it.

    ``aliases`` holds every name of the model's tensors (tied ones under each of their names). Keys are
    renamed as ``from_pretrained`` renames them: transformers' conversion mapping for the model and its
    sub-models, then the ``base_model_prefix`` added or removed where that names a model tensor.
    A key that names no model tensor is left out.
    """
    api = _transformers_api()
    if api is None or not _is_pretrained(model):
        return _by_prefix(model, stored, aliases)
    get_model_conversion_mapping, rename_source_key, dot_natural_key, weight_converter = api
    mapping = get_model_conversion_mapping(model)
    renamings = [entry for entry in mapping if not isinstance(entry, weight_converter)]
    converters = [entry for entry in mapping if isinstance(entry, weight_converter)]
    converters += _companion_converters(converters, aliases)
    by_pattern = {pattern: converter for converter in converters for pattern in converter.source_patterns}
    prefix = getattr(model, "base_model_prefix", "") or ""
    plain: dict[str, str] = {}
    merged: dict[str, tuple[Any, dict[str, list[str]]]] = {}
    for key in sorted(stored, key=dot_natural_key):  # the order from_pretrained collects them in
        name, pattern = rename_source_key(key, renamings, converters, prefix, aliases)
        if name not in aliases and key in aliases:  # as from_pretrained: a key already in the model's names
            name, pattern = rename_source_key(key, [], [], prefix, aliases)
        if pattern is None:
            if name in aliases:
                plain.setdefault(name, key)
            continue
        converter = by_pattern[pattern]
        merged.setdefault(name, (converter, {}))[1].setdefault(pattern, []).append(key)
    sources = {name: Sources(((key,),)) for name, key in plain.items()}
    for first, (converter, groups) in merged.items():
        patterns = [pattern for pattern in converter.source_patterns if pattern in groups]
        keys = tuple(tuple(groups[pattern]) for pattern in patterns)
        targets = [first.replace(converter.target_patterns[0], target, 1) for target in converter.target_patterns]
        lazy = _lazy_layout(converter) if len(targets) == 1 else None
        if lazy is not None and lazy[0] is None and any(len(group) != 1 for group in keys):
            lazy = None  # concatenating lists of tensors: not a layout read lazily here
        if lazy is not None and first in aliases:
            sources.setdefault(first, Sources(keys, *lazy))
            continue
        # FALLBACK (correct, not lazy): an operation tpcore does not interpret; the rank reads the sources whole
        # and transformers' converter makes the tensor, which the rank then cuts.
        shapes = tuple((target, tuple(aliases[target].shape)) for target in targets if target in aliases)
        for target, _ in shapes:
            converted = Converted(copy.deepcopy(converter), tuple(patterns), first, target, model.config, shapes)
            sources.setdefault(target, Sources(keys, converted=converted))
    return sources


#: the tensors a quantized weight is stored with that a model holding them merges as it merges the weight: block FP8's
#: scales (``experts.*.gate_proj.weight_scale_inv`` into ``experts.gate_up_proj_scale_inv``)
_COMPANIONS = ("_scale_inv",)


def _companion_converters(converters: Sequence[Any], aliases: Mapping[str, Any]) -> list[Any]:
    """A copy of each converter of weights for each companion (:data:`_COMPANIONS`) the model holds beside its target,
    with the companion's suffix on its source and target patterns: the scales are merged as the weights are."""
    names = "\n".join(aliases)
    copies = []
    for converter in converters:
        sources = getattr(converter, "_original_source_patterns", converter.source_patterns)
        targets = getattr(converter, "_original_target_patterns", converter.target_patterns)
        if not hasattr(converter, "copy") or not all(source.endswith(".weight") for source in sources):
            continue
        for suffix in _COMPANIONS:
            if re.search(f"{targets[0]}{suffix}$", names, re.MULTILINE):
                patterns = ([source + suffix for source in sources], [target + suffix for target in targets])
                copies.append(converter.copy(*patterns, operations=list(converter.operations)))
    return copies


def _lazy_layout(converter) -> tuple[int | None, int | None] | None:
    """``(stack_dim, cat_dim)`` when ``converter`` only stacks and/or concatenates, else ``None``."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    if getattr(converter, "quantization_operation", None) is not None:
        return None
    operations = list(converter.operations)
    stack = cat = None
    if operations and type(operations[0]) is MergeModulelist:
        stack = operations.pop(0).dim
    if operations and type(operations[0]) is Concatenate:
        cat = operations.pop(0).dim
    if operations or (stack is None and cat is None):
        return None
    if stack is None and cat is not None:  # each group is then one key: Concatenate of single tensors
        return None if len(converter.source_patterns) < 2 else (None, cat)
    if stack is not None and cat is None and len(converter.source_patterns) != 1:
        return None
    return stack, cat


def _transformers_api():
    """transformers' conversion functions (5.x), or ``None`` where this transformers has none."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, dot_natural_key, rename_source_key
    except ImportError:
        return None
    return get_model_conversion_mapping, rename_source_key, dot_natural_key, WeightConverter


def _is_pretrained(model: nn.Module) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(model, PreTrainedModel)


def _by_prefix(model: nn.Module, stored: Iterable[str], aliases: Mapping[str, Any]) -> dict[str, Sources]:
    """Without a conversion mapping: each model tensor under its own name, with or without the base model prefix."""
    stored = set(stored)
    prefix = getattr(model, "base_model_prefix", "") or ""
    sources = {}
    for name in aliases:
        candidates = [name]
        if prefix:
            candidates.append(name[len(prefix) + 1 :] if name.startswith(prefix + ".") else f"{prefix}.{name}")
        found = next((key for key in candidates if key in stored), None)
        if found is not None:
            sources[name] = Sources(((found,),))
    return sources


class TargetShapes:
    """A stand-in for the model in a converter's operations that ask it for a target's (whole) shape."""

    def __init__(self, shapes: Iterable[tuple[str, Sequence[int]]]):
        self.shapes = dict(shapes)

    def get_parameter(self, name: str) -> torch.Tensor:
        return torch.empty(tuple(self.shapes[name]), device="meta")
