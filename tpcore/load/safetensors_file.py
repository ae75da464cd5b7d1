"""A safetensors file read by slices, with ``pread`` straight into tensors of their own.

Nothing is memory-mapped: a mapping's touched pages count in the reading process's resident memory
beside the copies made from them, so a rank that read its share through one peaked near twice its
share. Here a rank holds what it read and nothing more (the kernel's page cache, shared by all ranks
and not counted in any process, holds the file).

The layout: an 8-byte little-endian header length, a JSON header mapping each tensor key to its
``dtype``, ``shape`` and ``data_offsets`` ``[begin, end)`` (relative to the end of the header), then
the tensors' bytes, row-major, one after another. Rows ``[a, b)`` along dim ``d`` of a tensor of
shape ``(o..., n, i...)`` are ``prod(o)`` runs of ``(b - a) * prod(i)`` elements, ``n * prod(i)``
elements apart: one ``preadv`` reads them into place (the bytes between runs into a scratch buffer).

A header is untrusted input, read alone (never more than its length field, itself bounded, and never past
the file) and checked as safetensors checks it on open, so that a file is accepted exactly where safetensors
accepts it: strict JSON as its parser (serde_json) reads it, known dtypes, sizes and offsets in 64 bits, the
tensors one after another covering the data. Two forms safetensors reads are refused on purpose: a key given
twice (JSON readers differ on which one counts), and an entry or a dtype written other than as the format
documents them (an array for an entry, ``{"F32": null}`` for a dtype, which no writer emits).
"""

from __future__ import annotations

import json
import math
import os
import re
import reprlib
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

__all__ = ["DTYPE_BITS", "JSONObject", "SafetensorsFile", "decode_json", "read_header"]

#: bits per element of the safetensors dtypes (those safetensors 0.8 knows; a header naming another is refused)
DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32,
    "I64": 64, "U64": 64, "F64": 64, "C64": 64,
}  # fmt: skip
#: the torch dtype of each safetensors dtype this torch has (fp8 and unsigned kinds depend on the version)
TORCH_DTYPES = {
    code: getattr(torch, name)
    for code, name in {
        "BOOL": "bool", "U8": "uint8", "I8": "int8", "F8_E5M2": "float8_e5m2", "F8_E4M3": "float8_e4m3fn",
        "F8_E8M0": "float8_e8m0fnu", "I16": "int16", "U16": "uint16", "F16": "float16", "BF16": "bfloat16",
        "I32": "int32", "U32": "uint32", "F32": "float32", "I64": "int64", "U64": "uint64", "F64": "float64",
        "C64": "complex64",
    }.items()
    if hasattr(torch, name)
}  # fmt: skip
#: the largest header the safetensors format reads (its ``MAX_HEADER_SIZE``: 100 MB)
MAX_HEADER_BYTES = 100_000_000
#: the containers a header may nest: safetensors' JSON parser (serde_json) stops at 128 levels
MAX_HEADER_DEPTH = 127
#: the largest size or offset a header may give (safetensors reads them as 64-bit ``usize``)
_USIZE_MAX = 2**64 - 1
#: the fields of a tensor's header entry
_FIELDS = ("dtype", "shape", "data_offsets")
#: a ``\u`` escape of a UTF-16 surrogate (the only way a header's text holds one)
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
#: iovecs one ``preadv`` takes (Linux's ``IOV_MAX``)
_IOV_MAX = 1024


class SafetensorsFile:
    """One safetensors file: its checked header, and slices of its tensors read on demand.

    The file is opened at the first read and closed by :meth:`close`.
    """

    def __init__(self, path: Path):
        self._fd: int | None = None
        self.path = path
        self.header, self._data_start = _parse(path)

    def keys(self):
        return self.header.keys()

    def shape(self, key: str) -> list[int]:
        return [int(n) for n in self.header[key]["shape"]]

    def dtype(self, key: str) -> torch.dtype:
        code = self.header[key]["dtype"]
        if code not in TORCH_DTYPES:
            raise ValueError(f"{self.path.name}: tensor {key!r} has dtype {code}, which this torch cannot hold")
        return TORCH_DTYPES[code]

    def read(
        self, key: str, dim: int | None = None, start: int = 0, stop: int = 0, view: list[int] | None = None
    ) -> torch.Tensor:
        """Tensor ``key`` (``dim`` ``None``), or its rows ``[start, stop)`` along ``dim``, in a new CPU tensor;
        read as the shape ``view`` where given (the same elements, row-major: a flat packed tensor read as rows)."""
        shape, dtype = self.shape(key), self.dtype(key)
        if view is not None:
            if math.prod(view) != math.prod(shape):
                raise ValueError(f"{self.path.name}: tensor {key!r} of shape {shape} cannot be read as {list(view)}")
            shape = list(view)
        if dim is None:
            dim, start, stop = 0, 0, shape[0] if shape else 1
        dim %= max(len(shape), 1)
        inner = math.prod(shape[dim + 1 :]) * dtype.itemsize
        outer = math.prod(shape[:dim])
        out_shape = [*shape[:dim], stop - start, *shape[dim + 1 :]] if shape else []
        out = torch.empty(out_shape, dtype=dtype)
        run, stride = (stop - start) * inner, (shape[dim] if shape else 1) * inner
        if run == 0 or outer == 0:
            return out
        offset = self._data_start + int(self.header[key]["data_offsets"][0]) + start * inner
        target = out.reshape(-1).view(torch.uint8).numpy().data
        if run == stride or outer == 1:  # one contiguous range
            self._read_into([target], offset)
            return out
        gap = memoryview(bytearray(stride - run))
        views = [part for row in range(outer) for part in (target[row * run : (row + 1) * run], gap)][:-1]
        self._read_into(views, offset)
        return out

    def _read_into(self, views: list[memoryview], offset: int) -> None:
        """Fill ``views`` in order from the file's bytes at ``offset`` on (they are contiguous in the file)."""
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        index = 0
        while index < len(views):
            batch = views[index : index + _IOV_MAX]
            done = _preadv(self._fd, batch, offset)
            if done == 0:
                raise ValueError(f"{self.path.name} ended while reading it: the file is truncated")
            offset += done
            for view in batch:  # skip what was read; a view read in part is continued from where it stopped
                if done < view.nbytes:
                    views[index] = view[done:]
                    break
                done -= view.nbytes
                index += 1

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self):
        self.close()


def _preadv(fd: int, views: list[memoryview], offset: int) -> int:
    if hasattr(os, "preadv"):
        return os.preadv(fd, views, offset)
    data = os.pread(fd, sum(view.nbytes for view in views), offset)  # systems without preadv: one copy more
    done = 0
    for view in views:
        part = data[done : done + view.nbytes]
        view[: len(part)] = part
        done += len(part)
    return done


def read_header(path: Path) -> dict[str, dict]:
    """A safetensors file's tensor entries, checked as safetensors checks them on open, reading the header alone.

    Raises ``ValueError`` naming the file, and the tensor and the sizes where one is at fault.
    """
    return _parse(path)[0]


def decode_json(data: bytes) -> Any:
    """``data`` read as JSON text in UTF-8 (as transformers reads an index), its objects :class:`JSONObject`.

    Raises ``ValueError`` saying why it is not (also for nesting past the parser's depth).
    """
    try:
        return json.loads(data.decode("utf-8"), object_pairs_hook=JSONObject)
    except UnicodeDecodeError as error:
        raise ValueError(f"not UTF-8 ({error})") from None
    except RecursionError:
        raise ValueError("nested too deeply") from None


class JSONObject(dict):
    """A JSON object as read: the last value of each key (as :mod:`json` keeps it), and in :attr:`repeated` the
    values of each key given more than once, in order."""

    def __init__(self, pairs: list[tuple[str, Any]]):
        super().__init__(pairs)
        self.repeated: dict[str, list[Any]] = {}
        if len(self) < len(pairs):
            for key, value in pairs:
                self.repeated.setdefault(key, []).append(value)
            self.repeated = {key: values for key, values in self.repeated.items() if len(values) > 1}


def _parse(path: Path) -> tuple[dict[str, dict], int]:
    """:func:`read_header`, and where the tensors' bytes start."""
    not_a_file = ValueError(f"{path.name} is not a safetensors file: it is not a regular file")
    try:
        file = open(path, "rb", opener=_open_without_waiting)
    except IsADirectoryError:
        raise not_a_file from None
    with file:
        status = os.fstat(file.fileno())
        if not stat.S_ISREG(status.st_mode):  # a pipe or a device: a read may block or never end
            raise not_a_file
        size = status.st_size
        length = int.from_bytes(file.read(8), "little")
        data_start = 8 + length
        if data_start > size:
            raise ValueError(
                f"{path.name} is truncated or not a safetensors file: its header ends at byte {data_start} "
                f"but the file has {size} bytes"
            )
        if length > MAX_HEADER_BYTES:  # refused from the length alone: a sparse file may claim any size
            raise ValueError(
                f"{path.name} is not a safetensors file: its header claims {length} bytes, more than the "
                f"{MAX_HEADER_BYTES} the safetensors format allows"
            )
        text = file.read(length)
    try:
        header = _header_json(text)
    except ValueError as error:
        raise ValueError(f"{path.name} is not a safetensors file: its header is {error}") from None
    if not isinstance(header, JSONObject):
        raise ValueError(f"{path.name} is not a safetensors file: its header is not a JSON object")
    if header.repeated:  # JSON readers differ on which one counts: refused
        key, values = next(iter(header.repeated.items()))
        raise ValueError(f"{path.name} is not a safetensors file: its header gives {_shown(key)} {len(values)} times")
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (isinstance(metadata, dict) and all(map(_is_str, metadata.values()))):
        raise ValueError(
            f"{path.name} is not a safetensors file: its __metadata__ is not a map of strings to strings: "
            f"{_shown(metadata)}"
        )
    entries = {key: _entry(path, key, entry) for key, entry in header.items()}
    _check_layout(path, entries, data_start, size)
    return entries, data_start


def _open_without_waiting(path, flags: int) -> int:
    """Open ``path`` as :func:`open` does, without waiting for a writer should it be a pipe."""
    return os.open(path, flags | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))


def _header_json(text: bytes) -> Any:
    """A header's JSON, read as strictly as safetensors reads it (serde_json): UTF-8 text with no ``NaN`` nor
    ``Infinity``, no number out of a double's range, no unpaired surrogate. Raises ``ValueError`` saying what it is
    instead. (How deep it nests is checked where it may nest: :func:`_entry`.)"""
    try:
        header = json.loads(
            text.decode("utf-8"),
            object_pairs_hook=JSONObject,
            parse_constant=_refuse_constant,
            parse_float=_finite_float,
            parse_int=_integer,
        )
    except UnicodeDecodeError as error:
        raise ValueError(f"not valid JSON (not UTF-8: {error})") from None
    except RecursionError:
        raise ValueError("nested too deeply") from None
    except ValueError as error:  # not JSON, or a number refused above
        raise ValueError(f"not valid JSON ({error})") from None
    if _SURROGATE_ESCAPE.search(text) and any(_has_surrogate(item) for item in _strings(header)):
        raise ValueError("not valid JSON (it escapes an unpaired surrogate)")
    return header


def _strings(value: Any) -> Iterator[str]:
    """The strings in ``value``, keys and the values of repeated keys included, however deep."""
    pending = [[value]]
    while pending:
        for item in pending.pop():
            if isinstance(item, str):
                yield item
            elif isinstance(item, (dict, list)):
                pending.append([*item.keys(), *_items(item)] if isinstance(item, dict) else item)


def _depth(value: Any) -> int:
    """How many containers deep ``value`` nests (0: not a container)."""
    deepest, pending = 0, [(value, 1)]
    while pending:
        value, depth = pending.pop()
        if isinstance(value, (dict, list)):
            deepest = max(deepest, depth)
            pending.extend((item, depth + 1) for item in _items(value))
    return deepest


def _items(container: dict | list) -> list:
    """The values in a JSON object (those of its repeated keys too, which a stricter parser reads) or array."""
    if isinstance(container, JSONObject):
        return [*container.values(), *(item for _, item in _repeated(container))]
    return list(container.values()) if isinstance(container, dict) else container


def _repeated(container: JSONObject) -> list[tuple[str, Any]]:
    """The pairs of the keys ``container`` gives more than once (the last value among them)."""
    return [(key, item) for key, items in container.repeated.items() for item in items]


def _has_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    number = float(text)
    if math.isinf(number):
        raise ValueError(f"the number {text[:40]} is out of range")
    return number


def _integer(text: str) -> int | float:
    """A JSON integer as safetensors reads it: ``-0`` is a float (no size), and one past a double's range is refused."""
    if text == "-0":
        return -0.0
    if len(text) > 300:
        _finite_float(text)
    return int(text)


def _entry(path: Path, key: str, entry: Any) -> dict:
    """Tensor ``key``'s header entry, checked as safetensors reads it: an object with a ``dtype`` safetensors knows,
    a ``shape`` of sizes and ``data_offsets`` ``[begin, end]`` (sizes and offsets unsigned 64-bit integers). Other
    fields are left out, as safetensors ignores them."""

    def malformed(why: str) -> ValueError:
        return ValueError(f"{path.name} has a malformed header entry for tensor {_shown(key)}: {why}")

    if not isinstance(entry, JSONObject):
        raise malformed(f"{_shown(entry)} is not a JSON object")
    extra = len(entry) > len(_FIELDS) or entry.repeated  # else no other field, or one of the three is missing
    for field, value in [*entry.items(), *_repeated(entry)] if extra else ():
        if field not in _FIELDS and _depth(value) > MAX_HEADER_DEPTH - 2:  # ignored by safetensors, but parsed
            raise malformed(f"its {_shown(field)} nests more than the {MAX_HEADER_DEPTH} containers safetensors reads")
    for field in _FIELDS:
        if field in entry.repeated:
            raise malformed(f"it gives {field!r} {len(entry.repeated[field])} times")
        if field not in entry:
            raise malformed(f"it has no {field!r}")
    dtype, shape, offsets = (entry[field] for field in _FIELDS)
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise malformed(f"its dtype {_shown(dtype)} is none of safetensors' ({', '.join(DTYPE_BITS)})")
    if not isinstance(shape, list) or not all(map(_is_size, shape)):
        raise malformed(f"its shape {_shown(shape)} is not a list of sizes (integers from 0 to 2**64 - 1)")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_size, offsets))):
        raise malformed(f"its data_offsets {_shown(offsets)} are not [begin, end] (integers from 0 to 2**64 - 1)")
    return {"dtype": dtype, "shape": shape, "data_offsets": offsets}


def _is_size(value: Any) -> bool:
    """Whether ``value`` is what safetensors reads as a ``usize``: an integer (not a bool) in 64 bits."""
    return type(value) is int and 0 <= value <= _USIZE_MAX


def _is_str(value: Any) -> bool:
    return isinstance(value, str)


def _check_layout(path: Path, header: dict[str, dict], data_start: int, size: int) -> None:
    """In the order of their data_offsets, as safetensors checks them: the tensors one after another from the
    data's start without gaps, each of its dtype's and shape's size, the last ending where the file does."""
    data_end, key = 0, None  # where the tensor before ends, and its name
    for (start, end), key in sorted((entry["data_offsets"], key) for key, entry in header.items()):
        if data_start + end > size:
            raise ValueError(
                f"{path.name} is truncated: tensor {_shown(key)} ends at byte {data_start + end} "
                f"but the file has {size} bytes"
            )
        if start != data_end or end < start:
            raise ValueError(
                f"{path.name} is corrupt: tensor {_shown(key)} has data_offsets [{start}, {end}], "
                f"but the tensor before it ends at {data_end}"
            )
        dtype, shape = header[key]["dtype"], header[key]["shape"]
        bits = _bits(path, key, dtype, shape)
        if bits != 8 * (end - start):
            raise ValueError(
                f"{path.name} is corrupt: tensor {_shown(key)} of dtype {dtype} and shape {_shown(shape)} needs "
                f"{bits / 8:g} bytes, but its data_offsets give it {end - start}"
            )
        data_end = end
    if data_start + data_end != size:
        last = f"its last tensor, {_shown(key)}," if key is not None else "it holds no tensors: its data"
        raise ValueError(
            f"{path.name} is corrupt: {last} ends at byte {data_start + data_end} but the file has {size} bytes"
        )


def _bits(path: Path, key: str, dtype: str, shape: list[int]) -> int:
    """The bits a tensor of ``dtype`` and ``shape`` holds, refused where safetensors' 64-bit count of its elements
    or bits overflows (multiplied in order, as safetensors does) or the bits fill no whole bytes."""
    count = 1
    for size in shape:
        count *= size
        if count > _USIZE_MAX:
            break
    bits = count * DTYPE_BITS[dtype]
    if bits > _USIZE_MAX:
        raise ValueError(
            f"{path.name} is corrupt: tensor {_shown(key)} of dtype {dtype} and shape {_shown(shape)} is larger "
            "than 64 bits count (in bits, one dimension after another, as safetensors counts it)"
        )
    if bits % 8:
        raise ValueError(
            f"{path.name} is corrupt: tensor {_shown(key)} of dtype {dtype} and shape {_shown(shape)} ends "
            "inside a byte"
        )
    return bits


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxdict, _REPR.maxlist, _REPR.maxstring, _REPR.maxother, _REPR.maxlong = 3, 4, 8, 160, 160, 60


def _shown(value: Any) -> str:
    """``repr(value)``, cut short where long (a header's strings and lists may take megabytes)."""
    return _REPR.repr(value)
