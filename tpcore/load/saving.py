"""Writing a model whose weights come a group at a time: a ``save_pretrained`` directory (safetensors files
and their index, the config, the generation config) without one process ever holding the whole model."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

__all__ = ["save_gathered", "stored_keys"]


def stored_keys(model: nn.Module) -> dict[str, str]:
    """``{tensor name: stored key}`` of the tensors that ``model``'s quantized layers hold under other names than
    their format's files use (their ``stored_as``: MXFP4 experts' codes in ``gate_up_proj``, stored as
    ``gate_up_proj_blocks``), so that a saved directory names them as the format does."""
    return {
        f"{path}.{name}" if path else name: key
        for path, module in model.named_modules()
        for name, key in getattr(module, "stored_as", {}).items()
    }


def save_gathered(model: nn.Module, groups: Iterable[dict[str, torch.Tensor]], directory: str | os.PathLike) -> None:
    """Write each group of whole tensors (``{name: tensor}``, by first names) as one safetensors file of
    ``directory``, then the index (several files) and ``model``'s config and generation config, as
    ``save_pretrained`` lays them out: ``from_pretrained`` and ``tpcore.parallelize(directory)`` read it."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    written: list[tuple[str, list[str], int]] = []
    for index, group in enumerate(groups):
        name = f"model-part-{index:05d}.safetensors"
        save_file({key: tensor.contiguous() for key, tensor in group.items()}, directory / name, {"format": "pt"})
        written.append((name, list(group), sum(t.numel() * t.element_size() for t in group.values())))
    if len(written) == 1:
        (directory / written[0][0]).rename(directory / "model.safetensors")
    else:
        total = len(written)
        weight_map = {}
        for index, (name, keys, _) in enumerate(written):
            final = f"model-{index + 1:05d}-of-{total:05d}.safetensors"
            (directory / name).rename(directory / final)
            weight_map.update(dict.fromkeys(keys, final))
        index_file = {"metadata": {"total_size": sum(size for *_, size in written)}, "weight_map": weight_map}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index_file, indent=2))
    config = getattr(model, "config", None)
    if config is not None:
        config.architectures = [type(model).__name__]
        config.save_pretrained(directory)
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None and getattr(model, "can_generate", lambda: False)():
        generation_config.save_pretrained(directory)
