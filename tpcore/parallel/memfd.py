"""CPU tensors in anonymous shared memory, which travel to another process as a file descriptor.

A segment is a ``memfd`` (Linux): memory with no name in any file system, freed when the last
descriptor and mapping of it are gone, so nothing is left behind however the processes end. The
sender passes the descriptor over a Unix socket (``SCM_RIGHTS``, :mod:`tpcore.ranks.wire`); the receiver
maps it and reads the tensors in place, without a copy through the socket.

Two ways in:

- :func:`write`: the bytes of buffers that already exist, copied once into a new segment;
- :func:`empty`: a tensor allocated in a segment of its own, which then travels with no copy at
  all. Inside :func:`gathered_outputs_shared`, tpcore's all-gathers allocate their outputs so
  (:func:`gathered_empty`): rank 0 of a served call gathers the logits straight into memory the
  caller maps.

A receiver maps segments copy-on-write (``MAP_PRIVATE``): a rank that changes an input in place
changes its own pages only, never the caller's or another rank's.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import mmap
import os
import sys
import threading
import weakref
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch

__all__ = [
    "AVAILABLE",
    "Segment",
    "empty",
    "gathered_empty",
    "gathered_outputs_shared",
    "map_private",
    "segment_of",
    "write",
]

#: anonymous shared memory and descriptor passing (Linux); elsewhere tensors go through the socket
AVAILABLE = sys.platform == "linux" and hasattr(os, "memfd_create")
#: where each buffer starts in a segment (a cache line, and every dtype's alignment)
ALIGNMENT = 64
#: gathered outputs smaller than this are plain tensors (a segment costs a few system calls)
GATHERED_MIN_BYTES = 2**20
#: segments :func:`empty` keeps open at once; past it, allocations are plain tensors (each segment holds a descriptor)
MAX_LIVE_SEGMENTS = 64


_UNTRACKED = {"trackfd": False} if sys.version_info >= (3, 13) else {}


class Segment(NamedTuple):
    """A segment's descriptor and size, and where a tensor's bytes start in it."""

    fd: int
    nbytes: int
    offset: int


_live: dict[int, tuple[int, int, weakref.ref]] = {}  # storage data_ptr -> (fd, nbytes, mapping)
_live_lock = threading.Lock()
_sharing_gathered = contextvars.ContextVar("tpcore_gathered_outputs_shared", default=False)


def _new(nbytes: int) -> int:
    fd = os.memfd_create("tpcore", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _aligned(offset: int) -> int:
    return -(-offset // ALIGNMENT) * ALIGNMENT


def write(buffers: Sequence) -> tuple[int, list[int]]:
    """A new segment holding ``buffers`` (contiguous buffers) one after another, aligned; returns its
    descriptor (the caller closes it) and each buffer's offset."""
    views = [memoryview(buffer).cast("B") for buffer in buffers]
    offsets, end = [], 0
    for view in views:
        offsets.append(_aligned(end))
        end = offsets[-1] + view.nbytes
    fd = _new(max(end, 1))
    try:
        for view, offset in zip(views, offsets, strict=True):
            done = 0
            while done < view.nbytes:  # one pwrite moves at most ~2 GiB
                done += os.pwrite(fd, view[done:], offset + done)
    except BaseException:
        os.close(fd)
        raise
    return fd, offsets


def map_private(fd: int) -> torch.Tensor:
    """The whole segment behind ``fd`` as a ``uint8`` tensor, mapped copy-on-write (writes stay in this
    process). The mapping holds no descriptor: close ``fd`` afterwards; it is unmapped with the tensor."""
    nbytes = os.fstat(fd).st_size
    return torch.from_file(f"/proc/self/fd/{fd}", shared=False, size=nbytes, dtype=torch.uint8)


def empty(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized CPU tensor in a segment of its own (:func:`segment_of` finds it); a plain tensor
    where segments are unavailable or :data:`MAX_LIVE_SEGMENTS` are in use."""
    nbytes = math.prod(shape) * dtype.itemsize
    if not AVAILABLE or nbytes == 0 or len(_live) >= MAX_LIVE_SEGMENTS:
        return torch.empty(shape, dtype=dtype)
    fd = _new(nbytes)
    try:  # the mapping object tells when the tensor is gone (it dups the descriptor before Python 3.13)
        mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE, **_UNTRACKED)
    except BaseException:
        os.close(fd)
        raise
    tensor = torch.frombuffer(mapping, dtype=torch.uint8).view(dtype).view(tuple(shape))
    key = tensor.untyped_storage().data_ptr()
    with _live_lock:
        _live[key] = (fd, nbytes, weakref.ref(mapping))
    # The tensor's storage holds the mapping; once it is gone, so is the descriptor.
    weakref.finalize(mapping, _release, key, fd)
    return tensor


def _release(key: int, fd: int) -> None:
    with _live_lock:
        if _live.get(key, (None,))[0] == fd:
            del _live[key]
    os.close(fd)


def segment_of(tensor: torch.Tensor) -> Segment | None:
    """The segment a contiguous tensor made by :func:`empty` (or a contiguous view of one) lives in."""
    if not _live or tensor.device.type != "cpu" or not tensor.is_contiguous():
        return None
    storage = tensor.untyped_storage()
    entry = _live.get(storage.data_ptr())
    if entry is None or entry[2]() is None:
        return None
    fd, nbytes, _ = entry
    return Segment(fd, nbytes, tensor.data_ptr() - storage.data_ptr())


@contextlib.contextmanager
def gathered_outputs_shared() -> Iterator[None]:
    """While inside (this thread or task), tpcore's all-gathers put large outputs in segments."""
    token = _sharing_gathered.set(AVAILABLE)
    try:
        yield
    finally:
        _sharing_gathered.reset(token)


def gathered_empty(like: torch.Tensor, dim: int, world_size: int) -> torch.Tensor:
    """The output of an all-gather of ``world_size`` tensors like ``like`` along ``dim``: in a segment
    inside :func:`gathered_outputs_shared` when it is a large CPU tensor, else ``like.new_empty``."""
    shape = list(like.shape)
    shape[dim] *= world_size
    shareable = _sharing_gathered.get() and like.device.type == "cpu"
    if shareable and math.prod(shape) * like.element_size() >= GATHERED_MIN_BYTES:
        return empty(shape, like.dtype)
    return like.new_empty(shape)
