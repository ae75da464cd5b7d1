"""Models that carry unmerged adapters (PEFT's LoRA and its kin): refused before any rank starts.

An unmerged LoRA adds ``B(A(x))`` beside a layer the plan may cut; its ``A`` and ``B`` would have to follow
the base layer's cut, which no policy says today. Merged (``merge_and_unload()``) the adapter is part of the
base weights and splits with them. A PEFT adapter directory (``adapter_config.json``, no model of its own) is
refused with the same advice.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from torch import nn

__all__ = ["refuse_unmerged_adapters"]

#: what PEFT layers that add a low-rank update beside the base layer hold
_ADAPTER_ATTRIBUTES = ("lora_A", "lora_B", "lora_embedding_A", "lora_magnitude_vector")
_ADVICE = (
    "merge the adapter into the base model first (model = model.merge_and_unload(), then save_pretrained if you "
    "load from a directory) and parallelize that"
)


def refuse_unmerged_adapters(model: nn.Module | str | os.PathLike | Any) -> None:
    """Raise ``ValueError`` naming the first layer that holds an unmerged adapter (or the adapter directory)."""
    if isinstance(model, (str, os.PathLike)):
        directory = Path(model)
        if (directory / "adapter_config.json").is_file() and not (directory / "config.json").is_file():
            raise ValueError(f"{directory} holds a PEFT adapter, not a model: {_ADVICE}")
        return
    if not isinstance(model, nn.Module):
        return
    for name, module in model.named_modules():
        if any(isinstance(getattr(module, attribute, None), nn.Module) for attribute in _ADAPTER_ATTRIBUTES):
            raise ValueError(
                f"{type(model).__name__} holds an unmerged adapter in {name} ({type(module).__name__}), which tpcore "
                f"does not split with its layer: {_ADVICE}"
            )
