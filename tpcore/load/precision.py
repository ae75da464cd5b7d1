"""Precision of a rank's model: the dtype asked for, and casting to it as ``from_pretrained(dtype=...)`` does.

``fp16=True`` (parallelformers' flag) means the half precision that is fast where the ranks run (measured by the
*Half precision* part of ``bench/peers.py``):

- CUDA ranks, and CPU ranks on a CPU with float16 matrix units (AMX-FP16): ``torch.float16``;
- CPU ranks on a CPU with bfloat16 instructions but no float16 ones (AVX512-BF16, AMX-BF16): ``torch.bfloat16``,
  with a warning. There float16 goes through conversions: a forward pass runs 2.5x slower than fp32, where
  bfloat16 runs 4x faster;
- other CPUs (AVX2): no cast, with a warning. Both half dtypes go through conversions there, a forward pass
  4-7x slower than fp32; only a batch-1 decode step, bound by memory bandwidth, gains (about 1.3x).

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

__all__ = ["cast_dtypes", "cast_model", "fast_cpu_half_dtype", "fp32_patterns", "resolve_dtype"]

HALF_DTYPES = (torch.float16, torch.bfloat16)

logger = logging.getLogger("tpcore.precision")


def resolve_dtype(fp16: bool, dtype: torch.dtype | None, device: str) -> torch.dtype | None:
    """The dtype of ``fp16=`` and ``dtype=`` together for ranks on ``device`` (``"cuda"`` or ``"cpu"``;
    ``None``: no cast); a contradiction raises.

    ``dtype`` wins; ``fp16=True`` alone is ``torch.float16`` on CUDA, and on a CPU the half dtype it computes
    natively (:func:`fast_cpu_half_dtype`): bfloat16 or nothing is said on the ``tpcore`` logger.
    """
    if fp16 and dtype not in (None, torch.float16):
        raise ValueError(f"fp16=True contradicts dtype={dtype}")
    if dtype is not None or not fp16:
        return dtype
    if device == "cuda":
        return torch.float16
    half = fast_cpu_half_dtype()
    if half == torch.bfloat16:
        logger.warning(
            "fp16=True: the CPU ranks run in bfloat16: this CPU computes bfloat16 natively and float16 only "
            "through conversions, several times slower; dtype=torch.float16 casts to float16 anyway"
        )
    elif half is None:
        logger.warning(
            "fp16=True: the CPU ranks keep the model's dtype: this CPU has no half-precision arithmetic, where a "
            "float16 forward runs several times slower; dtype=torch.float16 (or torch.bfloat16) casts anyway, for "
            "the memory"
        )
    return half


def fast_cpu_half_dtype() -> torch.dtype | None:
    """The half dtype this machine's CPU computes faster than fp32: ``torch.float16`` with AMX-FP16 units, else
    ``torch.bfloat16`` with bfloat16 instructions (AVX512-BF16, or AMX tiles, which have bfloat16), else ``None``."""
    if _cpu_has("_is_amx_fp16_supported"):
        return torch.float16
    if _cpu_has("_is_avx512_bf16_supported") or _cpu_has("_is_amx_tile_supported"):
        return torch.bfloat16
    return None


def _cpu_has(probe: str) -> bool:
    check = getattr(torch.cpu, probe, None)  # torch's private feature probes: looked up, absent on old versions
    return bool(check is not None and check())


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
    :func:`fp32_patterns`; non-persistent buffers, integer tensors and the tensors of a module that
    ``keeps_stored_dtypes`` (a quantized layer's values and scales: all of them where it is ``True``, those it
    names where it is a tuple of names) keep their dtype. Parameters keep their identity (``param.data`` is
    replaced), so tied weights stay tied.
    """
    cast_buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (buffer, its cast), both kept alive
    for module, name, tensor, target in _casts(model, dtype):
        if isinstance(tensor, nn.Parameter):
            tensor.data = tensor.data.to(target)
            continue
        if id(tensor) not in cast_buffers:  # a buffer shared by modules stays one tensor
            cast_buffers[id(tensor)] = tensor, tensor.to(target)
        module._buffers[name] = cast_buffers[id(tensor)][1]
    return model


def cast_dtypes(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.dtype]:
    """The dtype :func:`cast_model` would give each tensor it casts, by its first name (``named_tensors``'s), the
    model left as it is (a meta skeleton's plan counts its bytes so)."""
    first_name = {id(tensor): name for name, tensor in reversed([*model.named_parameters(), *model.named_buffers()])}
    return {first_name[id(tensor)]: target for _, _, tensor, target in _casts(model, dtype) if id(tensor) in first_name}


def _casts(model: nn.Module, dtype: torch.dtype):
    """``(module, name, tensor, target dtype)`` of each tensor :func:`cast_model` casts, each parameter once."""
    patterns = fp32_patterns(model, dtype)
    keep_fp32 = re.compile("|".join(f"(?:{p.replace('*', '.*')})" for p in patterns)) if patterns else None
    seen: set[int] = set()
    for module_name, module in model.named_modules(remove_duplicate=False):
        kept = getattr(module, "keeps_stored_dtypes", False)  # quantized values and their scales
        if kept is True:
            continue
        kept = kept or ()
        prefix = f"{module_name}." if module_name else ""
        for name, param in module.named_parameters(recurse=False):
            if id(param) in seen or not param.is_floating_point() or name in kept:
                continue
            seen.add(id(param))
            yield module, name, param, _target(prefix + name, dtype, keep_fp32)
        for name, buffer in list(module._buffers.items()):
            if buffer is None or not buffer.is_floating_point() or name in module._non_persistent_buffers_set:
                continue
            if name not in kept:
                yield module, name, buffer, _target(prefix + name, dtype, keep_fp32)


def _target(name: str, dtype: torch.dtype, keep_fp32: re.Pattern | None) -> torch.dtype:
    return torch.float32 if keep_fp32 is not None and keep_fp32.search(name) else dtype
