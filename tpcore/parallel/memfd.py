"""CPU tensors in anonymous shared memory, which travel to another process as a file descriptor.

A segment is a ``memfd`` (Linux): memory with no name in any file system, freed when the last
descriptor and mapping of it are gone, so nothing is left behind however the processes end. The
sender passes the descriptor over a Unix socket (``SCM_RIGHTS``, :mod:`tpcore.ranks.wire`); the receiver
maps it and reads the tensors in place, without a copy through the socket.

Two ways in:

- :func:`write`: the bytes of buffers that already exist, copied once into a new segment;
- :func:`empty`: a tensor allocated in a segment of its own, which then travels with no copy at
  all. Inside :func:`gathered_outputs_shared`, tpcore's all-gathers allocate their outputs so
  (:func:`gathered_empty`): rank 0 of a served call gathers the logits straight into shared memory.

A receiver maps segments copy-on-write (``MAP_PRIVATE``): a rank that changes an input in place
changes its own pages only, never the caller's or another rank's.

A new segment's pages are allocated (and zeroed) by the kernel as they are first written: for a decode
step's logits (``8 x 49152`` floats, 1.5 MiB) that costs milliseconds, more than the step's round trip.
So gathered outputs up to :data:`REUSED_MAX_BYTES` go to *reused* segments (:func:`empty` with
``reused=True``), which a process keeps mapped and writes again call after call; the receiver copies
such a segment's bytes out as it reads the message (:func:`copy_out`, through a mapping it keeps too,
so that the segment's descriptor travels once), since the sender's next call overwrites them. Larger
outputs (a long prompt's logits) keep a segment of their own, which the receiver maps without a copy.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import math
import mmap
import os
import sys
import threading
import weakref
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import numpy
import torch

__all__ = [
    "AVAILABLE",
    "Segment",
    "copy_out",
    "cpu_copy",
    "empty",
    "gathered_empty",
    "gathered_outputs_shared",
    "map_private",
    "map_shared",
    "reused_held",
    "segment_of",
    "write",
]

#: anonymous shared memory and descriptor passing (Linux); elsewhere tensors go through the socket
AVAILABLE = sys.platform == "linux" and hasattr(os, "memfd_create")
#: where each buffer starts in a segment (a cache line, and every dtype's alignment)
ALIGNMENT = 64
#: gathered outputs smaller than this are plain tensors (they travel inside the message: wire.RAW_TENSOR_BYTES)
GATHERED_MIN_BYTES = 64 * 2**10
#: gathered outputs up to this size go to reused segments, copied out by the receiver; larger ones to new segments
REUSED_MAX_BYTES = 64 * 2**20
#: free reused segments a process keeps, in bytes (a receiver keeps a mapping of each while its sender does)
KEPT_BYTES = 128 * 2**20
#: segments :func:`empty` keeps open at once; past it, allocations are plain tensors (each segment holds a descriptor)
MAX_LIVE_SEGMENTS = 64


_UNTRACKED = {"trackfd": False} if sys.version_info >= (3, 13) else {}


class Segment(NamedTuple):
    """A segment's descriptor and size, where a tensor's bytes start in it, and for a reused segment (its bytes
    are to be copied out by a receiver, not kept mapped) the key that names it while this process holds it."""

    fd: int
    nbytes: int
    offset: int
    key: tuple[int, int] | None = None

    @property
    def reused(self) -> bool:
        return self.key is not None


class _Live(NamedTuple):
    fd: int
    nbytes: int
    owner: weakref.ref  # the object whose death frees the segment (the mapping, or a reused segment's array)
    key: tuple[int, int] | None  # a reused segment's (process id, serial)


_live: dict[int, _Live] = {}  # storage data_ptr -> the segment behind it
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


def empty(shape: Sequence[int], dtype: torch.dtype, reused: bool = False) -> torch.Tensor:
    """An uninitialized CPU tensor in a segment of its own (:func:`segment_of` finds it); a plain tensor
    where segments are unavailable or :data:`MAX_LIVE_SEGMENTS` are in use.

    ``reused``: in a segment this process wrote before (up to :data:`REUSED_MAX_BYTES`), which goes back
    to :data:`_REUSED` once the tensor and its views are gone; a receiver copies its bytes out."""
    nbytes = math.prod(shape) * dtype.itemsize
    if not AVAILABLE or nbytes == 0 or len(_live) >= MAX_LIVE_SEGMENTS:
        return torch.empty(shape, dtype=dtype)
    if reused and nbytes <= REUSED_MAX_BYTES:
        return _REUSED.take(nbytes).view(dtype).view(tuple(shape))
    fd = _new(nbytes)
    try:  # the mapping object tells when the tensor is gone (it dups the descriptor before Python 3.13)
        mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE, **_UNTRACKED)
    except BaseException:
        os.close(fd)
        raise
    tensor = torch.frombuffer(mapping, dtype=torch.uint8).view(dtype).view(tuple(shape))
    key = tensor.untyped_storage().data_ptr()
    with _live_lock:
        _live[key] = _Live(fd, nbytes, weakref.ref(mapping), key=None)
    # The tensor's storage holds the mapping; once it is gone, so is the descriptor.
    weakref.finalize(mapping, _release, key, fd)
    return tensor


def _release(key: int, fd: int) -> None:
    _forget(key, fd)
    os.close(fd)


def _forget(key: int, fd: int) -> None:
    with _live_lock:
        entry = _live.get(key)
        if entry is not None and entry.fd == fd:
            del _live[key]


class _ReusedSegments:
    """This process's reused segments: each kept mapped, taken for one tensor at a time, and back in the
    free ones (up to :data:`KEPT_BYTES`, by size class) once that tensor and its views are gone.

    A segment's size is a power of two, so that one serves the next call's slightly larger output (a
    growing batch). Safe to write again because a segment travels only in a reply, whose receiver copies
    it out before it sends the next call (:func:`copy_out`). Each is named by a key, ``(process id, serial)``,
    which a receiver that keeps it mapped knows it by (:mod:`tpcore.ranks.wire` sends its descriptor once)."""

    def __init__(self):
        self._free: dict[int, list[tuple[int, mmap.mmap, tuple[int, int]]]] = {}
        self._free_bytes = 0
        self._serials = itertools.count()
        self._held: set[tuple[int, int]] = set()  # the keys of the segments this process holds
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        """A ``uint8`` tensor of ``nbytes`` at the start of a free segment (a new one if none fits)."""
        size = max(mmap.PAGESIZE, 1 << (nbytes - 1).bit_length())
        with self._lock:
            free = self._free.get(size)
            fd, mapping, segment_key = free.pop() if free else (None, None, None)
            if fd is not None:
                self._free_bytes -= size
        if fd is None or mapping is None or segment_key is None:
            fd = _new(size)
            try:
                mapping = mmap.mmap(
                    fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE, **_UNTRACKED
                )
            except BaseException:
                os.close(fd)
                raise
            segment_key = (os.getpid(), next(self._serials))
            with self._lock:
                self._held.add(segment_key)
        # The array is the tensor's owner: it dies with the tensor's last view, and the segment comes back.
        array = numpy.frombuffer(mapping, dtype=numpy.uint8, count=nbytes)
        tensor = torch.from_numpy(array)
        key = tensor.untyped_storage().data_ptr()
        with _live_lock:
            _live[key] = _Live(fd, size, weakref.ref(array), segment_key)
        weakref.finalize(array, self._give_back, key, fd, mapping, size, segment_key)
        return tensor

    def _give_back(self, key: int, fd: int, mapping: mmap.mmap, size: int, segment_key: tuple[int, int]) -> None:
        _forget(key, fd)
        with self._lock:
            if self._free_bytes + size <= KEPT_BYTES:
                self._free.setdefault(size, []).append((fd, mapping, segment_key))
                self._free_bytes += size
                return
            self._held.discard(segment_key)
        os.close(fd)  # the mapping goes with its last reference

    def holds(self, segment_key: tuple[int, int]) -> bool:
        return segment_key in self._held


_REUSED = _ReusedSegments()


def reused_held(key: tuple[int, int]) -> bool:
    """Whether this process still holds the reused segment ``key`` (a receiver may keep it mapped)."""
    return _REUSED.holds(key)


def map_shared(fd: int) -> mmap.mmap:
    """A read-only mapping of the whole (reused) segment behind ``fd``, which sees what its sender writes
    next: for :func:`copy_out`. The mapping holds no descriptor: close ``fd`` afterwards."""
    return mmap.mmap(fd, os.fstat(fd).st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ, **_UNTRACKED)


def copy_out(mapping: mmap.mmap, offset: int, nbytes: int) -> numpy.ndarray:
    """A copy of ``nbytes`` at ``offset`` of a reused segment's mapping (:func:`map_shared`), in this process's
    memory: the sender writes the segment again at its next call."""
    copy = numpy.empty(nbytes, dtype=numpy.uint8)
    copy[:] = numpy.frombuffer(mapping, dtype=numpy.uint8, count=nbytes, offset=offset)
    return copy


def segment_of(tensor: torch.Tensor) -> Segment | None:
    """The segment a contiguous tensor made by :func:`empty` (or a contiguous view of one) lives in."""
    if not _live or tensor.device.type != "cpu" or not tensor.is_contiguous():
        return None
    storage = tensor.untyped_storage()
    entry = _live.get(storage.data_ptr())
    if entry is None or entry.owner() is None:
        return None
    return Segment(entry.fd, entry.nbytes, tensor.data_ptr() - storage.data_ptr(), entry.key)


@contextlib.contextmanager
def gathered_outputs_shared() -> Iterator[None]:
    """While inside (this thread or task), tpcore's all-gathers put large outputs in segments."""
    token = _sharing_gathered.set(AVAILABLE)
    try:
        yield
    finally:
        _sharing_gathered.reset(token)


def cpu_copy(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (on another device: a CUDA rank's logits) copied to the CPU: into a reused segment inside
    :func:`gathered_outputs_shared` when it is large, as the CPU ranks' gathered outputs are, rather than into
    a plain tensor that the reply would then write to a new segment."""
    shareable = _sharing_gathered.get() and tensor.numel() * tensor.element_size() >= GATHERED_MIN_BYTES
    if not shareable:
        return tensor.cpu()
    return empty(tuple(tensor.shape), tensor.dtype, reused=True).copy_(tensor)


def gathered_empty(like: torch.Tensor, dim: int, world_size: int) -> torch.Tensor:
    """The output of an all-gather of ``world_size`` tensors like ``like`` along ``dim``: in a segment
    inside :func:`gathered_outputs_shared` when it is a large CPU tensor, else ``like.new_empty``."""
    shape = list(like.shape)
    shape[dim] *= world_size
    shareable = _sharing_gathered.get() and like.device.type == "cpu"
    if shareable and math.prod(shape) * like.element_size() >= GATHERED_MIN_BYTES:
        return empty(shape, like.dtype, reused=True)
    return like.new_empty(shape)
