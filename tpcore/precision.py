"""Precision of a rank's model: the dtype asked for, and casting to it as ``from_pretrained(dtype=...)`` does.

``model.to(dtype)`` casts every floating tensor. ``from_pretrained(dtype=...)`` instead casts the
floating parameters and persistent buffers (the state dict), except those of the modules a model
keeps in fp32 (``_keep_in_fp32_modules`` when the dtype is fp16, ``_keep_in_fp32_modules_strict``
for fp16 and bf16: T5's ``wo``, MoE routers), and leaves non-persistent buffers (rotary
``inv_freq``) as their constructor made them. :func:`cast_model` does the same to a model in memory.
"""

from __future__ import annotations

import re

import torch
from torch import nn

__all__ = ["cast_model", "fp32_patterns", "resolve_dtype"]

HALF_DTYPES = (torch.float16, torch.bfloat16)


def resolve_dtype(fp16: bool, dtype: torch.dtype | None) -> torch.dtype | None:
    """The dtype of ``fp16=`` and ``dtype=`` together (``fp16=True`` is ``torch.float16``); a contradiction raises."""
    if fp16 and dtype not in (None, torch.float16):
        raise ValueError(f"fp16=True contradicts dtype={dtype}")
    return torch.float16 if fp16 else dtype


def fp32_patterns(model: nn.Module, dtype: torch.dtype) -> list[str]:
    """The name patterns of the tensors ``from_pretrained(dtype=dtype)`` keeps in fp32 for ``model``
    (transformers' ``_get_dtype_plan``: searched anywhere in a tensor's name, ``*`` for any text)."""
    patterns: set[str] = set()
    for module in model.modules():  # transformers gathers the sub-models' lists into the top model's
        if dtype == torch.float16:
            patterns.update(getattr(module, "_keep_in_fp32_modules", None) or ())
        if dtype in HALF_DTYPES:
            patterns.update(getattr(module, "_keep_in_fp32_modules_strict", None) or ())
    return sorted(patterns)


def cast_model(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast ``model`` in place as ``from_pretrained(dtype=dtype)`` would have loaded it; returns it.

    Floating parameters and persistent buffers become ``dtype``, or fp32 where their name matches
    :func:`fp32_patterns`; non-persistent buffers and integer tensors keep their dtype. Parameters
    keep their identity (``param.data`` is replaced), so tied weights stay tied.
    """
    patterns = fp32_patterns(model, dtype)
    keep_fp32 = re.compile("|".join(f"(?:{p.replace('*', '.*')})" for p in patterns)) if patterns else None
    seen: set[int] = set()
    cast_buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (buffer, its cast), both kept alive
    for module_name, module in model.named_modules(remove_duplicate=False):
        prefix = f"{module_name}." if module_name else ""
        for name, param in module.named_parameters(recurse=False):
            if id(param) in seen or not param.is_floating_point():
                continue
            seen.add(id(param))
            param.data = param.data.to(_target(prefix + name, dtype, keep_fp32))
        for name, buffer in list(module._buffers.items()):
            if buffer is None or not buffer.is_floating_point() or name in module._non_persistent_buffers_set:
                continue
            if id(buffer) not in cast_buffers:  # a buffer shared by modules stays one tensor
                cast_buffers[id(buffer)] = buffer, buffer.to(_target(prefix + name, dtype, keep_fp32))
            module._buffers[name] = cast_buffers[id(buffer)][1]
    return model


def _target(name: str, dtype: torch.dtype, keep_fp32: re.Pattern | None) -> torch.dtype:
    return torch.float32 if keep_fp32 is not None and keep_fp32.search(name) else dtype
