"""Shard-on-load: each rank reads only its own slices of a saved checkpoint.

A checkpoint is a directory as ``save_pretrained`` writes it: ``config.json`` and the weights in
safetensors, one ``model.safetensors`` or shards listed by ``model.safetensors.index.json``. The
files are memory-mapped and sliced lazily, so a rank copies only the rows or columns it holds, into
memory of its own (the model never keeps a view of a file, which could change under it).
Pickle checkpoints (``pytorch_model.bin``, sharded or not) are opened with ``weights_only=True``
(no code in them runs) and memory-mapped where their format allows.

Which slice a rank reads is the :class:`~tpcore.slicer.Split` the policies give the tensor, so a
tensor read from a file equals the one :func:`~tpcore.slicer.shard` cuts from the whole tensor.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tpcore.skeleton import install_tensors
from tpcore.slicer import Split, shard, shard_ranges

__all__ = ["Checkpoint", "Read", "is_checkpoint_path"]

SAFETENSORS = ("model.safetensors.index.json", "model.safetensors")
PICKLE = ("pytorch_model.bin.index.json", "pytorch_model.bin")

#: one tensor of a model to fill: its name in the model, its key in the checkpoint, how it is cut
Read = tuple[str, str, Split | None]


def is_checkpoint_path(obj: Any) -> bool:
    """Whether ``obj`` names a checkpoint directory rather than being a model."""
    return isinstance(obj, (str, os.PathLike))


class Checkpoint:
    """The weight files of a saved model directory, by tensor key."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise FileNotFoundError(f"{str(directory)!r} is not a directory saved by save_pretrained")
        self._handles: dict[Path, Any] = {}
        self.files = self._find_files()

    def config(self):
        """The transformers config saved beside the weights."""
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(self.directory)

    def _find_files(self) -> dict[str, Path]:
        for index, single in (SAFETENSORS, PICKLE):
            if (self.directory / index).is_file():
                weight_map = json.loads((self.directory / index).read_text())["weight_map"]
                return {key: self.directory / name for key, name in weight_map.items()}
            if (self.directory / single).is_file():
                path = self.directory / single
                return dict.fromkeys(self._handle(path).keys(), path)
        looked_for = ", ".join(SAFETENSORS + PICKLE)
        raise FileNotFoundError(f"{self.directory.name!r} holds no weights (looked for {looked_for})")

    def _handle(self, path: Path):
        if path not in self._handles:
            if path.suffix == ".safetensors":
                from safetensors import safe_open

                self._handles[path] = safe_open(path, framework="pt")
            else:
                self._handles[path] = _load_pickle(path)
        return self._handles[path]

    def read(self, key: str, split: Split | None, rank: int, world_size: int) -> torch.Tensor:
        """Rank ``rank``'s part of tensor ``key``: the slice ``split`` gives it, or all of it."""
        handle = self._handle(self.files[key])
        if isinstance(handle, dict):  # a pickle checkpoint, memory-mapped
            tensor = handle[key]
            return tensor.clone() if split is None else shard(tensor, split.dim, rank, world_size, *split[1:])
        if split is None:
            return handle.get_tensor(key).clone()  # own memory, not a view of the mapped file
        view = handle.get_slice(key)
        size = view.get_shape()[split.dim]
        ranges, padding = shard_ranges(size, rank, world_size, split.n_fused, split.heads, split.pad)
        lead = (slice(None),) * split.dim
        pieces = [view[(*lead, slice(start, stop))] for start, stop in ranges]
        if padding:
            shape = list(pieces[0].shape)
            shape[split.dim] = padding
            pieces.append(pieces[0].new_zeros(shape))
        if len(pieces) > 1:
            return torch.cat(pieces, dim=split.dim)
        return pieces[0].clone(memory_format=torch.contiguous_format)  # own memory, not a view of the file

    def reads(self, model: nn.Module, plan: dict[int, Split]) -> list[Read]:
        """What to read to fill ``model``'s tensors, cut by ``plan`` (``{id(tensor): Split}``).

        A tensor is found under any of its names (tied weights are saved once), with or without the
        model's ``base_model_prefix``. Raises ``KeyError`` naming the parameters the files lack;
        a buffer they lack keeps the value the model was built with.
        """
        names: dict[int, list[str]] = {}
        kinds: dict[int, bool] = {}
        for kind, items in ((True, model.named_parameters(remove_duplicate=False)), (False, model.named_buffers())):
            for name, tensor in items:
                names.setdefault(id(tensor), []).append(name)
                kinds.setdefault(id(tensor), kind)
        prefix = getattr(model, "base_model_prefix", "") or ""
        reads, missing = [], []
        for key, aliases in names.items():
            found = next((c for name in aliases for c in _candidates(name, prefix) if c in self.files), None)
            if found is not None:
                reads.append((aliases[0], found, plan.get(key)))
            elif kinds[key]:
                missing.append(aliases[0])
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise KeyError(
                f"the checkpoint in {self.directory.name!r} lacks {len(missing)} parameters of "
                f"{type(model).__name__}: {shown}"
            )
        return reads

    def load_into(self, skeleton: nn.Module, reads: list[Read], rank: int, world_size: int) -> None:
        """Read this rank's tensors and put them into ``skeleton`` (already split, weights on meta)."""
        expected = {name: tensor.shape for name, tensor in [*skeleton.named_parameters(), *skeleton.named_buffers()]}
        tensors = {}
        for name, key, split in reads:
            tensor = self.read(key, split, rank, world_size)
            if name in expected and tensor.shape != expected[name]:
                raise ValueError(
                    f"{key!r} in the checkpoint gives rank {rank} a shape {tuple(tensor.shape)}, but the model's "
                    f"{name!r} needs {tuple(expected[name])}: the weights do not match config.json"
                )
            tensors[name] = tensor
        install_tensors(skeleton, tensors)
        left = [name for name, tensor in skeleton.named_parameters() if tensor.device.type == "meta"]
        if left:
            raise ValueError(f"no weights were read for {', '.join(left[:5])}")
        self.close()

    def close(self) -> None:
        self._handles.clear()


def _candidates(name: str, prefix: str) -> list[str]:
    """Keys a model tensor may be saved under: as is, without or with the base model's prefix."""
    if not prefix:
        return [name]
    if name.startswith(prefix + "."):
        return [name, name[len(prefix) + 1 :]]
    return [name, f"{prefix}.{name}"]


def _load_pickle(path: Path) -> dict[str, torch.Tensor]:
    """A pickle state dict, loaded without running code; memory-mapped when its format allows."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:  # the legacy (non-zip) format cannot be memory-mapped
        return torch.load(path, map_location="cpu", weights_only=True)
