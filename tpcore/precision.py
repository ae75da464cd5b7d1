"""Precision of a rank's model: the dtype asked for, and casting to it as ``from_pretrained(dtype=...)`` does.

``fp16=True`` (parallelformers' flag) means half precision where it is fast: ``torch.float16`` for CUDA
ranks, and for CPU ranks on a CPU with float16 matrix units (AMX-FP16). Other CPUs compute float16 through
conversions: on an AVX2 CPU a forward pass runs 4-7 times slower than in fp32, and only a batch-1 decode
step, bound by memory bandwidth, gains (about 1.3x; the *Half precision* part of ``bench/peers.py``).
There ``fp16=True`` casts nothing (the ranks run the model in its own dtype) and a warning says so.
``dtype=`` is always taken as given (``torch.float16`` or ``torch.bfloat16`` halve the memory on any CPU).

``model.to(dtype)`` casts every floating tensor. ``from_pretrained(dtype=...)`` instead casts the
floating parameters and persistent buffers (the state dict), except those of the modules a model
keeps in fp32 (``_keep_in_fp32_modules`` when the dtype is fp16, ``_keep_in_fp32_modules_strict``
for fp16 and bf16: T5's ``wo``, MoE routers), and leaves non-persistent buffers (rotary
``inv_freq``) as their constructor made them. :func:`cast_model` does the same to a model in memory.
"""

from __future__ import annotations

import logging
import re

import torch
from torch import nn

__all__ = ["cast_model", "float16_is_fast", "fp32_patterns", "resolve_dtype"]

HALF_DTYPES = (torch.float16, torch.bfloat16)

logger = logging.getLogger(__name__)


def resolve_dtype(fp16: bool, dtype: torch.dtype | None, device: str) -> torch.dtype | None:
    """The dtype of ``fp16=`` and ``dtype=`` together for ranks on ``device`` (``"cuda"`` or ``"cpu"``;
    ``None``: no cast); a contradiction raises.

    ``dtype`` wins; ``fp16=True`` alone is ``torch.float16``, except on a CPU without float16 arithmetic
    (:func:`float16_is_fast`), where it casts nothing and says so on the ``tpcore`` logger.
    """
    if fp16 and dtype not in (None, torch.float16):
        raise ValueError(f"fp16=True contradicts dtype={dtype}")
    if dtype is not None or not fp16:
        return dtype
    if device == "cuda" or float16_is_fast():
        return torch.float16
    logger.warning(
        "fp16=True: the CPU ranks keep the model's dtype: this CPU has no float16 arithmetic, where a float16 "
        "forward runs several times slower; dtype=torch.float16 (or torch.bfloat16) casts anyway, for the memory"
    )
    return None


def float16_is_fast() -> bool:
    """Whether this machine's CPU computes in float16 faster than in fp32 (AMX-FP16 matrix units)."""
    amx_fp16 = getattr(torch.cpu, "_is_amx_fp16_supported", None)  # private, feature-detected
    return bool(amx_fp16 is not None and amx_fp16())


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
