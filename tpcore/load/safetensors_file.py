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
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

__all__ = ["DTYPE_BITS", "SafetensorsFile", "read_header"]

#: bits per element of the safetensors dtypes (a dtype not listed here is not size-checked)
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

    def read(self, key: str, dim: int | None = None, start: int = 0, stop: int = 0) -> torch.Tensor:
        """Tensor ``key`` (``dim`` ``None``), or its rows ``[start, stop)`` along ``dim``, in a new CPU tensor."""
        shape, dtype = self.shape(key), self.dtype(key)
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
    """A safetensors file's tensor entries, checked against its size as safetensors checks them on open.

    Raises ``ValueError`` naming the file, and the tensor and the sizes where one is at fault.
    """
    return _parse(path)[0]


def _parse(path: Path) -> tuple[dict[str, dict], int]:
    """:func:`read_header`, and where the tensors' bytes start."""
    size = path.stat().st_size
    with open(path, "rb") as file:
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
        try:
            header = json.loads(file.read(length))
        except (ValueError, RecursionError) as error:  # not JSON, not text, or nested past the parser's depth
            kind = "nested too deeply" if isinstance(error, RecursionError) else f"not valid JSON ({error})"
            raise ValueError(f"{path.name} is not a safetensors file: its header is {kind}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path.name} is not a safetensors file: its header is not a JSON object")
    header.pop("__metadata__", None)
    _check_layout(path, header, data_start, size)
    return header, data_start


def _check_layout(path: Path, header: dict, data_start: int, size: int) -> None:
    """Every entry well formed, the tensors one after another without gaps, each of its dtype's size, the
    last ending where the file does."""
    layout = []
    for key, entry in header.items():
        try:
            start, end = (int(offset) for offset in entry["data_offsets"])
            shape = [int(n) for n in entry["shape"]]
            dtype = entry["dtype"]
            if not isinstance(dtype, str):
                raise TypeError(dtype)
            layout.append((start, end, key, dtype, shape))
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{path.name} has a malformed header entry for tensor {key!r}: {entry!r}") from None
    data_end = 0  # where the tensor before ends: tensors follow each other without gaps
    for start, end, key, dtype, shape in sorted(layout):
        if data_start + end > size:
            raise ValueError(
                f"{path.name} is truncated: tensor {key!r} ends at byte {data_start + end} "
                f"but the file has {size} bytes"
            )
        if start != data_end or end < start:
            raise ValueError(
                f"{path.name} is corrupt: tensor {key!r} has data_offsets [{start}, {end}], "
                f"but the tensor before it ends at {data_end}"
            )
        bits = DTYPE_BITS.get(dtype)
        if bits is not None and math.prod(shape) * bits != 8 * (end - start):
            raise ValueError(
                f"{path.name} is corrupt: tensor {key!r} of dtype {dtype} and shape {shape} needs "
                f"{math.prod(shape) * bits / 8:g} bytes, but its data_offsets give it {end - start}"
            )
        data_end = end
    if data_start + data_end != size:
        raise ValueError(
            f"{path.name} is corrupt: its last tensor ends at byte {data_start + data_end} "
            f"but the file has {size} bytes"
        )
