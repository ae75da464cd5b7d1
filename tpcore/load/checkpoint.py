"""Shard-on-load: each rank reads only its own slices of a saved checkpoint.

A checkpoint is a directory as ``save_pretrained`` writes it: ``config.json`` and the weights in
safetensors, one ``model.safetensors`` or shards listed by ``model.safetensors.index.json``. A
rank reads only the rows or columns it holds, straight from the files into memory of its own
(:mod:`tpcore.load.safetensors_file`: no mapping, so the rank's memory holds its share alone, and the model
never keeps a view of a file, which could change under it); a rank on a GPU moves each tensor there.
Pickle checkpoints (``pytorch_model.bin``, sharded or not) are opened with ``weights_only=True``
(no code in them runs) and memory-mapped where their format allows.

Which stored tensors make a model tensor is what ``from_pretrained`` would read for it: transformers'
own conversion mapping renames legacy keys and merges per-expert tensors (:mod:`tpcore.load.conversion`).
Which slice a rank reads is the :class:`~tpcore.compat.parallelformers.Split` the plan gives the model tensor, so a
tensor read from the files equals the one :func:`~tpcore.compat.parallelformers.shard` cuts from the whole tensor; a
tensor merged from several stored ones is read as the pieces of them that its slice covers.
"""

from __future__ import annotations

import copy
import functools
import math
import os
import re
from collections.abc import Callable, Collection, Iterable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from tpcore.cut.split import Split
from tpcore.load.conversion import Sources, TargetShapes, combined_shape, model_sources
from tpcore.load.safetensors_file import MAX_HEADER_BYTES, JSONObject, SafetensorsFile, decode_json
from tpcore.load.skeleton import install_tensors, named_tensors

__all__ = ["Checkpoint", "Read", "is_checkpoint_path"]

SAFETENSORS = ("model.safetensors.index.json", "model.safetensors")
PICKLE = ("pytorch_model.bin.index.json", "pytorch_model.bin")

CPU = torch.device("cpu")


class Read(NamedTuple):
    """One model tensor to fill: its name (of :func:`~tpcore.load.skeleton.named_tensors`), the stored tensors
    that make it, and how it is cut (``None``: whole); or, for a parameter the model does not save
    (``value``), the whole tensor its own init computes."""

    name: str
    sources: Sources | None
    split: Split | None
    value: torch.Tensor | None = None


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
        """The transformers config saved beside the weights. A checkpoint's own code never runs: a config
        that needs it (``auto_map`` to a class transformers lacks) is refused, without a prompt."""
        from transformers import AutoConfig

        try:
            return AutoConfig.from_pretrained(self.directory, trust_remote_code=False)
        except ValueError as error:
            if "trust_remote_code" not in str(error):
                raise
            raise ValueError(
                f"the checkpoint in {self.directory.name!r} needs its own code to build its config; tpcore never "
                "runs a checkpoint's code: build the model yourself (from_pretrained(..., trust_remote_code=True) "
                "once you have read that code) and parallelize the model object"
            ) from None

    def _find_files(self) -> dict[str, Path]:
        for index, single in (SAFETENSORS, PICKLE):
            if (self.directory / index).is_file():
                return self._weight_map(self.directory / index)
            if (self.directory / single).is_file():
                path = self.directory / single
                return dict.fromkeys(self._keys_in(path), path)
        looked_for = ", ".join(SAFETENSORS + PICKLE)
        raise FileNotFoundError(f"{self.directory.name!r} holds no weights (looked for {looked_for})")

    def _weight_map(self, index: Path) -> dict[str, Path]:
        """The index's ``weight_map``: each tensor key's file, named inside the directory (:func:`_check_shard_names`).

        A key given twice with different values (a tensor mapped to two files, two weight maps) is refused: JSON
        readers differ on which one counts.
        """
        if index.stat().st_size > MAX_HEADER_BYTES:  # read whole: bounded as a safetensors header is
            raise ValueError(
                f"{index.name} in {str(self.directory)!r} is not a checkpoint index: it has more than the "
                f"{MAX_HEADER_BYTES} bytes tpcore reads of one"
            )
        try:
            content = decode_json(index.read_bytes())
        except ValueError as error:  # not JSON, or not text
            raise ValueError(f"{index.name} in {str(self.directory)!r} is not valid JSON: {error}") from None
        weight_map = content.get("weight_map") if isinstance(content, JSONObject) else None
        if not isinstance(weight_map, JSONObject) or not all(
            isinstance(name, str) for names in (weight_map.values(), *weight_map.repeated.values()) for name in names
        ):
            raise ValueError(f"{index.name} in {str(self.directory)!r} has no 'weight_map' of tensor keys to files")
        for level in (content, weight_map):
            for key, values in level.repeated.items():
                if any(value != values[0] for value in values):
                    raise ValueError(
                        f"{index.name} in {str(self.directory)!r} gives {key!r} {len(values)} times, differently"
                    )
        _check_shard_names(index, sorted(set(weight_map.values())))
        return {key: self.directory / name for key, name in weight_map.items()}

    def _keys_in(self, path: Path) -> Iterable[str]:
        """The tensor keys a weight file holds, from its header (safetensors) or its state dict (pickle)."""
        return self._handle(path).keys()

    def _shapes_of(self, keys: Iterable[str]) -> dict[str, list[int]]:
        """The stored shapes of tensors ``keys``, from the files' headers (pickles: their mapped state dicts)."""
        by_file: dict[Path, list[str]] = {}
        for key in keys:
            by_file.setdefault(self.files[key], []).append(key)
        shapes = {}
        for names in by_file.values():
            shapes.update((name, self.stored_shape(name)) for name in names)
        return shapes

    def verify(self, keys: Iterable[str]) -> None:
        """Check that the files holding ``keys`` are there and whole, reading no tensor data.

        Each file must exist and be a regular file (or a link to one); a safetensors file's header must
        parse and lay every tensor out inside the file, in the bytes its dtype and shape need (reading the
        header alone, :func:`~tpcore.load.safetensors_file.read_header`); a pickle file must open
        (memory-mapped where its format allows). Each file must hold the keys the index gives it, and no
        key the index gives another file. Raises ``FileNotFoundError`` for a missing file, ``ValueError``
        for a truncated, corrupt or conflicting one.
        """
        wanted: dict[Path, list[str]] = {}
        for key in keys:
            wanted.setdefault(self.files[key], []).append(key)
        for path, names in wanted.items():
            if not path.is_file():
                if path.exists():  # a pipe would never end a read, a directory has no tensors
                    raise ValueError(f"{path.name} in the checkpoint in {str(self.directory)!r} is not a regular file")
                count = sum(file == path for file in self.files.values())
                raise FileNotFoundError(
                    f"{path.name} is missing from the checkpoint in {str(self.directory)!r}: "
                    f"the index maps {count} tensors to it"
                )
            held = set(self._keys_in(path))
            absent = [name for name in names if name not in held]
            if absent:
                raise ValueError(
                    f"{path.name} lacks {len(absent)} of the tensors the index maps to it: {_listing(absent)}"
                )
            elsewhere = sorted(name for name in held if self.files.get(name, path) != path)
            twice = [f"{name} (mapped to {self.files[name].name})" for name in elsewhere]
            if twice:  # which copy counts would differ between readers
                raise ValueError(
                    f"{path.name} holds {len(twice)} tensors that the index maps to another file: {_listing(twice)}"
                )

    def _handle(self, path: Path) -> SafetensorsFile | dict[str, torch.Tensor]:
        """A weight file: safetensors (its header checked; slices read on demand), or a pickle state dict
        (on the CPU, memory-mapped)."""
        if path not in self._handles:
            self._handles[path] = SafetensorsFile(path) if path.suffix == ".safetensors" else _load_pickle(path)
        return self._handles[path]

    def read(self, key: str, split: Split | None, rank: int, world_size: int, device=None, dtype=None) -> torch.Tensor:
        """Rank ``rank``'s part of stored tensor ``key`` (the slice ``split`` gives it, or all of it) in memory of
        its own on ``device`` (the CPU by default); see :meth:`read_tensor`."""
        return self.read_tensor(Read(key, Sources(((key,),)), split), rank, world_size, device, dtype)

    def read_tensor(self, read: Read, rank: int, world_size: int, device=None, dtype=None) -> torch.Tensor:
        """Rank ``rank``'s part of the model tensor ``read`` describes, in memory of its own on ``device``.

        Only the pieces of the stored tensors that the slice covers are read: rows ``[a, b)`` along the
        split dim of a tensor stacked from per-expert tensors are rows ``[a, b)`` of each of them (see
        :mod:`tpcore.load.conversion`). Safetensors slices are read into memory of their own (no mapping of the file
        stays resident), then moved to ``device``. A tensor that the model's later cast to ``dtype`` would
        shrink is read to the CPU instead, so the device never holds its wider copy.
        """
        device = torch.device(device) if device is not None else CPU
        sources, split = read.sources, read.split
        if sources is None:  # computed by the model's init, not stored
            whole = read.value
            return _own(whole if split is None else split.shard(whole, rank, world_size), device)
        first = sources.keys[0][0]
        if device != CPU and dtype is not None and _shrinks(self.stored_dtype(first), dtype):
            device = CPU
        if sources.converted is not None:
            return self._read_converted(read, rank, world_size, device)
        taken: list[tuple[torch.Tensor, str]] = []

        def take(key: str, dim: int | None, start: int = 0, stop: int = 0) -> torch.Tensor:
            taken.append((self._take(key, dim, start, stop, device, sources.view), key))
            return taken[-1][0]

        if split is None:
            tensor = _combine(sources, take, None, 0, 0)
        else:
            shapes = self._source_shapes(sources, self.stored_shape)
            shape = combined_shape(sources, shapes)
            dim = split.dim % len(shape)
            ranges, padding = _split_ranges(split, shape[dim], rank, world_size)
            tensor = _join([_combine(sources, take, dim, start, stop, shapes) for start, stop in ranges], dim, padding)
        if any(tensor is piece and self._mapped(key) for piece, key in taken):  # a view of a mapped pickle file
            tensor = _own(tensor, device)
        return tensor

    @staticmethod
    def _source_shapes(sources: Sources, stored_shape: Callable[[str], list[int]]) -> Any:
        """The shapes of ``sources``' stored tensors, grouped as its keys, each as it is read (its ``view``);
        ``None`` where a view does not hold the stored elements."""
        if sources.view is None:
            return [[stored_shape(key) for key in group] for group in sources.keys]
        (key,) = sources.all_keys
        return [[list(sources.view)]] if math.prod(sources.view) == math.prod(stored_shape(key)) else None

    def _mapped(self, key: str) -> bool:
        """Whether tensors read for ``key`` may be views of a mapped file (pickle checkpoints)."""
        return isinstance(self._handle(self.files[key]), dict)

    def _take(
        self, key: str, dim: int | None, start: int, stop: int, device: torch.device, view: Any = None
    ) -> torch.Tensor:
        """Stored tensor ``key`` (``dim`` ``None``), or its part ``[start, stop)`` along ``dim``, on ``device``;
        read as the shape ``view`` where given (:attr:`Sources.view <tpcore.load.conversion.Sources.view>`)."""
        handle = self._handle(self.files[key])
        if isinstance(handle, dict):  # a pickle checkpoint, memory-mapped
            whole = handle[key] if view is None else handle[key].reshape(view)
            tensor = whole if dim is None else whole.narrow(dim, start, stop - start)
            return tensor if device == CPU else tensor.to(device)
        tensor = handle.read(key, dim, start, stop, None if view is None else list(view))
        return tensor if device == CPU else tensor.to(device)

    def stored_shape(self, key: str) -> list[int]:
        """The shape of tensor ``key`` in its file (from the header of a safetensors file)."""
        handle = self._handle(self.files[key])
        return list(handle[key].shape) if isinstance(handle, dict) else handle.shape(key)

    def _read_converted(self, read: Read, rank: int, world_size: int, device: torch.device) -> torch.Tensor:
        """FALLBACK for operations tpcore does not read lazily: the stored tensors are read whole, transformers'
        converter makes the model tensor from them, and this rank's slice is cut from it."""
        converted = read.sources.converted
        converter = copy.deepcopy(converted.converter)
        for pattern, group in zip(converted.patterns, read.sources.keys, strict=True):
            for key in group:
                converter.add_tensor(
                    converted.layer_name, key, pattern, functools.partial(self._take, key, None, 0, 0, device)
                )
        outputs = converter.convert(
            converted.layer_name, model=TargetShapes(converted.target_shapes), config=converted.config
        )
        tensor = outputs[converted.output]
        tensor = tensor[0] if isinstance(tensor, list) else tensor
        if read.split is not None:
            dim = read.split.dim % tensor.dim()
            ranges, padding = _split_ranges(read.split, tensor.shape[dim], rank, world_size)
            tensor = _join([tensor.narrow(dim, start, stop - start) for start, stop in ranges], dim, padding)
        return _own(tensor, device)

    def stored_dtype(self, key: str) -> torch.dtype:
        """The dtype of tensor ``key`` in its file (from the header of a safetensors file)."""
        handle = self._handle(self.files[key])
        return handle[key].dtype if isinstance(handle, dict) else handle.dtype(key)

    def bytes_to_read(self, reads: list[Read], shape_of: Callable[[str], tuple[int, ...]]) -> int:
        """The bytes a rank reads for ``reads``: each tensor of the shape ``shape_of(read.name)`` gives its part,
        in its stored dtype (what :meth:`load_into` reports to its ``progress``), from the headers only."""
        total = 0
        for read in reads:
            dtype = read.value.dtype if read.sources is None else self.stored_dtype(read.sources.keys[0][0])
            total += math.prod(shape_of(read.name)) * dtype.itemsize
        return total

    def reads(self, model: nn.Module, splits: Mapping[str, Split | None]) -> list[Read]:
        """What to read to fill ``model``'s tensors, cut by ``splits`` (by the names of
        :func:`~tpcore.load.skeleton.named_tensors`; a name not there is read whole).

        The stored tensors of each model tensor are the ones ``from_pretrained`` would convert into it
        (:func:`tpcore.load.conversion.model_sources`); a tensor is found under any of its names (tied
        weights are saved once). Raises ``KeyError`` naming the parameters the files lack; a buffer
        they lack keeps the value the model was built with, and a parameter the model declares unsaved
        (``_keys_to_ignore_on_save``, ``_keys_to_ignore_on_load_missing``: Marian's sinusoidal positions)
        gets the value its ``_init_weights`` computes, as ``from_pretrained`` gives it. The files read
        are checked first (:meth:`verify`), so a missing or truncated one fails here, not on a rank.
        """
        aliases, by_name = _aliases(model)
        found = {**model_sources(model, self.files, by_name), **self._declared_sources(model)}
        parameters = {id(tensor) for tensor in model.parameters()}
        reads, missing = [], []
        for name, tensor in named_tensors(model).items():
            sources = next((found[alias] for alias in aliases[id(tensor)] if alias in found), None)
            if sources is not None:
                reads.append(Read(name, sources, splits.get(name)))
            elif id(tensor) in parameters:
                missing.append(name)
        for name, value in _computed_by_the_model(model, missing, aliases, by_name).items():
            reads.append(Read(name, None, splits.get(name), value))
            missing.remove(name)
        if missing:
            raise KeyError(
                f"the checkpoint in {self.directory.name!r} lacks {len(missing)} parameters of "
                f"{type(model).__name__}: {_listing(missing)}"
            )
        stored = [read for read in reads if read.sources is not None]
        self.verify(key for read in stored for key in read.sources.all_keys)
        self._check_shapes(model, stored)
        return reads

    def _declared_sources(self, model: nn.Module) -> dict[str, Sources]:
        """The sources of the tensors whose layers name their stored keys (``stored_as``: a quantized layer's
        tensors stored under other names), each read as the model tensor's shape where stored flat or otherwise
        shaped with the same elements."""
        sources = {}
        for path, module in model.named_modules():
            for name, key in getattr(module, "stored_as", {}).items():
                if key not in self.files:
                    continue
                shape = tuple(module.get_parameter(name).shape) if name in module._parameters else None
                if shape is None:
                    shape = tuple(module.get_buffer(name).shape)
                view = None if list(shape) == self.stored_shape(key) else shape
                sources[f"{path}.{name}" if path else name] = Sources(((key,),), view=view)
        return sources

    def stored_keys(self, model: nn.Module) -> dict[str, str]:
        """The stored key of every model tensor (by each of its names) that one stored tensor makes, as
        ``from_pretrained`` renames keys (:func:`~tpcore.load.conversion.model_sources`)."""
        return {
            name: sources.keys[0][0]
            for name, sources in self.stored_sources(model).items()
            if sources.converted is None and len(sources.all_keys) == 1
        }

    def stored_sources(self, model: nn.Module) -> dict[str, Sources]:
        """The stored keys that make each model tensor (by each of its names), and how: one key, or the merged
        per-expert keys of a fused experts tensor (:func:`~tpcore.load.conversion.model_sources`)."""
        _, by_name = _aliases(model)
        return model_sources(model, self.files, by_name)

    def _check_shapes(self, model: nn.Module, reads: list[Read]) -> None:
        """Raise ``ValueError`` where the stored tensors make a model tensor of another shape than the model's
        (a merged expert tensor missing an expert, weights of another config), reading headers only."""
        model_tensors = named_tensors(model)
        lazy = [read for read in reads if read.sources.converted is None]  # converted ones: checked on the rank
        stored = self._shapes_of(key for read in lazy for key in read.sources.all_keys)
        for read in lazy:
            shapes = self._source_shapes(read.sources, stored.__getitem__)
            if shapes is None:  # a view of other elements than stored
                uneven, shape, got = False, None, f"{math.prod(stored[read.sources.all_keys[0]])} elements"
            else:
                uneven = any(shape != group[0] for group in shapes for shape in group)  # one expert of another size
                shape = None if uneven else combined_shape(read.sources, shapes)
                got = "pieces of different shapes" if uneven else f"the shape {shape}"
            wanted = tuple(model_tensors[read.name].shape)
            if shape != wanted:
                keys = read.sources.all_keys
                source = repr(keys[0]) if len(keys) == 1 else f"{keys[0]!r} and {len(keys) - 1} more stored tensors"
                raise ValueError(
                    f"the checkpoint in {self.directory.name!r} gives {type(model).__name__}'s {read.name!r} "
                    f"{got} (from {source}), but config.json makes it {wanted}"
                )

    def load_into(
        self,
        skeleton: nn.Module,
        reads: list[Read],
        rank: int,
        world_size: int,
        device=None,
        dtype=None,
        progress: Callable[[int], None] | None = None,
        lay_out: Callable[[torch.Tensor], torch.Tensor] | None = None,
        laid_out: Collection[str] = (),
    ) -> None:
        """Read this rank's tensors onto ``device`` (see :meth:`read_tensor`) and put them into ``skeleton``
        (already split, weights on meta); ``progress(nbytes)`` is told the bytes of each tensor once read.
        ``lay_out`` is applied to each tensor named in ``laid_out`` as soon as it is read (the memory it leaves
        is warm for the next read)."""
        expected = {name: tensor.shape for name, tensor in [*skeleton.named_parameters(), *skeleton.named_buffers()]}
        tensors = {}
        for read in reads:
            tensor = self.read_tensor(read, rank, world_size, device, dtype)
            if lay_out is not None and read.name in laid_out:
                tensor = lay_out(tensor)
            if read.name in expected and tensor.shape != expected[read.name]:
                keys = read.sources.all_keys
                stored = repr(keys[0]) if len(keys) == 1 else f"{keys[0]!r} and {len(keys) - 1} more stored tensors"
                raise ValueError(
                    f"{stored} in the checkpoint give rank {rank} a shape {tuple(tensor.shape)}, but the model's "
                    f"{read.name!r} needs {tuple(expected[read.name])}: the weights do not match config.json"
                )
            tensors[read.name] = tensor
            if progress is not None:
                progress(tensor.numel() * tensor.element_size())
        install_tensors(skeleton, tensors)
        left = [name for name, tensor in skeleton.named_parameters() if tensor.device.type == "meta"]
        if left:
            raise ValueError(f"no weights were read for {', '.join(left[:5])}")
        self.close()

    def close(self) -> None:
        for handle in self._handles.values():
            if isinstance(handle, SafetensorsFile):
                handle.close()
        self._handles.clear()


def _split_ranges(split: Split, size: int, rank: int, world_size: int) -> tuple[list[tuple[int, int]], int]:
    """The ``[start, stop)`` ranges of a dimension of ``size`` that ``split`` gives rank ``rank``, and the zero
    rows after them (the one place a checkpoint read asks the slicer)."""
    return split.ranges(size, rank, world_size)


def _join(pieces: list[torch.Tensor], dim: int, padding: int) -> torch.Tensor:
    """``pieces`` concatenated along ``dim``, followed by ``padding`` rows of zeros."""
    if padding:
        shape = list(pieces[0].shape)
        shape[dim] = padding
        pieces = [*pieces, pieces[0].new_zeros(shape)]
    return torch.cat(pieces, dim=dim) if len(pieces) > 1 else pieces[0]


def _combine(sources: Sources, take, dim: int | None, start: int, stop: int, shapes=None) -> torch.Tensor:
    """Part ``[start, stop)`` along ``dim`` (``None``: all) of the tensor ``sources`` make, reading each stored
    tensor's part with ``take(key, dim, start, stop)`` (``dim`` ``None``: the whole stored tensor).

    A concatenation along ``dim`` reads only the groups the range falls in; a stack along ``dim`` reads
    only the keys it covers, whole; along any other dim every key gives its own rows ``[start, stop)``.
    """
    stack, cat = sources.stack_dim, sources.cat_dim
    parts, offset = [], 0
    for index, group in enumerate(sources.keys):
        local = (start, stop)
        if dim is not None and dim == cat:
            extent = len(group) if stack == cat else shapes[index][0][cat - (stack is not None and stack < cat)]
            local = (max(start - offset, 0), min(stop - offset, extent))
            offset += extent
            if local[0] >= local[1]:
                continue
        parts.append(_group_part(group, stack, dim, *local, take))
    return torch.cat(parts, dim=cat) if len(parts) > 1 else parts[0]


def _group_part(group: tuple[str, ...], stack: int | None, dim: int | None, start: int, stop: int, take):
    """Part ``[start, stop)`` along ``dim`` of one group of keys, stacked along ``stack`` (``None``: one key)."""
    if stack is None:
        (key,) = group
        return take(key, dim, start, stop)
    if dim == stack:
        return torch.stack([take(key, None) for key in group[start:stop]], dim=stack)
    source_dim = None if dim is None else dim - (dim > stack)
    return torch.stack([take(key, source_dim, start, stop) for key in group], dim=stack)


def _own(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device`` in memory of its own and contiguous: a CPU tensor may be a view of the
    mapped file and is copied; one that lands on another device already is a copy."""
    if tensor.device == CPU and device == CPU:
        return tensor.clone(memory_format=torch.contiguous_format)
    return tensor.to(device).contiguous()


def _shrinks(stored: torch.dtype | None, dtype: torch.dtype | None) -> bool:
    """Whether casting a floating tensor of dtype ``stored`` to ``dtype`` makes it smaller."""
    if stored is None or dtype is None or not (stored.is_floating_point and dtype.is_floating_point):
        return False
    return stored.itemsize > dtype.itemsize


def _aliases(model: nn.Module) -> tuple[dict[int, list[str]], dict[str, torch.Tensor]]:
    """Every name of each of ``model``'s tensors (by the tensor's id), and every tensor by each of its names."""
    aliases: dict[int, list[str]] = {}
    by_name: dict[str, torch.Tensor] = {}
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        aliases.setdefault(id(tensor), []).append(name)
        by_name[name] = tensor
    return aliases, by_name


def _listing(names: list[str]) -> str:
    """The first few of ``names``, and how many more there are."""
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def _check_shard_names(index: Path, names: list[str]) -> None:
    """Refuse a shard name that leaves the model directory (absolute, or with ``..`` parts), in transformers' words
    (it refuses them since 5.25), and one that names no file in it (empty, ``.``). The names are read, not
    resolved: a shard may be a symbolic link to elsewhere, as the hub's cache is made of them."""
    for name in names:
        if Path(name).anchor or ".." in Path(name).parts:
            raise ValueError(
                f"The checkpoint index {index} has a shard filename that points outside the model directory: {name}"
            )
        if not Path(name).parts:
            raise ValueError(f"The checkpoint index {index} has a shard filename that names no file: {name!r}")


def _computed_by_the_model(
    model: nn.Module, missing: list[str], aliases: dict[int, list[str]], by_name: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The parameters among ``missing`` that ``model`` declares it does not save or load, each as the
    whole tensor its ``_init_weights`` gives the module holding it (built on the CPU, seeded, so every
    rank gets the same)."""
    patterns = [
        *(getattr(model, "_keys_to_ignore_on_save", None) or ()),
        *(getattr(model, "_keys_to_ignore_on_load_missing", None) or ()),
    ]
    init = getattr(model, "_init_weights", None)
    if not patterns or init is None:
        return {}
    computed = {}
    for name in missing:
        names = aliases[id(by_name[name])]
        if not any(re.search(pattern, alias) for pattern in patterns for alias in names):
            continue
        owner, _, leaf = name.rpartition(".")
        module = copy.deepcopy(model.get_submodule(owner)).to_empty(device=CPU)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            init(module)
        computed[name] = getattr(module, leaf).detach()
    return computed


def _load_pickle(path: Path) -> dict[str, torch.Tensor]:
    """A pickle state dict, loaded without running code; memory-mapped when its format allows.

    A file that holds code is refused (``pickle.UnpicklingError``, as torch raises it); one that
    cannot be read (truncated, not a weights file) is a ``ValueError`` naming it.
    """
    try:
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # the legacy (non-zip) format cannot be memory-mapped
            return torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError) as error:
        first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ValueError(
            f"{path.name} in {path.parent.name!r} cannot be read as a weights file: {first_line}"
        ) from error
